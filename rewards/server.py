"""HTTP reward server (stdlib ThreadingHTTPServer): POST /<name> scores a batch; requests are batched across clients.

Loopback by default, optional bearer token. Images travel as PNG: base64 inside the JSON batch, or one raw image/png
body (prompt in the query string). Bodies come with Content-Length or `Transfer-Encoding: chunked` (what `requests`
sends for a generator), both capped at MAX_BODY. 400 bad payload, 401 token, 404 unknown name, 413 too large,
501 other transfer codings. An error answered before the whole body was read closes the connection, so leftover
body bytes are never parsed as the next request; every other answer keeps a keep-alive connection usable.
"""

import hmac
import io
import json
import queue
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmgrpo.reward import Reward, with_defaults
from rewards.api import load
from rewards.wire import decode_sample

MAX_BODY = 256 * 1024 * 1024


class _Job:
    def __init__(self, samples, prompts, fields, group_size):
        self.samples, self.prompts, self.fields, self.group_size = samples, prompts, fields, group_size
        self.done = threading.Event()
        self.result: list[float] | None = None
        self.error: Exception | None = None


class Batcher:
    """One worker thread per reward: merges queued pointwise requests (same fields) into one model call."""

    def __init__(self, reward: Reward, *, max_batch: int, wait_s: float):
        self.reward, self.max_batch, self.wait_s = reward, max_batch, wait_s
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.calls = 0
        threading.Thread(target=self._loop, daemon=True, name=f"reward-{reward.name}").start()

    def submit(self, job: _Job, timeout: float) -> list[float]:
        self.jobs.put(job)
        if not job.done.wait(timeout):
            raise TimeoutError(f"reward {self.reward.name!r} did not answer within {timeout:g} s")
        if job.error is not None:
            raise job.error
        return job.result

    def _loop(self) -> None:
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + self.wait_s
            while self.reward.kind == "pointwise" and sum(len(j.samples) for j in batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        keys = {tuple(sorted(j.fields)) for j in batch}
        has_prompts = {j.prompts is None for j in batch}
        if len(batch) > 1 and len(keys) == 1 and len(has_prompts) == 1:
            try:
                self._call(batch)
                return
            except Exception:  # noqa: BLE001, S110  one bad request must not fail the others: the loop below
                pass  # scores each job alone and hands it its own error
        for job in batch:
            try:
                self._call([job])
            except Exception as err:  # noqa: BLE001  the reward is arbitrary code: its error goes to the waiting
                job.error = err  # request (a 500 reply), and this worker thread must keep serving the rest
                job.done.set()

    def _call(self, jobs: list[_Job]) -> None:
        samples = [s for j in jobs for s in j.samples]
        prompts = None if jobs[0].prompts is None else [p for j in jobs for p in j.prompts]
        fields = {k: [v for j in jobs for v in j.fields[k]] for k in jobs[0].fields}
        if jobs[0].group_size is not None and self.reward.kind == "groupwise":
            fields["group_size"] = jobs[0].group_size
        self.calls += 1
        scores = self.reward(samples, prompts, **fields).tolist()
        start = 0
        for j in jobs:
            j.result = scores[start : start + len(j.samples)]
            start += len(j.samples)
            j.done.set()


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once; the default backlog of 5 drops SYNs

    def __init__(
        self,
        rewards: dict[str, Reward],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
        max_batch: int = 64,
        wait_ms: float = 5.0,
        timeout: float = 600.0,
    ):
        self.rewards, self.token, self.timeout_s = rewards, token, timeout
        self.batchers = {n: Batcher(r, max_batch=max_batch, wait_s=wait_ms / 1000) for n, r in rewards.items()}
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep the server quiet; the CLI prints its own line
        pass

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _authorised(self) -> bool:
        if self.server.token is None:
            return True
        got = self.headers.get("Authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {self.server.token}".encode()):
            return True
        self.close_connection = True  # any body stays unread: an unauthenticated client cannot make us buffer it
        self._send(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong bearer token"})
        return False

    def _reward_name(self) -> str:
        return self.path.split("?")[0].strip("/").removeprefix("rewards/")

    def do_GET(self):
        if not self._authorised() or self._read_body() is None:
            return
        name = self._reward_name()
        if name in ("", "rewards", "health"):
            self._send(HTTPStatus.OK, {"rewards": {n: _info(r) for n, r in self.server.rewards.items()}})
        elif name in self.server.rewards:
            self._send(HTTPStatus.OK, _info(self.server.rewards[name]))
        else:
            self._send(
                HTTPStatus.NOT_FOUND, {"error": f"unknown reward {name!r}; served: {sorted(self.server.rewards)}"}
            )

    def _refuse(self, status: int, message: str) -> None:
        """Answer an error whose body was not (fully) read: the connection closes, so no body byte is parsed later."""
        self.close_connection = True
        self._send(status, {"error": message})

    def _read_body(self) -> bytes | None:
        """The request body, Content-Length or chunked, at most MAX_BODY bytes; None after answering an error.

        Every path either reads the whole body or closes the connection: bytes left unread on a keep-alive
        connection would be parsed as the next request.
        """
        coding = self.headers.get("Transfer-Encoding")
        if coding is not None:
            if self.headers.get("Content-Length") is not None:  # RFC 9112 6.3: ambiguous framing (smuggling)
                self._refuse(HTTPStatus.BAD_REQUEST, "send Content-Length or Transfer-Encoding: chunked, not both")
                return None
            if coding.strip().lower() != "chunked":
                self._refuse(HTTPStatus.NOT_IMPLEMENTED, f"Transfer-Encoding {coding!r} is not supported; use chunked")
                return None
            try:
                return read_chunked(self.rfile, MAX_BODY)
            except BodyTooLarge as err:
                self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(err))
            except ValueError as err:
                self._refuse(HTTPStatus.BAD_REQUEST, str(err))
            return None
        raw = self.headers.get("Content-Length") or "0"
        length = int(raw) if raw.strip().isdigit() else -1
        if length < 0:
            self._refuse(HTTPStatus.BAD_REQUEST, f"Content-Length {raw!r} must be a size in bytes")
            return None
        if length > MAX_BODY:  # refused from the header alone: the body is never read
            message = f"body of {length} bytes exceeds the {MAX_BODY}-byte limit; send fewer samples per request"
            self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)
            return None
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True  # the client hung up mid-body
            return None
        return body

    def do_POST(self):
        if not self._authorised():
            return
        body = self._read_body()
        if body is None:
            return
        length = len(body)
        name = self._reward_name()
        if name not in self.server.rewards:
            self._send(
                HTTPStatus.NOT_FOUND, {"error": f"unknown reward {name!r}; served: {sorted(self.server.rewards)}"}
            )
            return
        try:
            if self.headers.get("Content-Type", "").split(";")[0].strip() == "image/png":
                job = _parse_png(body, self.path)
            else:
                job = _parse(body, length)
        except ValueError as err:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(err)})
            return
        try:
            scores = self.server.batchers[name].submit(job, self.server.timeout_s)
        except ValueError as err:  # the reward rejected the input (missing field, wrong count...)
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"reward {name!r}: {err}"})
        except Exception as err:  # noqa: BLE001  any other reward failure: answer 500 naming it, never drop the reply
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"reward {name!r} failed: {type(err).__name__}: {err}"}
            )
        else:
            self._send(HTTPStatus.OK, {"scores": scores})


