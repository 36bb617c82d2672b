"""The `mmgrpo` command: train, eval, sample, config, list, doctor, and the plugins' sub-commands (rewards,
serve-rewards, pretrain: the `mmgrpo.commands` entry points).

User errors print one line and exit 2 (no traceback); `--debug` shows the traceback.
"""

import argparse
import os
import sys
import traceback
from pathlib import Path

import yaml

from mmgrpo import advantages, checkpoint, losses, reward, sampling
from mmgrpo.config import load_config
from mmgrpo.doctor import add_subcommand as add_doctor
from mmgrpo.errors import TrainingStopped, UserError
from mmgrpo.looking import format_looking
from mmgrpo.plugins import PIPELINES, command_adders, load_plugins
from mmgrpo.recipes import recipe_names, resolve_recipe
from mmgrpo.report import refresh_report
from mmgrpo.rundir import resume_command

EXAMPLES = """examples:
  mmgrpo train configs/toy_count.yaml                      train the toy counting policy (seconds on a CPU)
  mmgrpo train shapes_t2i                                  a shipped recipe by name (also from an installed wheel)
  mmgrpo train configs/toy_count.yaml run.steps=100 algo.kl_coef=0.01 sample.group_size=16
  accelerate launch --multi_gpu --num_processes 2 -m mmgrpo.cli train configs/toy_count.yaml   (GPUs or CPU)
  mmgrpo --debug train configs/toy_count.yaml run.steps=5  errors with the full traceback
  mmgrpo eval configs/toy_count.yaml ckpt=latest            per-category reward table of the newest checkpoint
  mmgrpo eval configs/vlm/shapes_vqa.yaml ckpt=none limit=64 ablate=blank,shuffle   real vs blank vs shuffled images
  mmgrpo sample configs/toy_count.yaml ckpt=latest out=samples/
  mmgrpo config configs/toy_count.yaml algo.loss=clipped    print the validated, resolved config
  mmgrpo list advantages                                   registered names with one-line descriptions
  mmgrpo pretrain shapes-vlm --minutes 45                  retrain a shipped ShapesWorld model (see assets/README.md)
  mmgrpo rewards list
"""


