"""Prompt samplers that choose which prompts to roll out next: uniform epochs, VADE, MMR1 variance-aware sampling.

Every sampler saves and restores its state exactly (RNG included); no model or trainer state lives here.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mmgrpo.registry import Registry

SAMPLERS = Registry("prompt sampler")


# ---------------------------------------------------------------- prompt samplers: shared plumbing


@runtime_checkable
class PromptSampler(Protocol):
    """What the trainer uses from a prompt sampler; every entry of SAMPLERS is a dataclass with these methods."""

    num_prompts: int

    def sample(self, batch_size: int) -> list[int]: ...
    def update(self, prompt_ids: list[int], rewards: Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...
    def metrics(self) -> dict[str, float]: ...


def names() -> list[str]:
    """Registered prompt sampler names."""
    return SAMPLERS.names()


def make_sampler(name: str, num_prompts: int, *, seed: int = 0, **kw: Any) -> PromptSampler:
    """Build the prompt sampler `name` over `num_prompts` prompts; unknown names and keywords raise ValueError."""
    cls = SAMPLERS.get(name)
    SAMPLERS.check_kwargs(name, kw, field="sampler kwargs")
    return cls(num_prompts, seed=seed, **kw)


def _setup(sampler: Any) -> np.random.Generator:
    if not isinstance(sampler.num_prompts, (int, np.integer)) or sampler.num_prompts < 1:
        raise ValueError(f"num_prompts={sampler.num_prompts!r} must be a positive int (the dataset size)")
    sampler.num_prompts = int(sampler.num_prompts)
    return np.random.default_rng(sampler.seed)


def _check_batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 0")
    return int(batch_size)


def _in_rounds(batch_size: int, num_prompts: int, draw: Callable[[int], np.ndarray]) -> list[int]:
    """`draw(k)` gives k distinct prompts; a batch larger than the dataset is made of several such rounds."""
    out: list[int] = []
    while len(out) < batch_size:
        out.extend(int(i) for i in draw(min(num_prompts, batch_size - len(out))))
    return out


def _outcomes(prompt_ids: list[int], rewards: Tensor, num_prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated (ids [B] int64, rewards [B, G] float64); NaN rewards mark missing samples."""
    r = np.asarray(torch.as_tensor(rewards).detach().cpu().to(torch.float64))
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if r.ndim != 2 or r.shape[0] != ids.shape[0]:
        raise ValueError(f"rewards {tuple(r.shape)} must be [B, G] with B = len(prompt_ids) = {ids.shape[0]}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_prompts):
        raise ValueError(f"prompt_ids must lie in [0, {num_prompts}), got min {ids.min()} max {ids.max()}")
    return ids, r


def _base_state(sampler: Any, name: str) -> dict[str, Any]:
    rng = copy.deepcopy(sampler._rng.bit_generator.state)
    return {"sampler": name, "num_prompts": sampler.num_prompts, "rng": rng}


def _load_base(sampler: Any, name: str, d: dict[str, Any]) -> None:
    if d.get("sampler") != name or d.get("num_prompts") != sampler.num_prompts:
        raise ValueError(
            f"state is for sampler {d.get('sampler')!r} over {d.get('num_prompts')} prompts, not {name!r} over "
            f"{sampler.num_prompts}: build the sampler with the same name and dataset before loading"
        )
    sampler._rng.bit_generator.state = copy.deepcopy(d["rng"])


def _floats(values: Any, n: int, key: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.shape[0] != n:
        raise ValueError(f"state[{key!r}] has {arr.shape[0]} entries, expected num_prompts = {n}")
    return arr.copy()


# ---------------------------------------------------------------- uniform


@SAMPLERS.register("uniform")
@dataclass
class UniformSampler:
    """Epoch-style shuffling: every prompt once per epoch in a seeded random order, like a shuffled DataLoader.

    A batch that crosses an epoch boundary never repeats a prompt (when batch_size <= num_prompts): the new epoch's
    order starts with prompts not already in the batch, and each epoch still holds every prompt exactly once.
    """

    num_prompts: int
    seed: int = 0

    def __post_init__(self):
        self._rng = _setup(self)
        self._perm = self._rng.permutation(self.num_prompts)
        self._pos, self._epoch = 0, 0

    def sample(self, batch_size: int) -> list[int]:
        batch_size, n = _check_batch_size(batch_size), self.num_prompts
        out: list[int] = []
        while len(out) < batch_size:
            if self._pos == n:
                perm = self._rng.permutation(n)
                if out and batch_size <= n:
                    need = batch_size - len(out)
                    front = perm[~np.isin(perm, out)][:need]
                    perm = np.concatenate([front, perm[~np.isin(perm, front)]])
                self._perm, self._pos, self._epoch = perm, 0, self._epoch + 1
            take = min(batch_size - len(out), n - self._pos)
            out.extend(int(i) for i in self._perm[self._pos : self._pos + take])
            self._pos += take
        return out

    def update(self, prompt_ids: list[int], rewards: Tensor) -> None:
        """Uniform sampling ignores outcomes; the inputs are still checked so a wiring bug shows up early."""
        _outcomes(prompt_ids, rewards, self.num_prompts)

    def state_dict(self) -> dict[str, Any]:
        return {**_base_state(self, "uniform"), "perm": self._perm.tolist(), "pos": self._pos, "epoch": self._epoch}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _load_base(self, "uniform", d)
        self._perm = _floats(d["perm"], self.num_prompts, "perm").astype(np.int64)
        self._pos, self._epoch = int(d["pos"]), int(d["epoch"])

    def metrics(self) -> dict[str, float]:
        """Epochs done, fractional (2.5 = half-way through the third)."""
        return {"sampler/epoch": self._epoch + self._pos / self.num_prompts}


# ---------------------------------------------------------------- VADE


@SAMPLERS.register("vade")
@dataclass
class VadeSampler:
    """VADE: Thompson-sample each prompt's success rate from a Beta posterior, roll out the top by p(1-p).

    arXiv:2511.18902. Per prompt i a posterior Beta(a_i, b_i) over its success probability under the current policy;
    `sample(k)` draws p_i ~ Beta(a_i, b_i) for every prompt and returns the k largest p_i * (1 - p_i) (the Bernoulli
    outcome variance, which is what makes a GRPO group informative). Unseen prompts sit at the prior.
    Update with rewards r in [0, 1]: a_i += sum_g r_ig, b_i += sum_g (1 - r_ig). Binary rewards give the conjugate
    Beta-Bernoulli update; a continuous r counts as a fractional success (the expected update of the Bernoulli trick
    of Agrawal & Goyal, arXiv:1111.1797). NaN rewards are skipped.
    Two-scale prior decay (our reading of the paper, whose notes name the mechanism but not its formula): the
    evidence e = (a - a0, b - b0) above the prior (a0, b0) shrinks toward the prior on two time scales:
      - slow, every `update` call (one rollout round) for all prompts: e <- step_decay * e, so a prompt unseen for
        t rounds keeps step_decay^t of its evidence and drifts back to the prior as the policy moves;
      - fast, when a prompt gets new outcomes: e <- visit_decay * e before adding them, so the fresh group from the
        current policy outweighs older rollouts.
    Defaults: prior (1, 1), step_decay 0.99 (half-life ~69 rounds), visit_decay 0.5.
    """

    num_prompts: int
    seed: int = 0
    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    step_decay: float = 0.99
    visit_decay: float = 0.5

    def __post_init__(self):
        if self.prior_alpha <= 0 or self.prior_beta <= 0:
            raise ValueError(f"prior ({self.prior_alpha}, {self.prior_beta}): Beta parameters must be > 0")
        for key in ("step_decay", "visit_decay"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(f"{key}={getattr(self, key)} must lie in (0, 1]; 1 disables that decay")
        self._rng = _setup(self)
        self._ev_a = np.zeros(self.num_prompts)  # [P] successes above the prior
        self._ev_b = np.zeros(self.num_prompts)  # [P] failures above the prior
        self._visits = np.zeros(self.num_prompts, dtype=np.int64)  # [P]
        self._steps = 0

    def posterior(self) -> tuple[Tensor, Tensor]:
        """(alpha [P], beta [P]) float64: the current Beta posterior of every prompt."""
        return torch.from_numpy(self.prior_alpha + self._ev_a), torch.from_numpy(self.prior_beta + self._ev_b)

    def _draw(self, k: int) -> np.ndarray:
        p = self._rng.beta(self.prior_alpha + self._ev_a, self.prior_beta + self._ev_b)  # [P]
        return np.argsort(-(p * (1.0 - p)), kind="stable")[:k]

    def sample(self, batch_size: int) -> list[int]:
        return _in_rounds(_check_batch_size(batch_size), self.num_prompts, self._draw)

    def update(self, prompt_ids: list[int], rewards: Tensor) -> None:
        """Feed the [B, G] outcomes of one rollout round (rewards in [0, 1]); each call applies one step_decay."""
        ids, r = _outcomes(prompt_ids, rewards, self.num_prompts)
        finite = np.isfinite(r)  # [B, G]
        if np.any(finite & ((r < 0) | (r > 1))):
            raise ValueError(
                f"VADE needs rewards in [0, 1] (success probabilities), got range [{np.nanmin(r)}, {np.nanmax(r)}]: "
                "pass the binary outcome or rescale the reward"
            )
        self._ev_a *= self.step_decay
        self._ev_b *= self.step_decay
        succ = np.where(finite, r, 0.0).sum(axis=1)  # [B]
        fail = np.where(finite, 1.0 - r, 0.0).sum(axis=1)  # [B]
        # sequential on purpose: a prompt listed twice in one round is two visits
        for i, s, f, seen in zip(ids, succ, fail, finite.any(axis=1)):
            if seen:
                self._ev_a[i] = self.visit_decay * self._ev_a[i] + s
                self._ev_b[i] = self.visit_decay * self._ev_b[i] + f
                self._visits[i] += 1
        self._steps += 1

    def state_dict(self) -> dict[str, Any]:
        ev = {"evidence_alpha": self._ev_a.tolist(), "evidence_beta": self._ev_b.tolist()}
        return {**_base_state(self, "vade"), **ev, "visits": self._visits.tolist(), "steps": self._steps}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _load_base(self, "vade", d)
        self._ev_a = _floats(d["evidence_alpha"], self.num_prompts, "evidence_alpha")
        self._ev_b = _floats(d["evidence_beta"], self.num_prompts, "evidence_beta")
        self._visits = _floats(d["visits"], self.num_prompts, "visits").astype(np.int64)
        self._steps = int(d["steps"])

    def metrics(self) -> dict[str, float]:
        """Share of prompts seen; mean posterior success rate and its p(1-p) over the seen prompts."""
        seen = self._visits > 0
        a, b = self.prior_alpha + self._ev_a[seen], self.prior_beta + self._ev_b[seen]
        mean = a / (a + b) if seen.any() else np.zeros(1)  # [seen]
        info = float((mean * (1.0 - mean)).mean())
        return {"sampler/seen_frac": float(seen.mean()), "sampler/p_mean": float(mean.mean()), "sampler/p_info": info}


# ---------------------------------------------------------------- MMR1 variance-aware sampling


@SAMPLERS.register("mmr1_vas")
@dataclass
class VasSampler:
    """MMR1 variance-aware sampling: draw prompts by a mixture of their Variance Promotion Score and uniform.

    arXiv:2509.21268. VPS_i = outcome_weight * Var_g(r_ig) + diversity_weight * D_i, where Var is the group's
    population variance of rewards (= p(1-p) for binary rewards, MMR1's "learnability") and D_i an optional
    trajectory-diversity score in [0, 1] passed to `update(..., diversity=)` (MMR1 uses self-BLEU / distinct-n; the
    example config weights 0.8 / 0.2). Probabilities: q_i = mixture_ratio * VPS_i / sum_j VPS_j
    + (1 - mixture_ratio) / P (all uniform when every VPS is 0); a batch is drawn from q without replacement
    (Gumbel top-k). Unseen prompts score `init_score` (0.25 = the largest Bernoulli variance, so every prompt gets
    explored; MMR1 instead scores the whole set with extra rollouts before training). With `momentum` m a revisited
    prompt keeps VPS <- m * VPS_old + (1 - m) * VPS_new (MMR1's EMA; 0 = latest group only).
    Differences from the anchor (LengSicong/MMR1 MixedCurriculumSampler): it splits each batch into int(ratio * B)
    VPS-weighted draws with replacement plus uniform draws and min-max rescales the scores; we mix the
    probabilities and draw without replacement, so no duplicated prompt wastes a group.
    """

    num_prompts: int
    seed: int = 0
    mixture_ratio: float = 0.5
    outcome_weight: float = 1.0
    diversity_weight: float = 0.0
    momentum: float = 0.0
    init_score: float = 0.25

    def __post_init__(self):
        if not 0.0 <= self.mixture_ratio <= 1.0:
            raise ValueError(f"mixture_ratio={self.mixture_ratio} must lie in [0, 1] (share of VPS-weighted mass)")
        if min(self.outcome_weight, self.diversity_weight, self.init_score) < 0:
            raise ValueError("outcome_weight, diversity_weight and init_score must be >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum={self.momentum} must lie in [0, 1); 0 keeps only the latest group")
        self._rng = _setup(self)
        self._score = np.zeros(self.num_prompts)  # [P]
        self._seen = np.zeros(self.num_prompts, dtype=bool)  # [P]

    def probabilities(self) -> Tensor:
        """q [P] float64: the probability of each prompt being the next single draw."""
        vps = np.where(self._seen, self._score, self.init_score)  # [P]
        total = vps.sum()
        weighted = vps / total if total > 0 else np.full(self.num_prompts, 1.0 / self.num_prompts)
        return torch.from_numpy(self.mixture_ratio * weighted + (1.0 - self.mixture_ratio) / self.num_prompts)

    def _draw(self, k: int) -> np.ndarray:
        q = self.probabilities().numpy()  # [P]
        g = self._rng.gumbel(size=self.num_prompts)  # [P]
        keys = np.where(q > 0, np.log(np.where(q > 0, q, 1.0)) + g, -np.inf)  # [P]
        # zero-probability prompts come last, in random order (only reached when k exceeds the positive ones)
        return np.lexsort((-g, -keys))[:k]

    def sample(self, batch_size: int) -> list[int]:
        return _in_rounds(_check_batch_size(batch_size), self.num_prompts, self._draw)

    def update(self, prompt_ids: list[int], rewards: Tensor, *, diversity: Tensor | None = None) -> None:
        """Feed the [B, G] outcomes (any scale; init_score assumes [0, 1]) and, optionally, diversity [B] in [0, 1]."""
        ids, r = _outcomes(prompt_ids, rewards, self.num_prompts)
        if (diversity is None) != (self.diversity_weight == 0):
            raise ValueError(
                f"diversity_weight={self.diversity_weight} but diversity={'None' if diversity is None else 'given'}: "
                "pass diversity [B] with diversity_weight > 0, or neither"
            )
        div = np.zeros(len(ids)) if diversity is None else np.asarray(torch.as_tensor(diversity).cpu(), dtype=float)
        if div.shape != ids.shape:
            raise ValueError(f"diversity {div.shape} must be [B] = ({len(ids)},)")
        finite = np.isfinite(r)  # [B, G]
        mean = np.where(finite, r, 0.0).sum(1) / np.maximum(finite.sum(1), 1)  # [B]
        var = (np.where(finite, r - mean[:, None], 0.0) ** 2).sum(1) / np.maximum(finite.sum(1), 1)  # [B]
        fresh = self.outcome_weight * var + self.diversity_weight * div  # [B]
        for i, v, seen in zip(ids, fresh, finite.any(axis=1)):
            if seen:
                self._score[i] = self.momentum * self._score[i] + (1 - self.momentum) * v if self._seen[i] else v
                self._seen[i] = True

    def state_dict(self) -> dict[str, Any]:
        return {**_base_state(self, "mmr1_vas"), "score": self._score.tolist(), "seen": self._seen.tolist()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        _load_base(self, "mmr1_vas", d)
        self._score = _floats(d["score"], self.num_prompts, "score")
        self._seen = _floats(d["seen"], self.num_prompts, "seen").astype(bool)

    def metrics(self) -> dict[str, float]:
        """Share of prompts seen, their mean VPS, and the largest draw probability relative to uniform (1 = flat)."""
        score = float(self._score[self._seen].mean()) if self._seen.any() else 0.0
        peak = float(self.probabilities().max()) * self.num_prompts
        return {"sampler/seen_frac": float(self._seen.mean()), "sampler/score_mean": score, "sampler/peak_prob": peak}
