"""The contract between pipelines and the core: `Rollout`, the `Policy` protocol and the `Task` a pipeline builds.

Nothing modality-specific lives here; pipeline data rides in `Rollout.extras` and is read back only by its pipeline.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass
class Rollout:
    """G samples for each of B prompts, with what the update needs to re-score them.

    Sample n belongs to prompt n // G (samples of one group are contiguous).
    """

    samples: list[Any]
    """[N] outputs: texts, images (PIL or [3,H,W] tensors) or videos; what rewards score."""
    old_logp: Tensor
    """[N, K] per-element log-probs under the sampling policy (K = tokens or denoising steps), float32."""
    mask: Tensor
    """[N, K] bool: which elements are real decisions (padding and untrained steps are False)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Pipeline-only payload (token ids, latents, sigmas...), tensors with leading dim N. One shared key:
    `"reward_fields"`, a dict of per-sample lists [N] (token lengths, likelihoods) passed to the rewards."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout-time metrics the pipeline wants logged (e.g. mean completion length)."""

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def check(self, batch_size: int, group_size: int) -> None:
        """Raise ValueError when the shapes do not match B x G samples."""
        n = batch_size * group_size
        if len(self.samples) != n:
            raise ValueError(f"rollout has {len(self.samples)} samples, expected B*G = {batch_size}*{group_size}={n}")
        if self.old_logp.dim() != 2 or self.old_logp.shape[0] != n:
            raise ValueError(f"rollout.old_logp {tuple(self.old_logp.shape)} must be [N={n}, K]")
        if self.mask.shape != self.old_logp.shape:
            raise ValueError(f"rollout.mask {tuple(self.mask.shape)} != old_logp {tuple(self.old_logp.shape)}")


@runtime_checkable
class Policy(Protocol):
    """What a pipeline implements so that `mmgrpo.train` can optimise it; the loop never asks which modality."""

    def rollout(self, prompts: list[dict[str, Any]], group_size: int, seeds: list[int]) -> Rollout:
        """Sample `group_size` outputs per prompt without grad; `seeds[b]` seeds prompt b's group.

        One seed per prompt (not per process) makes a global batch roll out identically on any number of ranks.
        """
        ...

    def logp(self, model: torch.nn.Module, rollout: Rollout, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Log-probs [n, K] of samples `idx` through `model` (the Task's module, possibly wrapped by accelerate
        for DDP, so call its forward), with grad; plus extras such as `{"entropy": [n, K]}`.

        A policy with attribute `k_chunk = c` is called as `logp(model, rollout, idx, k_slice=slice(i, i + c))`
        instead and returns [n, c]: one backward per chunk of K bounds memory (Flow-GRPO: one per timestep).
        A policy with `per_element_metrics = True` gets `ratio/k{j}` logged for every decision index j.
        Extras may hold `"loss_kwargs"`: per-element tensors [n, K] passed to the configured loss as keywords
        (e.g. GRPO-Guard's `std` and `mean_sq_dist`), so pipeline-specific losses need no trainer branch."""
        ...

    def ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor | None:
        """Reference-policy log-probs [n, K] (no grad), or None when the pipeline has no reference."""
        ...

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, Tensor]:
        """Trainable weights only (what a checkpoint stores)."""
        ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...

    # Optional hooks, looked up with hasattr (a policy without them still trains):
    #   set_iteration(step)                  called before each rollout (schedules inside the policy: MixGRPO)
    #   gallery(rollout, prompts, rewards)   -> [{"prompt", "reward", "text" | "image" | "frames"}] for galleries
    #   export(directory: Path)              writes the deployable format into each checkpoint's export/ (e.g. a peft
    #                                        adapter_model.safetensors + adapter_config.json), checksummed too
    #   wants_step_advantages = True + step_advantages(rollout, rewards [B_local, G]) -> [N_local, K] per-decision
    #                                        advantages (BranchGRPO trees) instead of the configured estimator's
    #   set_reward_inputs(kinds)             the configured rewards' input kinds ("image", "latent", ...), given
    #                                        before any rollout (flow: skip the VAE when every reward reads latents)
    #   for_evaluation()                     called by `mmgrpo eval` / `sample` before any rollout: switch off
    #                                        training-only rollout tricks (TempSamp's injected ground truth)
    #   ablate_records(records, ablation, seed=, workdir=) -> copies with blank ("blank") or another record's
    #                                        ("shuffle") pixels, for `mmgrpo eval ablate=` (pipelines/visual_ablation.py)
    #   preview(record)                      -> {"image": ...} or {"frames": [...]}: the record's input, for reports
    #   k_chunk, per_element_metrics         see `logp`
    #   defer_old_logp (bool attribute)      set by the engine to True when the update is on-policy (one inner epoch,
    #                                        one mini-batch); the rollout may then skip scoring, return zeros as
    #                                        old_logp and set extras["old_logp_deferred"] = True, and the loss uses
    #                                        the update's own log-probs, detached, as the old ones


@dataclass
class Task:
    """What a pipeline builder returns: a policy, its module (for accelerate) and its prompt data."""

    policy: Policy
    module: torch.nn.Module
    """The nn.Module that owns the trainable parameters (wrapped by accelerate for DDP)."""
    train_data: list[dict[str, Any]]
    """Prompt records: {"prompt": ..., plus ground-truth fields the rewards read (answers, boxes...)}."""
    eval_data: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[dict[str, Any]] = field(default_factory=list)
    """Default reward specs [{"name", "weight", "kwargs"}] when the config names none."""
