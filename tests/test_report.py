"""report.html leads with the held-out result: sections and their order, the before/after and "is it looking?"
tables as real HTML tables, seeds pooled as mean ± sd, samples on the same prompts, raw data folded away."""

import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from mmgrpo.report import main, refresh_report, write_report
from mmgrpo.tracking import save_gallery


class Page(HTMLParser):
    """Section ids and h2 texts in order, every table as rows of cell texts, and which sections hold <details>."""

    def __init__(self, text: str):
        super().__init__()
        self.sections, self.h2, self.tables, self.details = [], [], [], set()
        self._in_h2 = self._cell = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a["id"])
        elif tag == "h2":
            self._in_h2 = True
            self.h2.append("")
        elif tag == "table":
            self.tables.append((self.sections[-1] if self.sections else None, a.get("class"), []))
        elif tag == "tr":
            self.tables[-1][2].append([])
        elif tag in ("td", "th"):
            self._cell = True
            self.tables[-1][2][-1].append("")
        elif tag == "details":
            self.details.add(self.sections[-1])

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in_h2 = False
        elif tag in ("td", "th"):
            self._cell = False

    def handle_data(self, data):
        if self._in_h2:
            self.h2[-1] += data
        if self._cell:
            self.tables[-1][2][-1][-1] += data

    def table(self, section: str, cls: str) -> list[list[str]]:
        return next(rows for s, c, rows in self.tables if s == section and c == cls)


def _result(label: str, acc: dict[str, float], blank: dict[str, float] | None = None) -> dict:
    def table(v):
        return {c: {"format": 1.0, "accuracy": x, "total": 1.0 + x, "n": 8 if c == "all" else 4} for c, x in v.items()}

    conditions = {"real": table(acc)}
    tests = {}
    if blank is not None:
        conditions["blank"] = table(blank)
        tests["blank"] = {
            c: {
                m: {
                    "test": "mcnemar",
                    "n": conditions["real"][c]["n"],
                    "diff": conditions["blank"][c][m] - conditions["real"][c][m],
                    "p": 0.03125,
                }
                for m in ("format", "accuracy", "total")
            }
            for c in acc
        }
    return {
        "ckpt": label,
        "label": label,
        "seed": 0,
        "group_size": 1,
        "records": 8,
        "conditions": conditions,
        "tests": tests,
    }


def _run(d: Path, before: dict, after: dict, blank: dict | None = None, samples: bool = True) -> Path:
    (d / "eval").mkdir(parents=True)
    (d / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "reward/total_mean": 0.1 * s,
                    "reward/accuracy/mean": 0.05 * s,
                    "kl/old_approx": 0.01,
                    "entropy": 1 - 0.1 * s,
                    "time/rollout": 1.0,
                }
            )
            + "\n"
            for s in range(4)
        )
    )
    (d / "config.yaml").write_text("run:\n  seed: 0\n")
    (d / "eval" / "base.json").write_text(json.dumps(_result("base", before)))
    (d / "eval" / "step_00000030.json").write_text(json.dumps(_result("step_00000030", after, blank)))
    img = np.full((8, 8, 3), 200, dtype=np.uint8)
    if samples:
        for label, ans in (("base", "<answer>blue</answer>"), ("step_00000030", "<answer>red</answer>")):
            save_gallery(
                d / "eval" / f"{label}_samples",
                [
                    {
                        "prompt": "What colour is the circle?",
                        "text": ans,
                        "reward": 1.0,
                        "answer": "red",
                        "record": 0,
                        "sample": 0,
                        "image": img,
                    },
                    {
                        "prompt": "What colour is the circle?",
                        "text": ans,
                        "reward": 0.0,
                        "answer": "red",
                        "record": 0,
                        "sample": 1,
                    },
                ],
            )
    return d


