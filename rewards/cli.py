"""Command-line entry points: `rewards list`, `rewards score NAME SAMPLE PROMPT`, `serve-rewards --rewards a,b`.

`add_subcommands(subparsers)` plugs these into the mmgrpo CLI; each sets `func(args) -> exit code`.
"""

import argparse
import inspect
import json
import os
import sys
import types
import typing

import rewards
from mmgrpo.errors import UserError
from rewards._images import to_pil
from rewards.api import REWARDS
from rewards.client import TOKEN_ENV
from rewards.server import make_server


def _parse_kv(items: list[str] | None, flag: str) -> dict:
    """['a=1', 'b=x', 'c=[1,2]'] -> {'a': 1, 'b': 'x', 'c': [1, 2]} (values parsed as JSON when they are JSON)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"{flag} {item!r} must look like key=value, e.g. {flag} divisor=26")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _accepted_types(param: inspect.Parameter) -> tuple[type, ...] | None:
    """The plain types a keyword takes, from its annotation (else its default); None when unknown or not plain."""
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        default = param.default
        return None if default is inspect.Parameter.empty or default is None else (type(default),)
    options = (
        typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else (ann,)
    )
    if not all(isinstance(t, type) for t in options):
        return None  # Literal, list[int], a dict of sub-rewards...: the factory checks those itself
    return tuple(options)


def _type_ok(value, accepted: tuple[type, ...]) -> bool:
    if value is None:
        return type(None) in accepted
    if isinstance(value, bool):  # JSON true is a bool, not the number 1
        return bool in accepted
    if isinstance(value, int) and float in accepted:
        return True
    return isinstance(value, accepted)


def check_kwarg_types(name: str, kwargs: dict, flag: str = "--kw") -> None:
    """Refuse a keyword whose value has the wrong plain type (`atol=abc` for a float) before the reward is built."""
    if name.startswith(("http://", "https://")) or name not in REWARDS:
        return
    REWARDS.check_kwargs(name, kwargs, field=flag)
    params = inspect.signature(REWARDS.get(name)).parameters
    for key, value in kwargs.items():
        accepted = _accepted_types(params[key]) if key in params else None
        if accepted is None or _type_ok(value, accepted):
            continue
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
        default = params[key].default
        example = f"{key}={json.dumps(default)}" if default is not inspect.Parameter.empty else f"{key}=..."
        shown = value if isinstance(value, str) else json.dumps(value)
        raise UserError(f"{flag} {key}={shown}: reward {name!r} takes a {wanted} for {key!r}, e.g. {flag} {example}")


def cmd_list(args: argparse.Namespace) -> int:
    desc = rewards.describe()
    width = max(map(len, desc))
    for name, line in desc.items():
        meta = rewards.info(name)
        kind = "groupwise" if meta.get("kind") == "groupwise" else "pointwise"
        print(f"{name:<{width}}  [{meta.get('input', '?'):<5} {kind:<9}] {line}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    kwargs = _parse_kv(args.kw, "--kw")
    fields = {k: [v] for k, v in _parse_kv(args.field, "--field").items()}
    try:
        check_kwarg_types(args.name, kwargs)
        reward = rewards.load(args.name, **kwargs)
    except ValueError as err:
        raise UserError(str(err)) from None
    except TypeError as err:  # a keyword of a type the checks above could not see (e.g. inside a nested dict)
        given = " ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UserError(
            f"--kw {given}: reward {args.name!r} cannot use these values ({err}); fix their types"
        ) from None
    if reward.input == "text":
        sample = args.sample
    elif os.path.isfile(args.sample):
        sample = args.sample
        if reward.input == "image":
            sample = to_pil(args.sample)
    else:
        raise UserError(f"reward {args.name!r} scores {reward.input}s: {args.sample!r} is not a file")
    try:
        score = reward(
            [sample],
            [args.prompt] if args.prompt is not None else None,
            **fields,
            **({"group_size": 1} if reward.kind == "groupwise" else {}),
        )
    except ValueError as err:
        raise UserError(f"reward {args.name!r}: {err}") from None
    print(json.dumps({"reward": args.name, "score": score.item()}) if args.json else f"{score.item():.6g}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(
            f"--port {args.port} is not a TCP port; use 1-65535 (e.g. --port 8000), or 0 for any free port"
        )
    if args.max_batch < 1:
        raise UserError(f"--max-batch {args.max_batch} must be >= 1, e.g. --max-batch 64")
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        print(
            f"warning: serving on {args.host} without --token: anyone on the network can use these models",
            file=sys.stderr,
        )
    try:
        server = make_server(
            names,
            host=args.host,
            port=args.port,
            token=token,
            max_batch=args.max_batch,
            device=args.device,
            dtype=args.dtype,
        )
    except ValueError as err:
        raise UserError(str(err)) from None
    except OSError as err:
        raise UserError(f"cannot bind {args.host}:{args.port}: {err.strerror or err}; pick another --port") from None
    print(f"serving {', '.join(names)} on {server.url} (POST {server.url}/<name>; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def add_subcommands(subparsers) -> None:
    """Add `rewards {list,score}` and `serve-rewards` to an argparse subparsers object."""
    p = subparsers.add_parser("rewards", help="list reward models and rule rewards, or score one sample")
    sub = p.add_subparsers(dest="rewards_command", required=True)
    ls = sub.add_parser("list", help="every reward with its input kind and a one-line description")
    ls.set_defaults(func=cmd_list)
    sc = sub.add_parser("score", help="score one image, video or text with a reward")
    sc.add_argument("name", help="reward name (see `rewards list`) or http://host:port/<name>")
    sc.add_argument("sample", metavar="IMAGE_OR_TEXT", help="an image/video path, or the text to score")
    sc.add_argument("prompt", nargs="?", default=None, help="the prompt (needed by image-text rewards)")
    sc.add_argument("--kw", action="append", metavar="KEY=VALUE", help="reward keyword, e.g. --kw divisor=26")
    sc.add_argument("--field", action="append", metavar="KEY=VALUE", help="ground truth, e.g. --field answers=4")
    sc.add_argument("--json", action="store_true", help="print a JSON object instead of the bare score")
    sc.set_defaults(func=cmd_score)
    sv = subparsers.add_parser("serve-rewards", help="serve rewards over HTTP (loopback by default)")
    sv.add_argument("--rewards", required=True, help="comma-separated reward names, e.g. pickscore,clip_score")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--token", default=None, help="require 'Authorization: Bearer TOKEN' (default: $MMGRPO_REWARDS_TOKEN if set)"
    )
    sv.add_argument("--max-batch", type=int, default=64, help="merge concurrent requests up to this many samples")
    sv.add_argument("--device", default=None, help="device of the model rewards, e.g. cuda or cuda:1 (default cpu)")
    sv.add_argument("--dtype", default=None, help="dtype of the model rewards: float32, bfloat16, float16")
    sv.set_defaults(func=cmd_serve)
