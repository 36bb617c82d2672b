"""report.html: one self-contained page per run that leads with the held-out result, then curves, samples, raw data.

Order: before/after table per category (`mmgrpo eval` results in <run>/eval/, several seeds pooled as mean ± sd),
the "is it looking?" table (real / blank / shuffled pixels), training curves, before/after samples on the same prompts
and seeds, and the raw metrics and config folded away. Images are embedded as base64 PNGs so the file travels alone.
`python -m mmgrpo.report RUN_DIR [OTHER_SEED_RUN_DIR ...]` rewrites it, pooling the other runs' eval results.
"""

import argparse
import base64
import html
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from mmgrpo.looking import looking_rows
from mmgrpo.tracking import read_metrics

CURVES = [
    ("reward (training batches)", ["reward/total_mean"], ("reward/", "/mean")),
    ("KL", ["kl/ref", "kl/old_approx"], None),
    ("policy monitors", ["entropy", "adv/zero_std_frac", "clip/upper_frac", "clip/lower_frac", "ratio/std"], None),
    ("loss and gradient", ["loss/policy", "loss/total", "grad_norm"], None),
]
"""(title, metric keys, (prefix, suffix) of further keys) of each curve panel; panels with no data are left out"""
CSS = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;max-width:1200px;color:#222}
h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:1.6em} table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px} th{background:#f3f3f3}
td.l,th.l{text-align:left} .up{color:#0a7a2f;font-weight:600} .down{color:#b3261e;font-weight:600}
.note{color:#555;font-size:13px} .spread{color:#666;font-size:11px} .cells{display:flex;flex-wrap:wrap;gap:4px}
figure{margin:0;text-align:center;font-size:11px} pre{white-space:pre-wrap;margin:0;font-size:12px}
td.s{vertical-align:top;text-align:left;max-width:420px}
.answers{display:flex;flex-direction:column;gap:3px} .ans code{font-size:12px;background:#f6f6f6;padding:1px 3px}
img.px{image-rendering:pixelated} tr.all td{background:#fafafa;font-weight:600} details{margin-top:1em}"""


def load_evals(run_dir: Path) -> dict[str, dict[str, Any]]:
    """`mmgrpo eval` results of a run directory by label ("base", "step_00000060", ...)."""
    d = Path(run_dir) / "eval"
    out = {}
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        if "." in p.stem:  # <label>.<n>.json: an earlier result kept by evaluate.keep_previous
            continue
        try:
            out[p.stem] = json.loads(p.read_text())
        except ValueError:
            continue  # a file cut by a crash
    return out


def before_after(evals: dict[str, dict[str, Any]]) -> tuple[str | None, str | None]:
    """Labels of the base model's result and of the newest checkpoint's (plain weights preferred over EMA)."""
    steps = sorted(k for k in evals if k.startswith("step_") and not k.endswith("_ema")) or sorted(
        k for k in evals if k.startswith("step_")
    )
    return ("base" if "base" in evals else None), (steps[-1] if steps else None)


def _metrics(table: dict[str, dict[str, float]]) -> list[str]:
    keys = [k for k in next(iter(table.values())) if k != "n"]
    return [k for k in keys if k != "total"] or keys


def _cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} <span class='spread'>± {statistics.stdev(values):.3f}</span>"


def _change(values: list[float]) -> str:
    mean = statistics.mean(values)
    cls = "up" if mean > 0.005 else "down" if mean < -0.005 else ""
    text = f"{mean:+.3f}"
    if len(values) > 1:
        text += (
            f" <span class='spread'>± {statistics.stdev(values):.3f} [{min(values):+.3f}, {max(values):+.3f}]</span>"
        )
    return f"<td class='{cls}'>{text}</td>"


def result_table(pairs: list[tuple[dict, dict]]) -> str:
    """HTML before/after table per category from (before, after) eval results, one pair per seed (mean ± sd)."""
    before0 = pairs[0][0]["conditions"]["real"]
    names = _metrics(before0)
    head = (
        "<tr><th class='l' rowspan=2>category</th><th rowspan=2>n</th>"
        + "".join(f"<th colspan=3>{html.escape(m)}</th>" for m in names)
        + "</tr><tr>"
        + "<th>before</th><th>after</th>"
        "<th>change</th>" * len(names) + "</tr>"
    )
    rows = []
    for cat in before0:
        if not all(cat in a["conditions"]["real"] for _, a in pairs):
            continue
        cells = f"<td class='l'>{html.escape(cat)}</td><td>{int(before0[cat]['n'])}</td>"
        for m in names:
            b = [p[0]["conditions"]["real"][cat][m] for p in pairs]
            a = [p[1]["conditions"]["real"][cat][m] for p in pairs]
            cells += f"<td>{_cell(b)}</td><td>{_cell(a)}</td>" + _change([y - x for x, y in zip(b, a)])
        rows.append(f"<tr class='{'all' if cat == 'all' else ''}'>{cells}</tr>")
    return f"<table class='result'>{head}{''.join(rows)}</table>"


def looking_table(result: dict[str, Any]) -> str:
    """HTML "is it looking?" table: the mean under each condition, and each ablation's paired difference and p."""
    conds = list(result["conditions"])
    head = (
        "<tr><th class='l'>category</th><th class='l'>metric</th><th>records</th>"
        + "".join(f"<th>{c}</th>" for c in conds)
        + "".join(f"<th>{c} − real</th><th>p ({c})</th>" for c in conds[1:])
        + "</tr>"
    )
    rows = []
    for r in looking_rows(result):
        cells = (
            f"<td class='l'>{html.escape(r['category'])}</td><td class='l'>{html.escape(r['metric'])}</td>"
            f"<td>{r['records']}</td>" + "".join(f"<td>{r[c]:.3f}</td>" for c in conds)
        )
        for c in conds[1:]:
            p = r[f"{c}_p"]
            cells += f"<td>{r[f'{c}_diff']:+.3f}</td><td title='{r[f'{c}_test']}'>{p:.2g}</td>"
        rows.append(f"<tr class='{'all' if r['category'] == 'all' else ''}'>{cells}</tr>")
    return f"<table class='looking'>{head}{''.join(rows)}</table>"


def split_scales(rows: list[dict], keys: list[str]) -> tuple[list[str], list[str]]:
    """Keys for the left and the right axis of one plot: a series whose largest |value| is over 1.5x the median of
    the series' largest |values| (a count monitor beside [0, 1] rewards) goes right, so it does not flatten the rest."""
    peak = {k: max(abs(r[k]) for r in rows if r.get(k) is not None) for k in keys}
    mid = statistics.median(peak.values())
    right = [k for k in keys if mid > 0 and peak[k] > 1.5 * mid]
    return [k for k in keys if k not in right], right


def _curve_png(rows: list[dict], keys: list[str], title: str) -> str | None:
    # lazy: matplotlib is heavy to import (~0.6 s); only the report's plots need it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot after matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    _, right = split_scales(rows, keys)
    fig, ax = plt.subplots(figsize=(5.4, 3.0), dpi=100)
    ax2 = ax.twinx() if right else None
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        on = ax2 if k in right else ax
        label = f"{k} (right axis)" if k in right else k
        on.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="." if len(pts) < 30 else None,
                linestyle="--" if k in right else "-", color=f"C{keys.index(k)}")  # fmt: skip
    if ax2 is not None:
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax2 is None:
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def curves_html(rows: list[dict]) -> str:
    imgs = []
    for title, keys, pattern in CURVES:
        extra = sorted({k for r in rows for k in r if pattern and k.startswith(pattern[0]) and k.endswith(pattern[1])})
        png = _curve_png(rows, keys + [k for k in extra if k not in keys], title)
        if png:
            imgs.append(f'<img src="data:image/png;base64,{png}">')
    return "".join(imgs) or "<p class='note'>no metrics logged</p>"


def _img(path: Path, size: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img class="px" src="data:image/png;base64,{data}" style="{size}">'


def _side(items: list[dict], d: Path, outputs_are_images: bool) -> str:
    """One before or after cell: the samples of a record (images, or answers with their rewards)."""
    out = []
    for it in items:
        r = f"r={it.get('reward', float('nan')):.2f}"
        if outputs_are_images and "image" in it:
            out.append(f"<figure>{_img(d / it['image'], 'width:80px')}<figcaption>{r}</figcaption></figure>")
        elif "text" in it:
            out.append(
                f"<div class='ans'><code>{html.escape(str(it['text']))}</code> <span class='note'>{r}</span></div>"
            )
    return f"<div class='{'cells' if outputs_are_images else 'answers'}'>{''.join(out)}</div>"


def samples_table(before_dir: Path, after_dir: Path) -> str:
    """Rows = eval records (same prompts, same seeds on both sides): prompt and input, before, after."""
    before = json.loads((before_dir / "items.json").read_text())
    after = json.loads((after_dir / "items.json").read_text())
    outputs_are_images = not any("text" in it for it in before)
    rows = []
    for rec in sorted({it.get("record", 0) for it in before}):
        b = [it for it in before if it.get("record", 0) == rec]
        a = [it for it in after if it.get("record", 0) == rec]
        first = b[0]
        prompt = f"<pre>{html.escape(str(first.get('prompt', '')))}</pre>"
        if first.get("answer") is not None:
            prompt += f"<span class='note'>answer: {html.escape(str(first['answer']))}</span>"
        if not outputs_are_images and "image" in first:  # the model's input (an image, or a strip of frames)
            prompt += f"<div>{_img(before_dir / first['image'], 'height:80px;max-width:100%')}</div>"
        rows.append(
            f"<tr><td class='s'>{prompt}</td><td class='s'>{_side(b, before_dir, outputs_are_images)}</td>"
            f"<td class='s'>{_side(a, after_dir, outputs_are_images)}</td></tr>"
        )
    return (
        "<table class='samples'><tr><th class='l'>prompt</th><th class='l'>before</th><th class='l'>after</th>"
        f"</tr>{''.join(rows)}</table>"
    )


def _training_gallery(run_dir: Path) -> str:
    """Fallback when no eval samples exist: the first and last training galleries (different prompts)."""
    g = sorted((run_dir / "gallery").glob("step_*")) if (run_dir / "gallery").is_dir() else []
    if not g:
        return "<p class='note'>no samples</p>"
    parts = []
    for label, d in (
        [("before training: first step's batch", g[0]), ("after training: last step's batch", g[-1])]
        if len(g) > 1
        else [("training samples", g[0])]
    ):
        items = json.loads((d / "items.json").read_text())[:8]
        images = not any("text" in it for it in items)
        prompts = list(dict.fromkeys(str(it.get("prompt", "")) for it in items))
        rows = "".join(
            f"<tr><td class='s'><pre>{html.escape(p)}</pre></td><td class='s'>"
            f"{_side([it for it in items if str(it.get('prompt', '')) == p], d, images)}</td></tr>"
            for p in prompts
        )
        parts.append(f"<h3>{label} ({html.escape(d.name)})</h3><table>{rows}</table>")
    return (
        "<p class='note'>training batches, not the same prompts: run <code>mmgrpo eval CONFIG ckpt=none</code> "
        "and <code>ckpt=latest</code> for held-out samples on the same prompts and seeds</p>" + "".join(parts)
    )


def _plain_table(table: dict[str, dict[str, float]]) -> str:
    names = _metrics(table)
    head = "<tr><th class='l'>category</th><th>n</th>" + "".join(f"<th>{html.escape(m)}</th>" for m in names)
    body = "".join(
        f"<tr><td class='l'>{html.escape(c)}</td><td>{int(row['n'])}</td>"
        + "".join(f"<td>{row[m]:.3f}</td>" for m in names)
        + "</tr>"
        for c, row in table.items()
    )
    return f"<table class='result'>{head}</tr>{body}</table>"


def result_html(run_dir: Path, seed_dirs: list[Path]) -> str:
    """The leading section: before/after table (pooled over seed runs), or what exists and how to get the rest."""
    evals = load_evals(run_dir)
    b, a = before_after(evals)
    how = (
        f"<p class='note'>held-out results come from <code>mmgrpo eval {html.escape(str(run_dir))}/config.yaml "
        f"ckpt=none</code> (before) and <code>ckpt=latest</code> (after)</p>"
    )
    if b is None or a is None:
        only = evals.get(a or b or "")
        return f"<p>no before/after pair yet.</p>{how}" + (
            f"<p>{html.escape(only['label'])}:</p>{_plain_table(only['conditions']['real'])}" if only else ""
        )
    pairs = [(evals[b], evals[a])]
    for d in seed_dirs:
        other = load_evals(d)
        ob, oa = before_after(other)
        if ob and oa:
            pairs.append((other[ob], other[oa]))
    first = evals[a]
    seeds = (
        (
            f"{len(pairs)} training runs (this one and {', '.join(html.escape(str(d)) for d in seed_dirs)}): "
            f"mean ± sd over runs, change with [min, max]"
        )
        if len(pairs) > 1
        else "one training run"
    )
    caption = (
        f"<p class='note'>held-out eval split: {first['records']} records × {first['group_size']} samples "
        f"(n = samples); before = base weights, after = {html.escape(a)}; same records and seeds; "
        f"{seeds}.</p>"
    )
    return caption + result_table(pairs) + how


def looking_html(run_dir: Path) -> str | None:
    evals = load_evals(run_dir)
    b, a = before_after(evals)
    order = [k for k in (a, b) if k] + sorted(evals, reverse=True)
    pick = next((evals[k] for k in order if len(evals[k]["conditions"]) > 1), None)
    if pick is None:
        return None
    return (
        f"<p class='note'>checkpoint {html.escape(pick['label'])}: the same records and seeds with the real "
        f"images/frames, a blank canvas of the background colour, and another record's pixels (a fixed "
        f"derangement). Paired per record; p two-sided: exact McNemar for 0/1 answers (group_size=1), else "
        f"Wilcoxon signed-rank on per-record means.</p>" + looking_table(pick)
    )


def samples_html(run_dir: Path) -> str:
    evals = load_evals(run_dir)
    b, a = before_after(evals)
    d = run_dir / "eval"
    if b and a and (d / f"{b}_samples" / "items.json").is_file() and (d / f"{a}_samples" / "items.json").is_file():
        return (
            f"<p class='note'>held-out records, the same sampling seeds on both sides (before = base, after = "
            f"{html.escape(a)}); r = total reward</p>" + samples_table(d / f"{b}_samples", d / f"{a}_samples")
        )
    return _training_gallery(run_dir)


def raw_html(rows: list[dict], config_yaml: str) -> str:
    time_keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    timing = "".join(
        f"<tr><td class='l'>{k}</td><td>{sum(r[k] for r in rows if r.get(k) is not None) / max(1, len(rows)):.4f}"
        f"</td></tr>"
        for k in time_keys
    )
    last = rows[-1] if rows else {}
    summary = "".join(f"<tr><td class='l'>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in last.items())
    return (
        f"<details><summary>last logged step ({len(last)} metrics)</summary><table>{summary}</table></details>"
        f"<details><summary>mean seconds per phase</summary><table>{timing}</table></details>"
        f"<details><summary>config</summary><pre>{html.escape(config_yaml)}</pre></details>"
    )


def write_report(run_dir: Path, config_yaml: str | None = None, *, seed_dirs: list[Path] | None = None) -> Path:
    """Write run_dir/report.html from the run directory's files (metrics.jsonl, eval/, gallery/, config.yaml)."""
    run_dir = Path(run_dir)
    if config_yaml is None:
        cfg_path = run_dir / "config.yaml"
        config_yaml = cfg_path.read_text() if cfg_path.is_file() else ""
    rows = read_metrics(run_dir / "metrics.jsonl")
    title = html.escape(run_dir.name)
    looking = looking_html(run_dir)
    sections = [("result", "Held-out result: before and after training", result_html(run_dir, seed_dirs or []))]
    if looking:
        sections.append(("looking", "Is it looking? Real vs blank vs shuffled pixels", looking))
    sections += [
        ("curves", "Training curves", curves_html(rows)),
        ("samples", "Samples before and after, same prompts and seeds", samples_html(run_dir)),
        ("raw", "Raw metrics and config", raw_html(rows, config_yaml)),
    ]
    body = "".join(f"<section id='{sid}'><h2>{h}</h2>{content}</section>" for sid, h, content in sections)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>mmgrpo report: {title}</title>"
        f"<style>{CSS}</style></head><body><h1>mmgrpo run {html.escape(str(run_dir))}</h1>"
        f"<p class='note'>{len(rows)} logged steps</p>{body}</body></html>"
    )
    path = run_dir / "report.html"
    path.write_text(page)
    return path


def refresh_report(run_dir: Path) -> Path | None:
    """Rewrite run_dir/report.html when the run wrote one (after `mmgrpo eval` adds results); else None."""
    return write_report(run_dir) if (Path(run_dir) / "report.html").is_file() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmgrpo.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("seed_dirs", type=Path, nargs="*", help="run directories of the same recipe with other seeds")
    args = ap.parse_args(argv)
    for d in [args.run_dir, *args.seed_dirs]:
        if not d.is_dir():
            print(
                f"error: run directory {str(d)!r} does not exist; pass the run.output_dir of a training run",
                file=sys.stderr,
            )
            return 2
    print(f"report: {write_report(args.run_dir, seed_dirs=args.seed_dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
