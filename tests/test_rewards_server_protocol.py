"""Reward server HTTP framing on raw loopback sockets: chunked bodies, and keep-alive after every 4xx (issue 16)."""

import http.client
import json
import socket
import threading

import pytest

import rewards.server as server_mod
from rewards.api import FunctionReward
from rewards.server import RewardServer, read_chunked

VALID = json.dumps({"samples": [{"text": "abc"}, {"text": "hello"}]}).encode()
VALID_SCORES = [3.0, 5.0]  # the reward is len(text)


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_mod, "MAX_BODY", 4096)  # a tiny cap keeps the oversized cases tiny
        reward = FunctionReward(lambda samples, prompts: [float(len(s)) for s in samples], name="length")
        srv = RewardServer({"length": reward}, host="127.0.0.1", port=0, wait_ms=1)
        thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        yield srv
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def _request(body: bytes, *, headers: dict[str, str]) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST /length HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode() + body


def _valid_request() -> bytes:
    return _request(VALID, headers={"Content-Type": "application/json", "Content-Length": str(len(VALID))})


def _chunked(body: bytes, sizes: tuple[int, ...]) -> bytes:
    out, start = b"", 0
    for n in sizes:
        out += f"{n:x}\r\n".encode() + body[start : start + n] + b"\r\n"
        start += n
    assert start == len(body)
    return out + b"0\r\n\r\n"


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict, dict]]:
    """Read n responses (status, headers, JSON body) from one connection, in order."""
    reader, out = sock.makefile("rb"), []
    for _ in range(n):
        status = int(reader.readline().split()[1])
        headers = {}
        while (line := reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        out.append((status, headers, json.loads(reader.read(int(headers["content-length"])))))
    return out


def _exchange(srv: RewardServer, data: bytes, n: int) -> list[tuple[int, dict, dict]]:
    with socket.create_connection(srv.server_address[:2], timeout=10) as sock:
        sock.sendall(data)
        return _responses(sock, n)


def test_chunked_upload_then_valid_request_on_the_same_connection(server):
    chunked = _request(_chunked(VALID, (7, 1, len(VALID) - 8)), headers={"Transfer-Encoding": "chunked"})
    (s1, _, b1), (s2, h2, b2) = _exchange(server, chunked + _valid_request(), 2)
    assert (s1, b1) == (200, {"scores": VALID_SCORES})
    assert (s2, b2) == (200, {"scores": VALID_SCORES}) and h2.get("connection") != "close"


def test_chunked_extensions_and_trailers_are_accepted(server):
    body = b"5;name=value\r\n" + VALID[:5] + b"\r\n" + f"{len(VALID) - 5:x}\r\n".encode() + VALID[5:]
    body += b"\r\n0\r\nX-Checksum: 1\r\n\r\n"
    data = _request(body, headers={"Transfer-Encoding": "chunked"}) + _valid_request()
    assert [(s, b) for s, _, b in _exchange(server, data, 2)] == [(200, {"scores": VALID_SCORES})] * 2


def test_http_client_generator_body_is_sent_chunked_and_scored(server):
    # http.client (like requests) sends an iterable body with Transfer-Encoding: chunked and no Content-Length
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("POST", "/length", body=iter([VALID[:10], VALID[10:]]), encode_chunked=True)
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())) == (200, {"scores": VALID_SCORES})
    conn.request("POST", "/length", body=VALID, headers={"Content-Type": "application/json"})  # same connection
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())) == (200, {"scores": VALID_SCORES})
    conn.close()


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not JSON"),
        (b"", 400, "empty body"),
        (json.dumps({"samples": [{"png": "!!"}]}).encode(), 400, "base64 PNG"),
        (json.dumps({"samples": []}).encode(), 400, "non-empty list"),
    ],
)
def test_keep_alive_survives_a_4xx_with_a_read_body(server, body, status, words):
    bad = _request(body, headers={"Content-Length": str(len(body))})
    (s1, h1, b1), (s2, _, b2) = _exchange(server, bad + _valid_request(), 2)
    assert s1 == status and words in b1["error"] and h1.get("connection") != "close"
    assert (s2, b2) == (200, {"scores": VALID_SCORES})


def test_keep_alive_survives_a_404_with_a_chunked_body(server):
    bad = _request(_chunked(VALID, (len(VALID),)), headers={"Transfer-Encoding": "chunked"}).replace(
        b"/length", b"/nope", 1
    )
    (s1, _, b1), (s2, _, b2) = _exchange(server, bad + _valid_request(), 2)
    assert s1 == 404 and "length" in b1["error"]
    assert (s2, b2) == (200, {"scores": VALID_SCORES})


@pytest.mark.parametrize(
    "headers, body, status, words",
    [
        ({"Content-Length": "5000"}, b"x" * 5000, 413, "4096-byte limit"),  # refused from the header alone
        ({"Transfer-Encoding": "chunked"}, _chunked(b"x" * 5000, (4000, 1000)), 413, "4096-byte limit"),
        ({"Transfer-Encoding": "chunked"}, b"zz\r\nabc\r\n0\r\n\r\n", 400, "not a hex number"),
        ({"Transfer-Encoding": "chunked"}, b"a\r\nabc\r\n0\r\n\r\n", 400, "shorter than its size"),
        ({"Transfer-Encoding": "chunked", "Content-Length": "3"}, b"3\r\nabc\r\n0\r\n\r\n", 400, "not both"),
        ({"Transfer-Encoding": "gzip, chunked"}, b"", 501, "use chunked"),
        ({"Content-Length": "-1"}, b"", 400, "size in bytes"),
    ],
)
def test_an_unread_body_closes_the_connection_and_the_next_connection_works(server, headers, body, status, words):
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(_request(body, headers=headers) + _valid_request())
        ((s1, h1, b1),) = _responses(sock, 1)
        assert s1 == status and words in b1["error"] and h1["connection"] == "close"
        # the leftover bytes and the pipelined valid request are never parsed: the server hung up
        sock.settimeout(10)
        rest = b""
        try:
            while chunk := sock.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        assert b"HTTP/1.1" not in rest
    ((s2, _, b2),) = _exchange(server, _valid_request(), 1)
    assert (s2, b2) == (200, {"scores": VALID_SCORES})


def test_get_with_a_body_does_not_poison_the_connection(server):
    get = b"GET /length HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nPOST /x H"
    (s1, _, b1), (s2, _, b2) = _exchange(server, get + _valid_request(), 2)
    assert s1 == 200 and b1["name"] == "length"
    assert (s2, b2) == (200, {"scores": VALID_SCORES})


def test_read_chunked_counts_the_limit_before_reading():
    import io

    assert read_chunked(io.BytesIO(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), 5) == b"abcde"
    with pytest.raises(ValueError, match="6-byte limit"):
        read_chunked(io.BytesIO(b"ffffffffffff\r\n"), 6)  # a huge size line alone is refused, nothing allocated
    with pytest.raises(ValueError, match="trailer"):
        read_chunked(io.BytesIO(b"0\r\nX: 1"), 6)
