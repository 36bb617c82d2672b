"""Which prompts to roll out next and which groups to train on: zero-variance filtering, DAPO refill, prompt samplers.

Bookkeeping on `[B, G]` rewards and prompt indices only; no model, no modality and no trainer state lives here.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


# ---------------------------------------------------------------- zero-variance filter


def group_keep_mask(rewards: Tensor, *, atol: float = 0.0, rtol: float = 1e-6) -> Tensor:
    """True for the groups whose rewards are not all equal, i.e. that give a non-zero GRPO advantage.

    DAPO dynamic sampling (arXiv:2503.14476), decided on the outcome spread rather than the mean, so it also holds for
    continuous rewards (a mean in (0, 1) says nothing about the spread: OpenRLHF#1270, EasyR1's mean-based filter).
    Formula: keep_b = (max_g r_bg - min_g r_bg) > atol + rtol * max_g |r_bg|, over the finite rewards of the group.
    Gate on the outcome you want variance in: with shaped rewards (accuracy + a small length term) pass the accuracy
    column, or an atol above the shaping, else all-wrong groups keep "phantom" advantages (verl-recipe#125).

    Args:
        rewards: [B, G] (or [B, G, R]: kept when any of the R rewards varies); NaN/inf entries (ragged groups
            padded with NaN) are ignored.
        atol, rtol: tolerance under which rewards count as equal (torch.isclose-style).
    Returns:
        bool [B] on the rewards' device. A group with fewer than two finite rewards (G = 1) is never kept.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol}, rtol={rtol}: tolerances must be >= 0")
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    if r.dim() == 2:
        r = r.unsqueeze(-1)  # [B, G, 1]
    if r.dim() != 3:
        raise ValueError(f"rewards must be [B, G] or [B, G, R], got shape {tuple(r.shape)}")
    if r.shape[1] == 0:
        return torch.zeros(r.shape[0], dtype=torch.bool, device=r.device)
    finite = torch.isfinite(r)  # [B, G, R]
    hi = torch.where(finite, r, -torch.inf).amax(dim=1)  # [B, R]
    lo = torch.where(finite, r, torch.inf).amin(dim=1)  # [B, R]
    enough = finite.sum(dim=1) >= 2  # [B, R]
    spread = torch.where(enough, hi - lo, 0.0)  # [B, R]
    scale = torch.where(enough, torch.maximum(hi.abs(), lo.abs()), 0.0)  # [B, R]
    return (enough & (spread > atol + rtol * scale)).any(dim=-1)  # [B]


def zero_std_fraction(rewards: Tensor, *, atol: float = 0.0, rtol: float = 1e-6) -> float:
    """Fraction of groups with no reward spread (the ones `group_keep_mask` drops); 0.0 for an empty batch.

    Log it as `adv/zero_std_frac`: it is the share of the batch that gives no gradient under GRPO.
    """
    keep = group_keep_mask(rewards, atol=atol, rtol=rtol)  # [B]
    return 0.0 if keep.numel() == 0 else 1.0 - keep.double().mean().item()


# ---------------------------------------------------------------- DAPO over-sample and refill


def _map_leaves(payload: Any, fn: Callable[[Any, str], Any], where: str = "groups") -> Any:
    if isinstance(payload, dict):
        return {k: _map_leaves(v, fn, f"{where}[{k!r}]") for k, v in payload.items()}
    if isinstance(payload, (Tensor, np.ndarray)) and payload.ndim == 0:
        raise ValueError(f"{where} is a 0-d array; every leaf needs a leading dim of B groups (or B*G samples)")
    if not isinstance(payload, (Tensor, np.ndarray, list, tuple)):
        raise ValueError(f"{where} is a {type(payload).__name__}; leaves must be Tensor, numpy array, list or tuple")
    return fn(payload, where)


def _slice_groups(payload: Any, start: int, stop: int, num_groups: int) -> Any:
    """Rows of groups [start, stop) of a payload holding `num_groups` groups (each group's rows are contiguous)."""

    def cut(x, where):
        k = len(x) // num_groups
        return x[start * k : stop * k]

    return _map_leaves(payload, cut)


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    return [item for p in parts for item in p]


def _structure(payload: Any) -> Any:
    """Nested keys and leaf types: what must stay the same from one round to the next."""
    return {k: _structure(v) for k, v in payload.items()} if isinstance(payload, dict) else type(payload).__name__


@dataclass
class GroupBuffer:
    """Collects the kept groups of several rollout rounds until a full batch is ready (DAPO, arXiv:2503.14476).

    Loop: `while not buf.ready(B): ids = sampler.sample(B); groups, rewards = rollout(ids); sampler.update(ids,
    rewards); buf.add(groups, group_keep_mask(rewards))`, then `batch = buf.take(B)`. The sampler learns from every
    round, filtered groups included: they are what tells VADE a prompt is solved.
    A payload is opaque: a Tensor, numpy array or list, or a (nested) dict of those, whose leading dim is the B
    groups of `keep` or B*G samples (a group's rows contiguous, as in `Rollout`).
    `take` returns exactly the first `target_groups` kept groups in arrival order.
    Surplus: dropped by default, as DAPO/verl do (`batch[:traj_bsz]`); `keep_surplus=True` carries it into the next
    step (those groups then come from a policy one step older, i.e. slightly off-policy).
    `max_rounds` bounds the rollout rounds per batch (None = no bound), like verl's `max_num_gen_batches`.
    """

    max_rounds: int | None = 10
    keep_surplus: bool = False
    rounds: int = field(default=0, init=False)
    generated: int = field(default=0, init=False)
    kept: int = field(default=0, init=False)
    _chunks: list[tuple[Any, int]] = field(default_factory=list, init=False, repr=False)
    _kinds: Any = field(default=None, init=False, repr=False)
    _last: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1, or None for no bound")

    def __len__(self) -> int:
        """Number of kept groups held."""
        return sum(n for _, n in self._chunks)

    def add(self, groups: Any, keep: Tensor | list[bool]) -> None:
        """Add one rollout round: `groups` holds B groups (or B*G samples) and `keep` bool [B] says which to keep."""
        keep = np.asarray(torch.as_tensor(keep).detach().cpu(), dtype=bool).reshape(-1)  # [B]
        num = keep.shape[0]
        kinds = _structure(groups)
        if self._kinds is not None and kinds != self._kinds:
            raise ValueError(f"groups changed structure between rounds: {kinds} != {self._kinds}")

        def pick(x, where):
            if num == 0 or len(x) % num:
                raise ValueError(f"{where} has {len(x)} rows; keep has {num} groups: need B or B*G rows")
            rows = (np.flatnonzero(keep)[:, None] * (len(x) // num) + np.arange(len(x) // num)).reshape(-1)
            if isinstance(x, Tensor):
                return x[torch.as_tensor(rows, dtype=torch.long, device=x.device)]
            return x[rows] if isinstance(x, np.ndarray) else [x[i] for i in rows]

        kept = _map_leaves(groups, pick)
        self._kinds = kinds
        self.rounds, self.generated, self.kept = self.rounds + 1, self.generated + num, self.kept + int(keep.sum())
        if keep.any():
            self._chunks.append((kept, int(keep.sum())))

    def ready(self, target_groups: int) -> bool:
        """True once `target_groups` groups are held; raises ValueError once `max_rounds` rounds did not suffice."""
        if len(self) >= target_groups:
            return True
        if self.max_rounds is not None and self.rounds >= self.max_rounds:
            raise ValueError(
                f"GroupBuffer: only {len(self)} of {target_groups} groups had reward variance after {self.rounds} "
                f"rollout rounds ({self.generated} groups generated): generated too many batches; check your data "
                "and reward (prompts all solved or all failed?), or raise max_rounds / lower the batch size"
            )
        return False

    def take(self, target_groups: int) -> Any:
        """Exactly `target_groups` kept groups, oldest first; resets the round count for the next batch."""
        if target_groups < 1 or len(self) < target_groups:
            raise ValueError(f"take({target_groups}): buffer holds {len(self)} groups; call ready() before take()")
        out, rest, need = [], [], target_groups
        for payload, n in self._chunks:
            if need >= n:
                out.append(payload)
            elif need > 0:
                out.append(_slice_groups(payload, 0, need, n))
                rest.append((_slice_groups(payload, need, n, n), n - need))
            else:
                rest.append((payload, n))
            need -= min(need, n)
        self._chunks = rest if self.keep_surplus else []
        self._last = {"filter/rounds": float(self.rounds), "filter/kept_frac": self.kept / max(self.generated, 1)}
        self._last["filter/carried"] = float(len(self))
        self.rounds, self.generated, self.kept = 0, 0, 0
        return _concat(out)

    def metrics(self) -> dict[str, float]:
        """For the last `take`: rollout rounds used, kept share of the groups generated, groups carried over."""
        return dict(self._last)


# prompt samplers live in mmgrpo/samplers.py; re-exported here so `mmgrpo.sampling` stays the one entry point
from mmgrpo.samplers import (  # noqa: E402
    SAMPLERS,
    PromptSampler,
    UniformSampler,
    VadeSampler,
    VasSampler,
    make_sampler,
    names,
)

__all__ = ["GroupBuffer", "PromptSampler", "SAMPLERS", "UniformSampler", "VadeSampler", "VasSampler",
           "group_keep_mask", "make_sampler", "names", "zero_std_fraction"]