def _split_special(items: list[str], keys: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Pull `ckpt=...`-style arguments out of the override list."""
    rest, special = [], {}
    for item in items:
        key = item.split("=", 1)[0]
        if "=" in item and key in keys:
            special[key] = item.split("=", 1)[1]
        else:
            rest.append(item)
    return rest, special


def _int(special: dict[str, str], key: str, default: int) -> int:
    """A whole-number argument; >= 1 when its default is (counts and sizes), >= 0 otherwise (0: no limit)."""
    least = 1 if default >= 1 else 0
    try:
        value = int(special.get(key, default))
    except ValueError:
        raise UserError(f"{key}={special[key]!r} must be a whole number, e.g. {key}={default}") from None
    if value < least:
        raise UserError(f"{key}={value} must be >= {least}, e.g. {key}={default}")
    return value


def _bool(special: dict[str, str], key: str) -> bool:
    value = special.get(key, "false").lower()
    if value not in ("true", "false"):
        raise UserError(f"{key}={special[key]!r} must be true or false, e.g. {key}=true")
    return value == "true"


def cmd_train(args) -> int:
    # lazy: the trainer imports accelerate; CLI start-up (`mmgrpo --help`) stays light
    from mmgrpo.trainer import train

    cfg = load_config(args.config, args.overrides)
    out = train(cfg)
    if out["stopped"]:
        print(
            f"stopped by {out['stopped']}: checkpoint {out['checkpoint']}; resume with: "
            f"{resume_command(args.config, args.overrides, out['checkpoint'])}"
        )
        return 0
    reward = out["metrics"].get("reward/total_mean")
    print(f"done: {out['run_dir']}" + (f" (last reward {reward:.4f})" if reward is not None else ""))
    return 0


EVAL_HELP = (
    "score a checkpoint on held-out prompts (ckpt=latest|DIR|none, limit=, group_size=, "
    "ablate=auto|none|blank,shuffle, samples=, ema=true)"
)


def cmd_eval(args) -> int:
    # lazy: evaluate imports accelerate; CLI start-up (`mmgrpo --help`) stays light
    from mmgrpo.evaluate import evaluate_run, format_table

    overrides, sp = _split_special(args.overrides, ("ckpt", "group_size", "limit", "ema", "ablate", "samples"))
    cfg = load_config(args.config, overrides)
    result, path = evaluate_run(
        cfg,
        sp.get("ckpt", "latest"),
        group_size=_int(sp, "group_size", 4),
        limit=_int(sp, "limit", 0) or None,
        ema=_bool(sp, "ema"),
        ablate=sp.get("ablate", "auto"),
        samples=0 if sp.get("samples", "").strip() == "0" else _int(sp, "samples", 6),
    )
    print(format_table(result["conditions"]["real"]))
    if len(result["conditions"]) > 1:
        print(
            f"\nis it looking? the same records and seeds with real, blank and another record's pixels "
            f"(ckpt {result['label']}, {result['group_size']} samples per record)"
        )
        print(format_looking(result))
    report = refresh_report(path.parent.parent)
    print(f"eval results: {path}" + (f"; report: {report}" if report else ""))
    return 0


def cmd_sample(args) -> int:
    # lazy: evaluate imports accelerate; CLI start-up (`mmgrpo --help`) stays light
    from mmgrpo.evaluate import sample

    overrides, sp = _split_special(args.overrides, ("ckpt", "out", "n", "group_size", "ema"))
    cfg = load_config(args.config, overrides)
    out = sp.get("out", os.path.join(cfg.run.output_dir, "samples"))
    if not out.strip() or os.path.exists(out) and not os.path.isdir(out):
        raise UserError(
            f"out={out!r} is {'empty' if not out.strip() else 'an existing file'}; samples are written "
            f"into a directory, e.g. out=samples/"
        )
    path = sample(
        cfg,
        sp.get("ckpt", "latest"),
        out,
        num_prompts=_int(sp, "n", 4),
        group_size=_int(sp, "group_size", 4),
        ema=_bool(sp, "ema"),
    )
    print(f"samples written to {path}")
    return 0


def cmd_config(args) -> int:
    print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False), end="")
    return 0


def _recipes() -> dict[str, str]:
    """shipped recipe name -> the first line of its header comment (what it trains)."""
    out = {}
    for name in recipe_names():
        lines = resolve_recipe(name).read_text(encoding="utf-8").splitlines()
        out[name] = next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), "")
    return out


def cmd_list(args) -> int:
    load_plugins()  # the installed packages register their pipelines and rewards
    tables = {
        "advantages": advantages.ADVANTAGES.describe,
        "losses": losses.POLICY_LOSSES.describe,
        "aggregations": losses.AGGREGATIONS.describe,
        "kl": losses.KL.describe,
        "samplers": sampling.SAMPLERS.describe,
        "pipelines": PIPELINES.describe,
        "rewards": reward.describe,
        "recipes": _recipes,
    }
    kinds = list(tables) if args.kind == "all" else [args.kind]
    for kind in kinds:
        if kind not in tables:
            raise UserError(f"mmgrpo list: unknown kind {kind!r}; choose from: all, {', '.join(tables)}")
        print(f"{kind}:")
        for name, doc in tables[kind]().items():
            print(f"  {name:<26} {doc}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error contract: a usage mistake is one line on stderr and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mmgrpo",
        description="Group-relative policy optimisation for generators, VLMs and video LLMs.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, func, text in [
        ("train", cmd_train, "train a policy from a YAML recipe (+ key.sub=value overrides)"),
        ("eval", cmd_eval, EVAL_HELP),
        ("sample", cmd_sample, "save samples of a checkpoint (ckpt=, out=, n=, ema=true)"),
        ("config", cmd_config, "validate a recipe and print the resolved config"),
    ]:
        examples = "".join(line + "\n" for line in EXAMPLES.splitlines() if f" {name} " in line)
        sp = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog="examples:\n" + examples,
            formatter_class=argparse.RawTextHelpFormatter,
        )
        sp.add_argument("config", help="YAML recipe, e.g. configs/toy_count.yaml, or a shipped one's name (toy_count)")
        sp.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. algo.kl_coef=0.01")
        sp.set_defaults(func=func)
    sp = sub.add_parser("list", help="list registered components with one-line descriptions")
    sp.add_argument(
        "kind",
        nargs="?",
        default="all",
        help="all, advantages, losses, aggregations, kl, samplers, pipelines, rewards, recipes",
    )
    sp.set_defaults(func=cmd_list)

    add_doctor(sub)  # `mmgrpo doctor`: GPU smoke test (mmgrpo/doctor.py)
    for add in command_adders(lambda line: print(line, file=sys.stderr)):  # `rewards`, `serve-rewards`, `pretrain`...
        add(sub)
    return p


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _stopped_line(args, err) -> str:
    line = f"mmgrpo: {_one_line(err)}"
    ckpt = getattr(err, "checkpoint", None)
    if ckpt is not None and getattr(args, "command", None) == "train":
        line += f"; resume with: {resume_command(args.config, args.overrides, ckpt)}"
    return line


def _resume_hint(args) -> str:
    """For `train` that crashed or was interrupted: the newest valid checkpoint of its run and the command that
    resumes it (empty when there is none, or the config cannot be read)."""
    if getattr(args, "command", None) != "train":
        return ""
    try:
        cfg = load_config(args.config, args.overrides)
        ckpt = checkpoint.latest_valid(Path(cfg.run.output_dir) / "checkpoints", log=lambda msg: None)
    except Exception:  # noqa: BLE001  only a hint: never hide the error being reported
        return ""
    return (
        f"; newest checkpoint {ckpt}; resume with: {resume_command(args.config, args.overrides, ckpt)}"
        if ckpt is not None
        else ""
    )


def main(argv: list[str] | None = None) -> int:
    """Every sub-command's error contract: bad input is one line on stderr and exit 2 (the traceback only with
    --debug); a run that stopped on purpose (NaNs, a failing reward) is one line naming its checkpoint and the
    command that resumes it, exit 1; Ctrl-C outside training is exit 130."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error already printed as one line (2)
        return done.code if isinstance(done.code, int) else 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2

    try:
        return int(args.func(args) or 0)
    except TrainingStopped as err:
        if args.debug:
            traceback.print_exc()
        print(_stopped_line(args, err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mmgrpo: interrupted{_resume_hint(args)}", file=sys.stderr)
        return 130
    except SystemExit as done:  # a sub-command's own argparse (pretrain) has printed its one line
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    except (ValueError, OSError, LookupError) as err:  # UserError, decode errors, missing/unreadable files
        if args.debug:
            traceback.print_exc()
        print(f"mmgrpo: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001  a bug: still one line, and the way to see more
        if args.debug:
            traceback.print_exc()
        print(
            f"mmgrpo: error: unexpected {type(err).__name__}: {_one_line(err)} (rerun with --debug for the "
            f"traceback and report it){_resume_hint(args)}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