class BodyTooLarge(ValueError):
    pass


def read_chunked(rfile, limit: int) -> bytes:
    """A chunked body (RFC 9112 section 7.1): size lines in hex, optional extensions and trailers; at most `limit`.

    Raises BodyTooLarge past `limit` (counted before reading the chunk) and ValueError on broken framing.
    """
    parts, total = [], 0
    while True:
        line = rfile.readline(1026)
        if not line.endswith(b"\n"):
            raise ValueError("chunked body: a chunk-size line is missing or longer than 1024 bytes")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ValueError(f"chunked body: chunk size {size_text[:20]!r} is not a hex number") from None
        if size < 0:
            raise ValueError(f"chunked body: negative chunk size {size_text[:20]!r}")
        if size == 0:
            break
        total += size
        if total > limit:
            raise BodyTooLarge(f"chunked body exceeds the {limit}-byte limit; send fewer samples per request")
        chunk = rfile.read(size)
        if len(chunk) != size or rfile.read(2) != b"\r\n":
            raise ValueError("chunked body: a chunk is shorter than its size or lacks its CRLF")
        parts.append(chunk)
    for _ in range(64):  # trailer fields up to the empty line
        line = rfile.readline(8194)
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
        if not line.endswith(b"\n"):
            raise ValueError("chunked body: the trailer section is not terminated by an empty line")
    raise ValueError("chunked body: more than 64 trailer lines")


def _info(r: Reward) -> dict:
    return {
        "name": r.name,
        "kind": r.kind,
        "input": r.input,
        "preprocess": r.preprocess,
        "fields": list(r.fields),
        "needs_prompts": bool(getattr(r, "needs_prompts", False)),
    }


def _parse(body: bytes, length: int) -> _Job:
    if not body:
        raise ValueError("empty body; send JSON {'samples': [...]} (or one PNG with Content-Type: image/png)")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"body is not JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list) or not data["samples"]:
        raise ValueError("body must be an object with a non-empty list 'samples'")
    samples = [decode_sample(s, i) for i, s in enumerate(data["samples"])]
    prompts, fields = data.get("prompts"), data.get("fields") or {}
    if prompts is not None and (not isinstance(prompts, list) or len(prompts) != len(samples)):
        raise ValueError(f"'prompts' must be a list with one string per sample ({len(samples)})")
    if not isinstance(fields, dict) or any(not isinstance(v, list) or len(v) != len(samples) for v in fields.values()):
        raise ValueError(f"'fields' must map names to lists with one entry per sample ({len(samples)})")
    return _Job(samples, prompts, fields, data.get("group_size"))


def _parse_png(body: bytes, path: str) -> _Job:
    """One raw PNG body (Content-Type: image/png), prompt in the query: `curl --data-binary @x.png URL?prompt=...`."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    try:
        image = Image.open(io.BytesIO(body)).convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ValueError(f"the image/png body is not a PNG image ({len(body)} bytes): {err}") from None
    prompts = query.get("prompt")
    return _Job([image], prompts[:1] if prompts else None, {}, None)


def make_server(
    names: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    reward_kwargs: dict[str, dict] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    **kw: Any,
) -> RewardServer:
    """Load each named reward once and bind a RewardServer (call .serve_forever(), .shutdown() to stop).

    device / dtype go to every reward whose factory takes them (model rewards), unless reward_kwargs sets them.
    """
    if not names:
        raise ValueError("serve at least one reward, e.g. --rewards pickscore,clip_score")
    defaults = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    rewards = {n: load(n, **with_defaults(n, dict((reward_kwargs or {}).get(n, {})), defaults)) for n in names}
    return RewardServer(rewards, host=host, port=port, token=token, **kw)