def test_sections_in_order_and_the_result_table_first(tmp_path):
    run = _run(
        tmp_path / "run",
        {"all": 0.25, "color": 0.5},
        {"all": 0.625, "color": 0.25},
        blank={"all": 0.125, "color": 0.0},
    )
    page = Page(write_report(run).read_text())
    assert page.sections == ["result", "looking", "curves", "samples", "raw"]
    assert page.h2[0].startswith("Held-out result") and page.h2[1].startswith("Is it looking?")
    rows = page.table("result", "result")
    assert rows[0] == ["category", "n", "format", "accuracy"] and rows[1] == ["before", "after", "change"] * 2
    # accuracy all 0.25 -> 0.625 (+0.375), color 0.5 -> 0.25 (-0.250); format 1 -> 1
    assert rows[2] == ["all", "8", "1.000", "1.000", "+0.000", "0.250", "0.625", "+0.375"]
    assert rows[3] == ["color", "4", "1.000", "1.000", "+0.000", "0.500", "0.250", "-0.250"]
    look = page.table("looking", "looking")
    assert look[0][:5] == ["category", "metric", "records", "real", "blank"]
    assert ["all", "accuracy", "8", "0.625", "0.125", "-0.500", "0.031"] in look
    samples = page.table("samples", "samples")
    assert samples[0] == ["prompt", "before", "after"] and len(samples) == 2  # one record, both sides in one row
    assert "<answer>blue</answer>" in samples[1][1] and "<answer>red</answer>" in samples[1][2]
    assert page.details == {"raw"}
    html = (run / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3  # curves (reward, KL, monitors) and the input image


def test_several_seeds_show_mean_and_spread(tmp_path):
    a = _run(tmp_path / "s0", {"all": 0.2, "color": 0.2}, {"all": 0.4, "color": 0.3}, samples=False)
    b = _run(tmp_path / "s1", {"all": 0.2, "color": 0.2}, {"all": 0.6, "color": 0.3}, samples=False)
    assert main([str(a), str(b)]) == 0
    rows = Page((a / "report.html").read_text()).table("result", "result")
    # accuracy after: mean(0.4, 0.6) = 0.5, sd = sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414;
    # change: +0.2 and +0.4 -> +0.3 ± 0.141 [+0.2, +0.4]
    assert rows[2][6] == "0.500 ± 0.141" and rows[2][7] == "+0.300 ± 0.141 [+0.200, +0.400]"
    assert rows[3][6] == "0.300 ± 0.000"


def test_without_eval_results_it_says_how_to_get_them(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/total_mean": 0.5}) + "\n")
    page = write_report(tmp_path, "run: {}").read_text()
    parsed = Page(page)
    assert parsed.sections == ["result", "curves", "samples", "raw"]
    assert "ckpt=none" in page and "ckpt=latest" in page


def test_refresh_only_rewrites_an_existing_report(tmp_path):
    assert refresh_report(tmp_path) is None and not (tmp_path / "report.html").exists()
    (tmp_path / "report.html").write_text("old")
    assert refresh_report(tmp_path).read_text().startswith("<!doctype html>")
    assert main([str(tmp_path / "missing")]) == 2


def test_a_re_evaluation_keeps_the_earlier_result(tmp_path):
    # a quick `mmgrpo eval ... limit=4` after a full eval of the same checkpoint must not erase the full one
    from mmgrpo.evaluate import keep_previous
    from mmgrpo.report import load_evals

    root = tmp_path / "eval"
    assert keep_previous(root, "base") is None  # nothing to keep yet
    root.mkdir()
    for n_records in (300, 4, 8):
        kept = keep_previous(root, "base")
        (root / "base.json").write_text(json.dumps({"records": n_records}))
        (root / "base_samples").mkdir()
        (root / "base_samples" / "items.json").write_text(str(n_records))
    assert kept == root / "base.2.json"
    assert [json.loads((root / f"base.{i}.json").read_text())["records"] for i in (1, 2)] == [300, 4]
    assert (root / "base.1_samples" / "items.json").read_text() == "300"
    assert load_evals(tmp_path) == {"base": {"records": 8}}  # the report reads the newest; the kept ones stay on disk


def test_split_scales_puts_a_count_monitor_on_the_right_axis():
    """The T2I demo logs objects per image (about 2-3) beside [0, 1] rewards: on one axis it flattens them."""
    from mmgrpo.report import split_scales

    rows = [
        {"step": 0, "reward/partial/mean": 0.66, "reward/strict/mean": 0.30, "reward/objects/mean": 2.1},
        {"step": 1, "reward/partial/mean": 0.80, "reward/strict/mean": 0.50, "reward/objects/mean": 2.7},
        {"step": 2, "reward/total_mean": 0.81},
    ]
    keys = ["reward/total_mean", "reward/partial/mean", "reward/strict/mean", "reward/objects/mean"]
    # peaks 0.81, 0.80, 0.50, 2.7: median (0.80 + 0.81) / 2 = 0.805; only 2.7 > 1.5 * 0.805 = 1.2075
    assert split_scales(rows, keys) == (keys[:3], ["reward/objects/mean"])
    # the VLM recipe's total (format 0.5 + accuracy 1.0, peak 1.3) stays beside its parts: median 1.0, 1.3 < 1.5
    vlm = [{"step": 0, "reward/total_mean": 1.3, "reward/accuracy/mean": 0.8, "reward/format/mean": 1.0}]
    assert split_scales(vlm, list(vlm[0])[1:]) == (list(vlm[0])[1:], [])
