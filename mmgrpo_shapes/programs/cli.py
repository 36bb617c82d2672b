"""`mmgrpo pretrain NAME [args]`: retrain a shipped ShapesWorld model with its pretraining script.

Declared under `[project.entry-points."mmgrpo.commands"]` in pyproject.toml, so the core CLI adds it without
naming this package.
"""

import argparse
import importlib

from mmgrpo.errors import UserError

PRETRAIN = {
    "shapes-t2i": ("mmgrpo_shapes.programs.pretrain_t2i", []),
    "shapes-vlm": ("mmgrpo_shapes.programs.pretrain_vlm", ["--task", "vqa"]),
    "shapes-video": ("mmgrpo_shapes.programs.pretrain_video", []),
}
"""`mmgrpo pretrain NAME [args]`: the module whose main(argv) trains NAME, and the arguments it always gets"""


def cmd_pretrain(args) -> int:
    if args.name not in PRETRAIN:
        raise UserError(f"mmgrpo pretrain: unknown model {args.name!r}; choose from: {', '.join(PRETRAIN)}")
    module, fixed = PRETRAIN[args.name]
    usage_error = argparse.ArgumentParser.error
    prog = f"mmgrpo pretrain {args.name}"

    def one_line(parser, message: str):  # the module's own parser: a usage mistake is one line, too
        parser.exit(2, f"{prog}: error: {' '.join(message.split())}; see `{prog} --help`\n")

    argparse.ArgumentParser.error = one_line
    try:
        importlib.import_module(module).main(fixed + list(args.args))
    finally:
        argparse.ArgumentParser.error = usage_error
    return 0


def add_subcommands(subparsers) -> None:
    """Add `pretrain` to the mmgrpo CLI (entry point `mmgrpo.commands`)."""
    sp = subparsers.add_parser("pretrain", help=f"retrain a shipped ShapesWorld model ({', '.join(PRETRAIN)})")
    sp.add_argument("name", help=", ".join(PRETRAIN))
    sp.add_argument("args", nargs=argparse.REMAINDER, help="passed on, e.g. --minutes 45 --out /tmp/model")
    sp.set_defaults(func=cmd_pretrain)
