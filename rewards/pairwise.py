"""Pairwise preference rewards (Pref-GRPO, arXiv:2508.20751): compare all pairs in a group, reward = win rate.

Judges: a pointwise reward compared pair by pair (CLIP-family scorer), or a VLM judge callable whose text answer is
parsed as UnifiedReward's ("Image 1 is better"); ties and unparsable answers count 0.5 for both sides.
"""

import itertools
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from rewards.api import REWARDS, Reward, check_group_size, check_prompts, load


def win_rates(prefs: Tensor) -> Tensor:
    """Mean preference of each sample over the other G-1 samples of its group.

    win_i = sum_{j != i} P[i, j] / (G - 1); a group of one scores 0.5.

    Args:
        prefs: [B, G, G] with P[i, j] = P(i beats j) and P[j, i] = 1 - P[i, j]; the diagonal is ignored.
    Returns:
        [B, G] win rates in [0, 1].
    """
    if prefs.dim() != 3 or prefs.shape[1] != prefs.shape[2]:
        raise ValueError(f"prefs must be [B, G, G], got {tuple(prefs.shape)}")
    g = prefs.shape[1]
    if g == 1:
        return torch.full(prefs.shape[:2], 0.5, dtype=prefs.dtype)
    off = ~torch.eye(g, dtype=torch.bool, device=prefs.device)  # [G, G]
    return (prefs * off).sum(-1) / (g - 1)  # [B, G]


def prefs_from_scores(scores: Tensor, *, tie_eps: float = 0.0, temperature: float | None = None) -> Tensor:
    """Pairwise preferences from pointwise scores: hard (1 / 0.5 tie / 0) or soft sigmoid((s_i - s_j) / T).

    Args:
        scores: [B, G].
    Returns:
        [B, G, G] with P[i, j] = P(i beats j).
    """
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)  # [B, G, G]
    if temperature is not None:
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (or None for hard wins)")
        return torch.sigmoid(diff / temperature)
    hard = (diff > tie_eps).to(scores.dtype) + 0.5 * (diff.abs() <= tie_eps).to(scores.dtype)  # [B, G, G]
    return torch.where(torch.isnan(diff), torch.full_like(hard, 0.5), hard)


def parse_preference(text: str) -> float:
    """P(first beats second) from a judge's answer: 1.0, 0.0, or 0.5 for a tie or an unparsable answer.

    Reads the last <answer> block when present; accepts "Image 1 is better", "Image 2", "1", "2", "first", "second",
    "A"/"B"; a mention of both or of "tie"/"equal" is a tie.
    """
    m = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    t = (m[-1] if m else text).strip().lower()
    if re.search(r"\b(tie|equal|same|both)\b", t):
        return 0.5
    first = re.search(r"\b(image|video|picture)\s*1\b|\bfirst\b|^\s*(1|a)\s*[.)]?\s*$", t)
    second = re.search(r"\b(image|video|picture)\s*2\b|\bsecond\b|^\s*(2|b)\s*[.)]?\s*$", t)
    if first and not second:
        return 1.0
    if second and not first:
        return 0.0
    return 0.5


class PairwiseReward(Reward):
    """Groupwise win-rate reward; `win_matrix` also returns the [B, G, G] preference matrix."""

    kind = "groupwise"

    def __init__(
        self,
        *,
        base: Reward | None = None,
        judge: Callable[[Any, Any, str | None], Any] | None = None,
        tie_eps: float = 0.0,
        temperature: float | None = None,
        symmetric: bool = True,
        name: str = "pairwise",
        input: str = "image",
        needs_prompts: bool = False,
        max_workers: int = 1,
        preprocess: str = "",
    ):
        if (base is None) == (judge is None):
            raise ValueError("pass exactly one of base (a pointwise reward to compare) or judge (a pairwise callable)")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        self.base, self.judge, self.tie_eps, self.temperature, self.symmetric = (
            base,
            judge,
            tie_eps,
            temperature,
            symmetric,
        )
        self.name, self.max_workers = name, max_workers
        self.input = base.input if base is not None else input
        self.needs_prompts = base.needs_prompts if base is not None else needs_prompts
        self.fields = tuple(base.fields) if base is not None else ()
        how = f"{base.name} scores compared" if base is not None else "judge(a, b, prompt) on every pair"
        self.preprocess = preprocess or f"{how}; tie/unparsable = 0.5; win rate over the other G-1 group members"

    def win_matrix(
        self, samples: Any, prompts: list[str] | None = None, *, group_size: int, **fields: Any
    ) -> tuple[Tensor, Tensor]:
        """(prefs [B, G, G], win rates [B, G]) for contiguous groups of `group_size` samples."""
        samples = list(samples)
        g = check_group_size(group_size, len(samples), self.name)
        prompts = check_prompts(prompts, len(samples), needed=self.needs_prompts, name=self.name)
        if self.base is not None:
            scores = self.base(samples, prompts, **fields).view(-1, g)  # [B, G]
            prefs = prefs_from_scores(scores.double(), tie_eps=self.tie_eps, temperature=self.temperature)
        else:
            prefs = self._judge_all(samples, prompts, g)
        return prefs.float(), win_rates(prefs).float()

    def _judge_all(self, samples: list, prompts: list[str] | None, g: int) -> Tensor:
        """All C(G, 2) pairs of every group (both orders when symmetric), up to max_workers judge calls at once."""
        b = len(samples) // g
        pairs = [(k, i, j) for k, (i, j) in itertools.product(range(b), itertools.combinations(range(g), 2))]
        asks = [(k * g + i, k * g + j) for k, i, j in pairs]
        if self.symmetric:  # ask in both orders: VLM judges favour one position
            asks += [(c, a) for a, c in asks]

        def ask(ac: tuple[int, int]) -> float:
            a, c = ac
            return self._ask(samples[a], samples[c], None if prompts is None else prompts[a])

        if self.max_workers > 1 and len(asks) > 1:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(asks))) as pool:
                answers = list(pool.map(ask, asks))
        else:
            answers = [ask(ac) for ac in asks]
        prefs = torch.full((b, g, g), 0.5, dtype=torch.float64)  # [B, G, G]
        for n, (k, i, j) in enumerate(pairs):
            p = answers[n] if not self.symmetric else 0.5 * (answers[n] + 1.0 - answers[n + len(pairs)])
            prefs[k, i, j], prefs[k, j, i] = p, 1.0 - p
        return prefs

    def _ask(self, a: Any, b: Any, prompt: str | None) -> float:
        out = self.judge(a, b, prompt)
        if isinstance(out, str):
            return parse_preference(out)
        p = float(out)
        return p if 0.0 <= p <= 1.0 else 0.5  # NaN or out-of-range counts as unparsable

    def score(self, samples, prompts, *, group_size, **fields):
        return self.win_matrix(samples, prompts, group_size=group_size, **fields)[1].reshape(-1)  # [N]


@REWARDS.register("pairwise", input="image", kind="groupwise", range="[0, 1]", paper="Pref-GRPO (arXiv:2508.20751)")
def pairwise(
    *, base: str = "pickscore", base_kwargs: dict | None = None, tie_eps: float = 0.0, temperature: float | None = None
) -> Reward:
    """Pref-GRPO win rate: every pair of a group compared by a pointwise scorer; groupwise, needs group_size."""
    return PairwiseReward(base=load(base, **(base_kwargs or {})), tie_eps=tie_eps, temperature=temperature)
