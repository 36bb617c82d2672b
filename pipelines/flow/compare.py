"""Before/after verifier table of a flow recipe on its held-out prompts, and sample grids added to report.html.

`python -m pipelines.flow.compare configs/flow/shapes_t2i.yaml [overrides]` (the second half of `make demo`).
Both sides use the same eval prompts, the same per-prompt seeds and deterministic ODE sampling (noise_level 0,
independent initial noises), so the only difference is the weights: the base model (ckpt=none) or the newest
checkpoint of run.output_dir.
"""

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import UserError

EVAL_OVERRIDES = ("pipeline.kwargs.noise_level=0", "pipeline.kwargs.plan=independent",
                  "pipeline.kwargs.plan_kwargs={train: all}", "pipeline.kwargs.objective=grpo",
                  "pipeline.kwargs.same_noise_per_group=false")
"""ODE sampling from one fresh noise per image, whatever plan / objective the recipe trains with (FlowPolicy's
for_evaluation applies the same settings, so `mmgrpo eval` and `sample` agree with this tool)."""


def compare_table(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                  columns: list[str]) -> str:
    """Rows = categories ("all" first), for each column: before, after and the change in points (x 100)."""
    head = f"{'category':<16}{'n':>5}" + "".join(f"{c + ' before':>16}{c + ' after':>15}{'change':>9}"
                                                 for c in columns)
    lines = [head, "-" * len(head)]
    for cat, row in before.items():
        cells = "".join(f"{row[c]:>16.3f}{after[cat][c]:>15.3f}{100 * (after[cat][c] - row[c]):>+9.1f}"
                        for c in columns)
        lines.append(f"{cat:<16}{int(row['n']):>5}" + cells)
    return "\n".join(lines)


def _png(image: torch.Tensor) -> str:
    from PIL import Image

    arr = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()  # [H, W, 3]
    buf = io.BytesIO()
    Image.fromarray(arr).resize((96, 96), Image.NEAREST).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@torch.no_grad()
def sample_grid(cfg, ckpt: str, records: list[dict[str, Any]], group_size: int) -> list[tuple[str, torch.Tensor, float]]:
    """(prompt, image [3, H, W], strict-or-first reward) for group_size seeds of each record, eval seeds."""
    from mmgrpo import checkpoint
    from mmgrpo.collect import reward_fields
    from mmgrpo.evaluate import resolve_checkpoint
    from mmgrpo.runtime import prompt_seed
    from mmgrpo.setup import build_rewards, build_task

    path = resolve_checkpoint(cfg, ckpt)
    task = build_task(cfg, torch.device("cpu"))
    task.policy.for_evaluation()  # as evaluate() does: one fresh noise per image even where the recipe shares them
    if path is not None:
        task.policy.load_state_dict(checkpoint.load(path, 0)["weights"])
    reward_set = build_rewards(cfg, task, torch.device("cpu"))
    ro = task.policy.rollout(records, group_size, [prompt_seed(cfg.run.seed, -2, 0, i) for i in range(len(records))])
    texts, fields = reward_fields(records, group_size)
    per_reward, _ = reward_set(ro.samples, texts, group_size=group_size, **fields)
    col = reward_set.names.index("strict") if "strict" in reward_set.names else 0
    return [(texts[i], s, float(per_reward[i, col])) for i, s in enumerate(ro.samples)]


def grid_html(before: list, after: list, group_size: int) -> str:
    rows = []
    for lo in range(0, len(before), group_size):
        prompt = html.escape(before[lo][0])
        for label, side in (("before", before), ("after", after)):
            imgs = "".join(f'<figure style="margin:2px"><img src="data:image/png;base64,{_png(img)}">'
                           f'<figcaption style="font-size:10px">{r:.0f}</figcaption></figure>'
                           for _, img, r in side[lo: lo + group_size])
            rows.append(f"<tr><td>{prompt}<br><i>{label}</i></td><td><div style='display:flex'>{imgs}</div></td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def add_to_report(run_dir: Path, section: str) -> Path | None:
    """Insert a section before </body> of run_dir/report.html (written by the trainer); None if there is none."""
    path = run_dir / "report.html"
    if not path.is_file():
        return None
    page = path.read_text()
    marker = "<!-- flow-compare -->"
    page = page.split(marker)[0] + marker if marker in page else page.replace("</body></html>", marker)
    path.write_text(page + section + "</body></html>")
    return path


def main(argv: list[str] | None = None) -> int:
    from mmgrpo.config import load_config
    from mmgrpo.evaluate import evaluate

    ap = argparse.ArgumentParser(prog="python -m pipelines.flow.compare", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as for mmgrpo train")
    ap.add_argument("--group-size", type=int, default=16, help="images per eval prompt (16)")
    ap.add_argument("--grid-prompts", type=int, default=6, help="prompts shown in the report's sample grid (6)")
    args = ap.parse_args(argv)
    try:
        name = load_config(args.config, args.overrides).pipeline.name
        if name != "flow":
            raise UserError(f"pipeline.name ({name!r}): pipelines.flow.compare needs a flow recipe; use "
                            f"mmgrpo eval ckpt=none and ckpt=latest for other pipelines")
        cfg = load_config(args.config, [*args.overrides, *EVAL_OVERRIDES])
        before = evaluate(cfg, "none", group_size=args.group_size)
        after = evaluate(cfg, "latest", group_size=args.group_size)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    columns = [c for c in next(iter(before.values())) if c not in ("n", "total")] or ["total"]
    table = compare_table(before, after, columns)
    run_dir = Path(cfg.run.output_dir)
    n_prompts = int(before["all"]["n"]) // args.group_size
    print(f"held-out prompts: {n_prompts}, {args.group_size} images each, ODE sampling, fixed seeds "
          f"(before = base model, after = newest checkpoint of {run_dir})")
    print(table)
    (run_dir / "eval_before_after.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    from mmgrpo.setup import build_task

    records = build_task(cfg, torch.device("cpu")).eval_data
    step = max(1, len(records) // args.grid_prompts)
    picks = records[::step][: args.grid_prompts]
    g = 4
    grid = grid_html(sample_grid(cfg, "none", picks, g), sample_grid(cfg, "latest", picks, g), g)
    section = (f"<h2>Held-out verifier accuracy before and after</h2><pre>{html.escape(table)}</pre>"
               f"<h2>Held-out samples, same seeds (number = strict score)</h2>{grid}")
    report = add_to_report(run_dir, section)
    if report is not None:
        print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
