"""The reward contract: the `Reward` callable, the REWARDS registry, the batch checks and the reward errors.

Model code never lives here; every concrete reward registers a factory `(**kwargs) -> Reward` in REWARDS.
Loading by name or URL is rewards/api.py's (it needs the HTTP client, which builds on this contract).
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mmgrpo.registry import Registry

REWARDS = Registry("reward")
KINDS = ("pointwise", "groupwise")
INPUTS = ("image", "video", "text", "latent")
"""latent: the generator's raw final latents ([C, h, w] per image, [C, f, h, w] per video): no VAE decode needed"""


class RewardError(Exception):
    """A reward raised while scoring; names the reward and, when it could be found, the failing sample."""

    def __init__(self, message: str, *, reward_name: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.reward_name = reward_name
        self.sample_index = sample_index


class Reward:
    """A batched scorer: `reward(samples, prompts=None, **fields) -> Tensor float32 [N]` (on the CPU).

    Subclasses implement `score(samples, prompts, **fields)` returning N numbers (list, array or tensor).
    Groupwise rewards also receive `group_size=G`; samples of one group are contiguous (sample n is in group n // G).
    NaN or inf scores are returned as they are: the trainer detects and reports them.
    With `differentiable=True` (CLIP-family rewards) the scores stay on the model device with their autograd graph.

    Attributes:
        name: registry name.  kind: "pointwise" | "groupwise".  input: "image" | "video" | "text" | "latent".
        preprocess: one line saying resolution, normalisation and output scale.
        fields: ground-truth fields this reward reads (e.g. ("answers",)); required ones are in `required`.
    """

    name: str = "reward"
    kind: str = "pointwise"
    input: str = "text"
    preprocess: str = ""
    fields: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    needs_prompts: bool = False

    def score(self, samples: Sequence[Any], prompts: list[str] | None, **fields: Any) -> Any:
        raise NotImplementedError

    def __call__(self, samples: Any, prompts: Sequence[str] | None = None, **fields: Any) -> Tensor:
        samples = as_sample_list(samples)
        n = len(samples)
        group_size = fields.pop("group_size", None)
        prompts = check_prompts(prompts, n, needed=self.needs_prompts, name=self.name)
        check_fields(self, fields, n)
        if self.kind == "groupwise":
            fields["group_size"] = check_group_size(group_size, n, self.name)
        out = self.score(samples, prompts, **fields)
        if getattr(self, "differentiable", False) and isinstance(out, Tensor):
            if out.numel() != n:
                raise ValueError(f"reward {self.name!r} returned {out.numel()} scores for {n} samples")
            return out.float().reshape(-1)  # [N] on the model's device, keeping the graph to the pixels
        return to_scores(out, n, self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.kind} input={self.input}: {self.preprocess}>"


class FunctionReward(Reward):
    """A Reward around a per-batch function `fn(samples, prompts, **fields) -> N numbers`."""

    def __init__(
        self,
        fn: Callable,
        *,
        name: str,
        input: str = "text",
        kind: str = "pointwise",
        preprocess: str = "",
        fields: tuple[str, ...] = (),
        required: tuple[str, ...] = (),
        needs_prompts: bool = False,
    ):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {KINDS}")
        if input not in INPUTS:
            raise ValueError(f"input={input!r} is not one of {INPUTS}")
        self.fn, self.name, self.input, self.kind = fn, name, input, kind
        self.preprocess, self.fields, self.required, self.needs_prompts = preprocess, fields, required, needs_prompts

    def score(self, samples, prompts, **fields):
        return self.fn(samples, prompts, **fields)


def as_sample_list(samples: Any) -> list[Any]:
    """A batch as a list: a [N, ...] tensor or array is split along dim 0; a single string is rejected."""
    if isinstance(samples, str | bytes):
        raise ValueError(
            "samples must be a batch (a list, or a tensor with a leading N dim), got a single string; "
            "wrap it in a list"
        )
    if isinstance(samples, Tensor):
        if samples.dim() < 1:
            raise ValueError(f"samples tensor must have a leading batch dim, got shape {tuple(samples.shape)}")
        return list(samples.unbind(0))
    if hasattr(samples, "shape") and hasattr(samples, "__getitem__") and not isinstance(samples, list):
        return [samples[i] for i in range(samples.shape[0])]
    return list(samples)


def check_prompts(prompts: Sequence[str] | None, n: int, *, needed: bool, name: str) -> list[str] | None:
    if prompts is None:
        if needed:
            raise ValueError(f"reward {name!r} needs prompts: pass prompts=[...] with one string per sample ({n})")
        return None
    if isinstance(prompts, str):
        prompts = [prompts] * n
    prompts = list(prompts)
    if len(prompts) != n:
        raise ValueError(
            f"reward {name!r}: got {len(prompts)} prompts for {n} samples; pass one prompt per sample "
            "(repeat each prompt G times for a group)"
        )
    return prompts


def check_fields(reward: Reward, fields: dict[str, Any], n: int) -> None:
    """Unknown or missing ground-truth fields raise ValueError; each given field must hold one entry per sample."""
    for key, value in fields.items():
        if key not in reward.fields:
            known = ", ".join(reward.fields) or "none"
            raise ValueError(f"reward {reward.name!r} takes no field {key!r}; its fields: {known}")
        if value is not None and hasattr(value, "__len__") and not isinstance(value, str) and len(value) != n:
            raise ValueError(f"reward {reward.name!r}: field {key!r} has {len(value)} entries for {n} samples")
    missing = [k for k in reward.required if fields.get(k) is None]
    if missing:
        raise ValueError(
            f"reward {reward.name!r} needs field(s) {', '.join(missing)}: pass e.g. "
            f"{missing[0]}=[...] with one entry per sample"
        )


def check_group_size(group_size: Any, n: int, name: str) -> int:
    if group_size is None:
        raise ValueError(f"groupwise reward {name!r} needs group_size=G (samples of a group contiguous)")
    g = int(group_size)
    if g < 1 or n % g:
        raise ValueError(f"reward {name!r}: group_size={group_size} must be >= 1 and divide the {n} samples")
    return g


def to_scores(out: Any, n: int, name: str) -> Tensor:
    """N numbers -> float32 CPU tensor [N]; a wrong count raises ValueError naming the reward."""
    t = out.detach() if isinstance(out, Tensor) else torch.as_tensor(out, dtype=torch.float64)
    t = t.to(device="cpu", dtype=torch.float32).reshape(-1)  # [N]
    if t.numel() != n:
        raise ValueError(f"reward {name!r} returned {t.numel()} scores for {n} samples")
    return t
