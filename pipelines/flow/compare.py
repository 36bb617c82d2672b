"""Before/after verifier table of a flow recipe on its held-out prompts, saved for report.html (which it rewrites).

`python -m pipelines.flow.compare configs/flow/shapes_t2i.yaml [overrides]` (the second half of `make demo`).
Both sides use the same eval prompts, the same per-prompt seeds and deterministic ODE sampling (noise_level 0,
independent initial noises), so the only difference is the weights: the base model (ckpt=none) or the newest
checkpoint of run.output_dir. Results go to <run>/eval/ as `mmgrpo eval` writes them (tables, sample galleries on
the same prompts and seeds), and report.html is rewritten to lead with them.
"""

import argparse
import json
import sys
from pathlib import Path

from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.evaluate import evaluate_run
from mmgrpo.report import refresh_report
from mmgrpo.reward import REWARDS

EVAL_OVERRIDES = (
    "pipeline.kwargs.noise_level=0",
    "pipeline.kwargs.plan=independent",
    "pipeline.kwargs.plan_kwargs={train: all}",
    "pipeline.kwargs.objective=grpo",
    "pipeline.kwargs.same_noise_per_group=false",
)
"""ODE sampling from one fresh noise per image, whatever plan / objective the recipe trains with (FlowPolicy's
for_evaluation applies the same settings, so `mmgrpo eval` and `sample` agree with this tool)."""


def compare_table(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    columns: list[str],
    points: set[str] | None = None,
) -> str:
    """Rows = categories ("all" first), for each column: before, after and the change, in points (x 100) for the
    `points` columns (scores in [0, 1]; None: all), as a plain difference for the others (objects per image)."""
    head = f"{'category':<16}{'n':>5}" + "".join(
        f"{c + ' before':>16}{c + ' after':>15}{'change':>9}" for c in columns
    )
    score = {c: points is None or c in points for c in columns}
    lines = [head, "-" * len(head)]
    for cat, row in before.items():
        cells = "".join(
            f"{row[c]:>16.3f}{after[cat][c]:>15.3f}"
            + (f"{100 * (after[cat][c] - row[c]):>+9.1f}" if score[c] else f"{after[cat][c] - row[c]:>+9.3f}")
            for c in columns
        )
        lines.append(f"{cat:<16}{int(row['n']):>5}" + cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.flow.compare", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as for mmgrpo train")
    ap.add_argument("--group-size", type=int, default=16, help="images per eval prompt (16)")
    ap.add_argument(
        "--grid-prompts",
        type=int,
        default=6,
        help="prompts shown in the report's samples, 4 images each, before and after (6)",
    )
    args = ap.parse_args(argv)
    try:
        name = load_config(args.config, args.overrides).pipeline.name
        if name != "flow":
            raise UserError(
                f"pipeline.name ({name!r}): pipelines.flow.compare needs a flow recipe; use "
                f"mmgrpo eval ckpt=none and ckpt=latest for other pipelines"
            )
        cfg = load_config(args.config, [*args.overrides, *EVAL_OVERRIDES])
        before, _ = evaluate_run(cfg, "none", group_size=args.group_size, samples=args.grid_prompts)
        after, _ = evaluate_run(cfg, "latest", group_size=args.group_size, samples=args.grid_prompts)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    before, after = before["conditions"]["real"], after["conditions"]["real"]
    columns = [c for c in next(iter(before.values())) if c not in ("n", "total")] or ["total"]
    # rewards registered with range [0, 1] are scores, their changes in points; a monitor (a count) changes plainly
    scores = [r for r in cfg.rewards if r.name in REWARDS.names() and REWARDS.meta(r.name).get("range") == "[0, 1]"]
    points = {r.label or r.name for r in scores}
    table = compare_table(before, after, columns, points | {"total"})
    run_dir = Path(cfg.run.output_dir)
    n_prompts = int(before["all"]["n"]) // args.group_size
    print(
        f"held-out prompts: {n_prompts}, {args.group_size} images each, ODE sampling, fixed seeds "
        f"(before = base model, after = newest checkpoint of {run_dir})"
    )
    print(table)
    (run_dir / "eval_before_after.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    report = refresh_report(run_dir)  # leads with this table; the samples grid shows the same prompts and seeds
    if report is not None:
        print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
