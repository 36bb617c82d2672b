"""HTTP client reward: `rewards.load("http://127.0.0.1:8000/pickscore")` scores through a RewardServer.

Timeout and retries with backoff on connection errors and 502/503/504; 4xx answers raise ValueError with the message;
a server still unreachable after the retries raises ServerUnreachable, one line naming the URL (a UserError to the CLI).
"""

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mmgrpo.errors import UserError
from mmgrpo.reward import Reward, set_url_client
from rewards.wire import encode_sample

TOKEN_ENV = "MMGRPO_REWARDS_TOKEN"  # read by the client and by `mmgrpo serve-rewards` when no token is passed


class ServerUnreachable(ConnectionError, UserError):
    """No answer from a server after every retry: a ConnectionError to callers, one line and exit 2 to the CLI."""


class HttpReward(Reward):
    """A Reward whose scoring runs on a remote RewardServer; kind, input and fields come from the server."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        **unknown: Any,
    ):
        if unknown:  # the remote reward's own keywords are fixed where it is served, not by its clients
            raise ValueError(
                f"reward URL {url!r} takes no keyword {', '.join(map(repr, unknown))}; it accepts token, timeout, "
                "retries, backoff (set the reward's own keywords on the server that serves it)"
            )
        parts = urllib.parse.urlsplit(url)
        name = parts.path.strip("/").removeprefix("rewards/")
        if not name or "/" in name:
            raise ValueError(f"reward URL {url!r} must look like http://host:port/<reward name>")
        if retries < 0 or timeout <= 0:
            raise ValueError(f"retries={retries} must be >= 0 and timeout={timeout} > 0")
        self.base = f"{parts.scheme}://{parts.netloc}"
        self.url, self.token, self.timeout, self.retries, self.backoff = (
            f"{self.base}/{name}",
            token if token is not None else os.environ.get(TOKEN_ENV) or None,
            timeout,
            retries,
            backoff,
        )
        info = self._request("GET", None)
        self.name, self.kind, self.input = info["name"], info["kind"], info["input"]
        self.fields, self.needs_prompts = tuple(info["fields"]), bool(info["needs_prompts"])
        self.preprocess = f"remote {self.url}: {info['preprocess']}"

    def _request(self, method: str, payload: dict | None) -> dict:
        return request_json(
            method,
            self.url,
            payload,
            token=self.token,
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
            what="reward server",
        )

    def score(self, samples, prompts, **fields):
        payload = {
            "samples": [encode_sample(s, self.input) for s in samples],
            "prompts": prompts,
            "fields": {k: _jsonable(v, len(samples)) for k, v in fields.items() if k != "group_size"},
            "group_size": fields.get("group_size"),
        }
        scores = self._request("POST", payload)["scores"]
        return [float("nan") if s is None else s for s in scores]


set_url_client(HttpReward)  # the core's load() hands every http(s):// name to this client


def request_json(
    method: str,
    url: str,
    payload: dict | None,
    *,
    token: str | None,
    timeout: float,
    retries: int,
    backoff: float,
    what: str = "server",
) -> dict:
    """One JSON request with retries (exponential backoff) on connection errors and 502/503/504.

    A 4xx answer raises ValueError with the server's message (no retry: the request itself is wrong).
    """
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            message = _error_text(err)
            if err.code in (502, 503, 504):
                last = RuntimeError(f"{url} answered {err.code}: {message}")
                continue
            if 400 <= err.code < 500:
                raise ValueError(f"{url} answered {err.code}: {message}") from None
            raise RuntimeError(f"{url} answered {err.code}: {message}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            last = err
    reason = " ".join(str(getattr(last, "reason", last)).split())
    raise ServerUnreachable(
        f"{what} {url} unreachable after {retries + 1} attempts (timeout {timeout:g} s): {reason}; "
        f"start it (e.g. `mmgrpo serve-rewards --rewards NAME --port PORT`) or fix the URL"
    )


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read())
        message = body.get("error", "")
        return message.get("message", str(message)) if isinstance(message, dict) else message  # OpenAI-style
    except (json.JSONDecodeError, AttributeError, OSError, ValueError):
        return err.reason


def _jsonable(v: Any, n: int) -> list:
    """A field as a JSON list with one entry per sample; a scalar (e.g. Trust-GRPO's `step`) is repeated n times."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, str | int | float | bool) or v is None:
        return [v] * n
    return [x.tolist() if hasattr(x, "tolist") else x for x in v]
