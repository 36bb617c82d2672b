"""Pref-GRPO pairwise win-rate reward: preference matrices and win rates against hand-worked groups."""

import math

import pytest
import torch

import rewards
from rewards.pairwise import PairwiseReward, parse_preference, prefs_from_scores, win_rates


def test_prefs_and_win_rates_by_hand():
    # group scores [3, 1, 2, 2]: sample 0 beats all (3/3 = 1); sample 1 loses all (0);
    # samples 2 and 3 beat sample 1, lose to 0, tie each other: (1 + 0 + 0.5) / 3 = 0.5
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0]])
    prefs = prefs_from_scores(scores)
    assert prefs.shape == (1, 4, 4)
    assert prefs[0, 2, 3] == 0.5 and prefs[0, 0, 1] == 1.0 and prefs[0, 1, 0] == 0.0
    assert win_rates(prefs).tolist() == [[1.0, 0.0, 0.5, 0.5]]
    # tie_eps 1.5 makes every gap below 1.5 a tie: sample 0 vs 1 (gap 2) still a win
    # sample 0: (1 + 0.5 + 0.5) / 3 = 2/3; sample 1: (0 + 0.5 + 0.5) / 3 = 1/3; samples 2, 3: 0.5
    soft = win_rates(prefs_from_scores(scores, tie_eps=1.5))
    assert soft[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0.5, 0.5])


def test_soft_preferences_sum_to_one():
    s = torch.tensor([[0.0, 1.0]])
    p = prefs_from_scores(s, temperature=1.0)
    # P(1 beats 0) = sigmoid(1) = 0.7310586
    assert p[0, 1, 0].item() == pytest.approx(1 / (1 + math.exp(-1)))
    assert (p[0, 0, 1] + p[0, 1, 0]).item() == pytest.approx(1.0)
    # group of 1: nothing to compare, 0.5
    assert win_rates(torch.zeros(2, 1, 1)).tolist() == [[0.5], [0.5]]


@pytest.mark.parametrize(
    "text, p",
    [
        ("<think>...</think><answer>Image 1 is better</answer>", 1.0),
        ("Image 2 is better.", 0.0),
        ("1", 1.0),
        ("B", 0.0),
        ("The second one", 0.0),
        ("It's a tie", 0.5),
        ("Image 1 and Image 2 are equal", 0.5),
        ("I cannot decide", 0.5),
        ("", 0.5),
    ],
)
def test_parse_preference(text, p):
    assert parse_preference(text) == p


def test_judge_counts_pairs_ties_and_unparsable():
    calls = []

    def judge(a, b, prompt):  # prefers the larger number; 2 vs 3 is unparsable
        calls.append((a, b))
        if {a, b} == {2, 3}:
            return "no idea"
        return "Image 1 is better" if a > b else "Image 2 is better"

    r = PairwiseReward(judge=judge, symmetric=False)
    prefs, win = r.win_matrix([1, 2, 3, 10, 20, 30], group_size=3)
    assert prefs.shape == (2, 3, 3) and win.shape == (2, 3)
    # group 1: 1 loses both (0); 2 beats 1, 2-vs-3 unparsable (0.5) -> 0.75; 3 beats 1, 0.5 -> 0.75
    # group 2: strict order 10 < 20 < 30 -> 0, 0.5, 1
    assert win.tolist() == [[0.0, 0.75, 0.75], [0.0, 0.5, 1.0]]
    assert len(calls) == 2 * 3  # C(3,2) = 3 pairs per group, one call each
    out = r([1, 2, 3, 10, 20, 30], group_size=3)
    assert out.tolist() == [0.0, 0.75, 0.75, 0.0, 0.5, 1.0] and r.kind == "groupwise"


def test_symmetric_judge_removes_position_bias():
    r = PairwiseReward(judge=lambda a, b, p: "Image 1 is better", symmetric=True)  # always picks the first shown
    assert r.win_matrix(["x", "y"], group_size=2)[1].tolist() == [[0.5, 0.5]]


