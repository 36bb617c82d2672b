""" "Is it looking?": per-category tables of eval scores under real / blank / shuffled visual inputs, and their paired
tests (mmgrpo/stats.py). Pure functions on score arrays; the rollouts are mmgrpo/evaluate.py's.
"""

from typing import Any

import numpy as np

from mmgrpo.stats import paired_test

CONDITIONS = {"blank": "blank", "shuffle": "shuffled"}
"""`ablate=` name -> condition name in tables and JSON (the swap itself: pipelines/visual_ablation.py)"""
ABLATE_ALL = ("blank", "shuffle")


def parse_ablate(value: str, has_pixels: bool) -> tuple[str, ...]:
    """`ablate=` of `mmgrpo eval`: auto (blank,shuffle when the records hold images or videos), none, or a list."""
    value = value.strip().lower()
    if value == "auto":
        return ABLATE_ALL if has_pixels else ()
    if value in ("none", "", "false"):
        return ()
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    bad = [n for n in names if n not in CONDITIONS]
    if bad:
        raise ValueError(
            f"ablate={value!r}: unknown ablation {bad[0]!r}; use auto, none, blank, shuffle or blank,shuffle"
        )
    return names


def _categories(cats: list[str]) -> dict[str, np.ndarray]:
    """ "all" (every record) first, then each category in order; an uncategorised set has only "all"."""
    rows = {"all": np.arange(len(cats))}
    for c in sorted(set(cats) - {"all"}):
        rows[c] = np.array([i for i, x in enumerate(cats) if x == c])
    return rows


def category_table(scores: np.ndarray, cats: list[str], names: list[str]) -> dict[str, dict[str, float]]:
    """Mean of each metric over the samples of each category, and n = samples counted ([records, G, M] scores)."""
    table = {}
    for cat, rows in _categories(cats).items():
        sub = scores[rows]  # [r, G, M]
        table[cat] = {name: float(sub[..., m].mean()) for m, name in enumerate(names)} | {"n": int(sub[..., 0].size)}
    return table


def paired_tests(scores: dict[str, np.ndarray], cats: list[str], names: list[str]) -> dict[str, Any]:
    """Each ablated condition against "real", per category and metric, one unit per record (its mean over the G
    samples: samples of one prompt are not independent). 0/1 units (G = 1 on accuracy-type rewards) get the exact
    McNemar test, the others the Wilcoxon signed-rank test; see mmgrpo.stats.paired_test."""
    real = scores["real"].mean(1)  # [records, M]
    out: dict[str, Any] = {}
    for cond, s in scores.items():
        if cond == "real":
            continue
        other = s.mean(1)  # [records, M]
        out[cond] = {
            cat: {name: paired_test(real[rows, m], other[rows, m]) for m, name in enumerate(names)}
            for cat, rows in _categories(cats).items()
        }
    return out


def _p(p: float) -> str:
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def looking_rows(result: dict[str, Any], metrics: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (category, metric): records, the mean under each condition, and per ablation the paired
    difference (ablated - real) and its p-value. `result` is evaluate_conditions' (or its saved JSON)."""
    conds = list(result["conditions"])
    real = result["conditions"]["real"]
    names = metrics or [k for k in next(iter(real.values())) if k not in ("n", "total")] or ["total"]
    rows = []
    for cat in real:
        for name in names:
            row = {
                "category": cat,
                "metric": name,
                "records": result["tests"][conds[1]][cat][name]["n"] if len(conds) > 1 else real[cat]["n"],
            }
            row |= {c: result["conditions"][c][cat][name] for c in conds}
            for c in conds[1:]:
                t = result["tests"][c][cat][name]
                row[f"{c}_diff"], row[f"{c}_p"], row[f"{c}_test"] = t["diff"], t["p"], t["test"]
            rows.append(row)
    return rows


def format_looking(result: dict[str, Any]) -> str:
    """The side-by-side text table `mmgrpo eval` prints: real / blank / shuffled, differences and p-values."""
    conds = list(result["conditions"])
    head = f"{'category':<16}{'metric':<16}{'n':>6}" + "".join(f"{c:>10}" for c in conds)
    head += "".join(f"{c + '-real':>16}{'p':>9}" for c in conds[1:])
    lines = [head, "-" * len(head)]
    tests = set()
    for r in looking_rows(result):
        line = f"{r['category']:<16}{r['metric']:<16}{r['records']:>6}" + "".join(f"{r[c]:>10.3f}" for c in conds)
        line += "".join(f"{r[c + '_diff']:>+16.3f}{_p(r[c + '_p']):>9}" for c in conds[1:])
        tests |= {r[c + "_test"] for c in conds[1:]}
        lines.append(line)
    note = {"mcnemar": "exact McNemar on 0/1 answers", "wilcoxon": "Wilcoxon signed-rank on per-record means"}
    lines.append(f"n = records (paired units); p: two-sided, {'; '.join(note[t] for t in sorted(tests) if t in note)}")
    return "\n".join(lines)
