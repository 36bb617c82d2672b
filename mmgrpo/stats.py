"""Paired significance tests for evaluation tables: exact McNemar, sign test, Wilcoxon signed-rank (float64, stdlib).

Pure functions on plain Python/numpy numbers; `paired_test` picks McNemar for 0/1 outcomes and Wilcoxon otherwise.
"""

import math
from typing import Any

import numpy as np

EXACT_WILCOXON_MAX = 400
"""pairs (after dropping zero differences) up to which the Wilcoxon p-value is exact; the normal approximation above"""


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips: 2 P(X <= min(k, n - k)), capped at 1.

    Binomial(n, 1/2) is symmetric, so doubling the smaller tail equals summing every outcome as unlikely as k.
    """
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"binomial test needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1))  # exact integers
    return min(1.0, 2 * tail / 2**n)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact McNemar test (McNemar 1947, Psychometrika 12:153; Agresti, Categorical Data Analysis, 3rd ed., 11.1.4).

    b = pairs right under condition A only, c = right under B only (the discordant pairs). Under H0 each discordant
    pair falls either way with probability 1/2: p = 2 * sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c), capped at 1.
    No discordant pair gives p = 1.
    """
    return binom_two_sided(int(b), int(b) + int(c))


def sign_test(diffs: Any) -> float:
    """Paired sign test (Conover, Practical Nonparametric Statistics, 3rd ed., 3.4): zero differences are dropped,
    the rest are + or - with probability 1/2 each under H0; p = binom_two_sided(#negative, #nonzero)."""
    d = np.asarray(diffs, dtype=np.float64).reshape(-1)
    d = d[d != 0]
    return binom_two_sided(int((d < 0).sum()), int(d.size))


def _midranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of x, ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(x.size, dtype=np.float64)
    i = 0
    while i < x.size:
        j = i
        while j + 1 < x.size and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1  # mean of ranks i+1 .. j+1
        i = j + 1
    return ranks


def _signed_rank_pmf(ranks: np.ndarray) -> np.ndarray:
    """P(W+ = s / 2) for s = 0 .. sum(2 ranks): every rank enters W+ with probability 1/2, independently."""
    twice = np.rint(2 * ranks).astype(np.int64)  # midranks are multiples of 1/2
    pmf = np.zeros(int(twice.sum()) + 1, dtype=np.float64)
    pmf[0] = 1.0
    top = 0
    for r in twice:
        shifted = pmf[: top + 1].copy()
        pmf[: top + 1] *= 0.5
        pmf[r : r + top + 1] += 0.5 * shifted
        top += int(r)
    return pmf


def wilcoxon_signed_rank(diffs: Any, *, exact_max: int = EXACT_WILCOXON_MAX) -> tuple[float, float]:
    """Two-sided Wilcoxon signed-rank test of paired differences (Wilcoxon 1945, Biometrics Bulletin 1:80).

    Zero differences are dropped (Wilcoxon's own convention, scipy's zero_method="wilcox"); tied |d| get midranks.
    W+ = sum of the ranks of the positive differences. Exact (up to `exact_max` pairs): the conditional permutation
    distribution of W+ given the ranks, each sign + or - with probability 1/2, p = 2 min(P(W+ <= w), P(W+ >= w)).
    Beyond it, the normal approximation with E[W+] = sum(r) / 2 and Var[W+] = sum(r^2) / 4 (which is the tie
    correction; Lehmann, Nonparametrics, 1975, 3.2), without continuity correction.

    Returns:
        (W+, p). No nonzero difference gives (0.0, 1.0).
    """
    d = np.asarray(diffs, dtype=np.float64).reshape(-1)
    d = d[d != 0]
    if d.size == 0:
        return 0.0, 1.0
    ranks = _midranks(np.abs(d))
    w = float(ranks[d > 0].sum())
    if d.size <= exact_max:
        pmf = _signed_rank_pmf(ranks)
        s = round(2 * w)
        lower, upper = float(pmf[: s + 1].sum()), float(pmf[s:].sum())
        return w, min(1.0, 2 * min(lower, upper))
    mean, var = ranks.sum() / 2, (ranks**2).sum() / 4
    z = abs(w - mean) / math.sqrt(var)
    return w, min(1.0, math.erfc(z / math.sqrt(2)))  # 2 (1 - Phi(|z|))


def is_binary(*values: Any) -> bool:
    """True when every value is 0 or 1 (accuracy-type outcomes)."""
    return all(bool(np.isin(np.asarray(v, dtype=np.float64), (0.0, 1.0)).all()) for v in values)


def paired_test(a: Any, b: Any) -> dict[str, Any]:
    """Compare condition b against condition a on the same units (a[i] and b[i] are one unit's scores).

    0/1 scores: exact McNemar on the discordant pairs (n10 = a right only, n01 = b right only); otherwise Wilcoxon
    signed-rank on b - a. `diff` is mean(b - a), in the scores' units.
    """
    a, b = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"paired test needs one score per unit in both conditions, got {a.size} and {b.size}")
    if a.size == 0:
        return {"test": "none", "n": 0, "diff": float("nan"), "p": float("nan")}
    diff = float((b - a).mean())
    if is_binary(a, b):
        n10, n01 = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
        return {
            "test": "mcnemar",
            "n": int(a.size),
            "diff": diff,
            "p": mcnemar_exact(n10, n01),
            "n10": n10,
            "n01": n01,
        }
    w, p = wilcoxon_signed_rank(b - a)
    return {
        "test": "wilcoxon",
        "n": int(a.size),
        "diff": diff,
        "p": p,
        "w_plus": w,
        "nonzero": int(((b - a) != 0).sum()),
    }