def test_pairwise_registered_over_a_pointwise_scorer():
    texts = ["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>", "<answer>7</answer>"]
    r = rewards.load("pairwise", base="accuracy", base_kwargs={"use_math_verify": False})
    assert r.fields == ("answers",)
    # accuracy [1, 0, 1, 0] in one group: correct ones beat 2 wrong, tie 1 correct -> (1 + 1 + 0.5) / 3 = 5/6
    out = r(texts, answers=["4"] * 4, group_size=4)
    assert out.tolist() == pytest.approx([5 / 6, 1 / 6, 5 / 6, 1 / 6])
    per, total = rewards.RewardSet([{"name": "pairwise", "kwargs": {"base": "format"}}])(texts, group_size=2)
    assert per.shape == (4, 1) and total.tolist() == [0.5] * 4  # all format 0 -> all ties
    with pytest.raises(ValueError, match="group_size"):
        r(texts, answers=["4"] * 4)


# ---- VLM judge over an OpenAI-compatible endpoint (UnifiedReward-Think served by vLLM, as Pref-GRPO does) ----------
@pytest.fixture
def fake_judge_server():
    """A loopback /v1/chat/completions that prefers the brighter candidate; equal brightness gets a garbled reply."""
    import base64
    import io
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np
    from PIL import Image

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            parts = body["messages"][0]["content"]
            urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
            text = next(p["text"] for p in parts if p["type"] == "text")
            seen.append(
                {
                    "path": self.path,
                    "auth": self.headers.get("Authorization"),
                    "model": body["model"],
                    "n_images": len(urls),
                    "text": text,
                    "jpeg": all(u.startswith("data:image/jpeg;base64,") for u in urls),
                }
            )
            pix = [np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1])))).mean() for u in urls]
            half = len(pix) // 2
            first, second = float(np.mean(pix[:half])), float(np.mean(pix[half:]))
            word = "Video" if "Video 1" in text else "Image"
            if abs(first - second) < 1.0:
                reply = "<think>hard to say</think>"  # no <answer>: unparsable -> 0.5
            else:
                reply = f"<think>...</think><answer>{word} {1 if first > second else 2} is better</answer>"
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", seen
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


def test_vlm_judge_over_openai_endpoint(fake_judge_server):
    url, seen = fake_judge_server
    # one group of 4 flat grey images: 200, 50, 120, 120. Win rate = sum of preferences over the other 3:
    # 200 beats all -> 3/3 = 1; 50 loses all -> 0; each 120 beats 50, loses to 200, ties the other 120 (garbled
    # reply, 0.5) -> (1 + 0 + 0.5) / 3 = 0.5
    imgs = [torch.full((3, 8, 8), v / 255.0) for v in (200, 50, 120, 120)]
    r = rewards.load("pairwise_judge", url=url, model="judge-8b", token="tok", max_workers=4)
    assert (r.kind, r.input, r.needs_prompts) == ("groupwise", "image", True)
    out = r(imgs, ["a grey square"] * 4, group_size=4)
    assert out.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.5])
    assert len(seen) == 6  # C(4, 2) pairs, each asked once
    assert all(
        s["path"] == "/v1/chat/completions"
        and s["auth"] == "Bearer tok"
        and s["model"] == "judge-8b"
        and s["n_images"] == 2
        and s["jpeg"]
        and "「a grey square」" in s["text"]
        for s in seen
    )
    assert "Image 1 is better" in seen[0]["text"] and "<answer>" in seen[0]["text"]


def test_vlm_judge_on_videos_sends_both_frame_sequences(fake_judge_server):
    url, seen = fake_judge_server
    bright, dark = torch.full((5, 3, 8, 8), 0.9), torch.full((5, 3, 8, 8), 0.1)  # [T, 3, H, W]
    r = rewards.load("pairwise_judge", url=url, model="m", input="video", num_frames=3, symmetric=True)
    assert r.input == "video"
    assert r([dark, bright], ["a lamp"] * 2, group_size=2).tolist() == [0.0, 1.0]
    # symmetric: both orders asked; 3 frames of video 1 then 3 of video 2 in each request
    assert len(seen) == 2 and all(s["n_images"] == 6 and "Video 1" in s["text"] for s in seen)
    with pytest.raises(ValueError, match="OpenAI-compatible"):
        rewards.load("pairwise_judge", url="127.0.0.1:8080")
