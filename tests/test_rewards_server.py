"""HTTP reward server and client on loopback: status codes, token, batching, and a bounded 200-request load test."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import rewards
from rewards.server import make_server

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server():
    srv = make_server(
        ["edit_similarity", "jpeg_incompressibility", "pairwise", "trust_grpo"],
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        reward_kwargs={
            "pairwise": {"base": "format"},
            "trust_grpo": {"answer": {"name": "accuracy", "kwargs": {"use_math_verify": False}}},
        },
        device="cpu",
        wait_ms=20,
    )
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


def _post(url, payload, token=TOKEN):
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_client_matches_local_scores(server):
    remote = rewards.load(f"{server.url}/edit_similarity", token=TOKEN)
    local = rewards.load("edit_similarity")
    assert (remote.kind, remote.input, remote.fields) == ("pointwise", "text", ("answers",))
    texts, answers = ["hello world", "hel1o", ""], ["hello world", "hello", "abc"]
    torch.testing.assert_close(remote(texts, answers=answers), local(texts, answers=answers))


def test_images_travel_as_png(server):
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8), np.zeros((8, 8, 3), np.uint8)]
    remote = rewards.load(f"{server.url}/jpeg_incompressibility", token=TOKEN)
    # PNG is lossless, so the server sees the same pixels and computes the same JPEG size
    assert remote(imgs).tolist() == pytest.approx(rewards.load("jpeg_incompressibility")(imgs).tolist())


def test_raw_png_body(server):
    # curl --data-binary @x.png -H "Content-Type: image/png" URL?prompt=...: one image, PNG bytes as the body
    import io

    from PIL import Image

    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, size=(12, 20, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")

    def post(body):
        req = urllib.request.Request(
            f"{server.url}/jpeg_incompressibility?prompt=a+noisy+patch",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "image/png"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    code, body = post(buf.getvalue())
    assert code == 200 and body["scores"] == pytest.approx(rewards.load("jpeg_incompressibility")([img]).tolist())
    code, body = post(b"not a png")
    assert code == 400 and "not a PNG" in body["error"]


def test_groupwise_over_http(server):
    remote = rewards.load(f"{server.url}/pairwise", token=TOKEN)
    texts = ["<think>a</think><answer>b</answer>", "x", "y", "<think>a</think><answer>b</answer>"]
    assert remote.kind == "groupwise"
    assert remote(texts, group_size=2).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_scalar_fields_and_token_from_the_environment(server, monkeypatch):
    # Trust-GRPO reads a scalar `step`; the client sends it as one entry per sample. The token comes from
    # $MMGRPO_REWARDS_TOKEN when not passed.
    from rewards.client import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    remote = rewards.load(f"{server.url}/trust_grpo")
    local = rewards.load("trust_grpo", answer={"name": "accuracy", "kwargs": {"use_math_verify": False}})
    texts = ["<think>a</think><answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>", "x"]
    kw = {"group_size": 2, "answers": ["4"] * 4, "step": 30}
    torch.testing.assert_close(remote(texts, **kw), local(texts, **kw))
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ValueError, match="401"):
        rewards.load(f"{server.url}/trust_grpo")


def test_status_codes(server):
    ok = {"samples": [{"text": "a"}], "fields": {"answers": ["a"]}}
    assert _post(f"{server.url}/edit_similarity", ok) == (200, {"scores": [1.0]})
    code, body = _post(f"{server.url}/edit_similarity", ok, token="wrong")
    assert code == 401 and "token" in body["error"]
    code, body = _post(f"{server.url}/nope", ok)
    assert code == 404 and "edit_similarity" in body["error"]
    code, body = _post(f"{server.url}/edit_similarity", {"samples": [{"png": "not base64!"}]})
    assert code == 400 and "base64 PNG" in body["error"]
    code, body = _post(f"{server.url}/edit_similarity", {"samples": [{"text": "a"}]})  # missing answers
    assert code == 400 and "answers" in body["error"]
    code, body = _post(f"{server.url}/edit_similarity", {"samples": []})
    assert code == 400
    # a body larger than MAX_BODY is refused from its Content-Length alone (never read), then the socket closes
    import http.client

    from rewards.server import MAX_BODY

    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.putrequest("POST", "/edit_similarity")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(MAX_BODY + 1))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and f"{MAX_BODY}-byte limit" in json.loads(resp.read())["error"]
    assert resp.getheader("Connection") == "close"
    conn.close()
    with pytest.raises(ValueError, match="401"):
        rewards.load(f"{server.url}/edit_similarity", token="wrong")
    with pytest.raises(ValueError, match="404"):
        rewards.load(f"{server.url}/nope", token=TOKEN)


def test_unreachable_server_retries_then_fails():
    from rewards.client import ServerUnreachable

    with pytest.raises(ServerUnreachable, match="unreachable after 2 attempts") as info:
        rewards.load("http://127.0.0.1:9/edit_similarity", retries=1, backoff=0.01, timeout=2)
    # a ConnectionError to library callers, a UserError (one line, exit 2) to the CLI
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, rewards.UserError)
    assert "http://127.0.0.1:9/edit_similarity" in str(info.value) and "\n" not in str(info.value)


def test_loopback_load_200_concurrent_requests(server):
    n = 200
    client = rewards.load(f"{server.url}/edit_similarity", token=TOKEN, timeout=60)
    local = rewards.load("edit_similarity")
    texts = [f"sample number {i}" for i in range(n)]
    answers = [f"sample number {i * 7 % n}" for i in range(n)]
    expect = local(texts, answers=answers).tolist()
    barrier = threading.Barrier(n)
    calls_before = server.batchers["edit_similarity"].calls

    def one(i):
        barrier.wait(timeout=60)  # release all 200 requests together
        return client([texts[i]], answers=[answers[i]]).item()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        got = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    assert got == pytest.approx(expect)
    calls = server.batchers["edit_similarity"].calls - calls_before
    assert 1 <= calls <= n  # requests were merged into at most n model calls
    print(f"load test: {n} concurrent requests answered correctly in {calls} batched reward calls, {wall:.2f} s")


def test_batcher_merges_queued_requests_into_one_call():
    # deterministic cross-client batching: the first call blocks until 9 more requests wait in the queue;
    # those 9 (from 9 client threads) are then scored by ONE reward call, each getting its own slice back
    from rewards.api import FunctionReward
    from rewards.server import Batcher, _Job

    release, calls = threading.Event(), []

    def score(samples, prompts):
        calls.append(list(samples))
        if len(calls) == 1:
            release.wait(30)
        return [float(len(t)) for t in samples]

    batcher = Batcher(FunctionReward(score, name="len"), max_batch=64, wait_s=0.01)
    results = {}

    def client(i):
        results[i] = batcher.submit(_Job(["x" * i, "y" * (i + 10)], None, {}, None), timeout=60)

    first = threading.Thread(target=client, args=(0,))
    first.start()
    while not calls:  # the worker is inside the first call
        time.sleep(0.001)
    others = [threading.Thread(target=client, args=(i,)) for i in range(1, 10)]
    for t in others:
        t.start()
    while batcher.jobs.qsize() < 9:
        time.sleep(0.001)
    release.set()
    for t in [first, *others]:
        t.join(60)
    assert len(calls) == 2 and len(calls[1]) == 18  # 9 requests x 2 samples merged into the second call
    assert results == {i: [float(i), float(i + 10)] for i in range(10)}


def test_client_retries_5xx_but_not_4xx():
    # a flaky server: the first POST answers 503 (retried), a POST of "bad" answers 400 (raised at once, no retry)
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    posts = []

    class Flaky(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code, payload):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            info = {
                "name": "t",
                "kind": "pointwise",
                "input": "text",
                "preprocess": "",
                "fields": [],
                "needs_prompts": False,
            }
            self._send(200, info)

        def do_POST(self):
            data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append(data["samples"][0]["text"])
            if data["samples"][0]["text"] == "bad":
                self._send(400, {"error": "bad sample"})
            elif len(posts) == 1:
                self._send(503, {"error": "warming up"})
            else:
                self._send(200, {"scores": [7.0]})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        client = rewards.load(f"http://127.0.0.1:{srv.server_address[1]}/t", retries=2, backoff=0.01)
        assert client(["ok"]).tolist() == [7.0] and posts == ["ok", "ok"]
        with pytest.raises(ValueError, match="400: bad sample"):
            client(["bad"])
        assert posts == ["ok", "ok", "bad"]
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def test_url_reward_refuses_the_remote_rewards_keywords():
    # refused before any request: a recipe's kwargs for a URL reward would otherwise end in a TypeError
    with pytest.raises(ValueError, match=r"takes no keyword 'max_len'; it accepts token, timeout"):
        rewards.load("http://127.0.0.1:9/toy_count", max_len=8)
