"""report.html: one self-contained page per run with reward and KL curves, before/after samples, config and timings.

Images are embedded as base64 PNGs so the file can be mailed or opened anywhere.
"""

import base64
import html
import io
import json
from pathlib import Path

from mmgrpo.tracking import read_metrics


def _curve_png(rows: list[dict], keys: list[str], title: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=k)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _gallery_html(d: Path, label: str) -> str:
    items = json.loads((d / "items.json").read_text())
    cells = []
    for it in items[:16]:
        body = ""
        if "image" in it:
            data = base64.b64encode((d / it["image"]).read_bytes()).decode()
            body = f'<img src="data:image/png;base64,{data}" style="image-rendering:pixelated;width:96px">'
        if "text" in it:
            body += f"<pre>{html.escape(str(it['text']))}</pre>"
        cap = html.escape(f"{it.get('prompt', '')} | r={it.get('reward', float('nan')):.3f}")
        cells.append(f'<div class="cell">{body}<div class="cap">{cap}</div></div>')
    return f"<h3>{html.escape(label)} ({html.escape(d.name)})</h3><div class='grid'>{''.join(cells)}</div>"


def write_report(run_dir: Path, config_yaml: str) -> Path:
    rows = read_metrics(run_dir / "metrics.jsonl")
    reward_keys = sorted({k for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean")})
    plots = [
        _curve_png(rows, ["reward/total_mean"] + reward_keys, "reward"),
        _curve_png(rows, ["kl/ref", "kl/old_approx"], "KL"),
        _curve_png(rows, ["loss/policy", "loss/total"], "loss"),
    ]
    imgs = "".join(f'<img src="data:image/png;base64,{p}">' for p in plots if p)
    galleries = sorted((run_dir / "gallery").glob("step_*")) if (run_dir / "gallery").is_dir() else []
    # the first gallery is the policy before any update, the last one after (almost) all of them
    picks = [("before training", galleries[0]), ("after training", galleries[-1])] if len(galleries) > 1 else \
        [("samples", g) for g in galleries]
    gal = "".join(_gallery_html(d, label) for label, d in picks)
    time_keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    timing = "".join(
        f"<tr><td>{k}</td><td>{sum(r[k] for r in rows if r.get(k) is not None) / max(1, len(rows)):.4f}</td></tr>"
        for k in time_keys)
    last = rows[-1] if rows else {}
    summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in last.items())
    title = html.escape(run_dir.name)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mmgrpo report: {title}</title>
<style>body{{font-family:sans-serif;margin:2em}} .grid{{display:flex;flex-wrap:wrap;gap:8px}}
.cell{{border:1px solid #ccc;padding:4px;width:160px;font-size:11px}} td{{padding:2px 8px}}
pre{{white-space:pre-wrap}}</style>
</head><body><h1>mmgrpo run {html.escape(str(run_dir))}</h1><p>{len(rows)} logged steps</p>
<h2>Curves</h2>{imgs or '<p>no metrics</p>'}<h2>Samples before and after training</h2>{gal or '<p>no gallery</p>'}
<h2>Mean seconds per phase</h2><table>{timing}</table><h2>Last step</h2><table>{summary}</table>
<h2>Config</h2><pre>{html.escape(config_yaml)}</pre></body></html>"""
    path = run_dir / "report.html"
    path.write_text(page)
    return path
