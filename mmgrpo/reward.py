"""The reward contract the engine scores with: `Reward`, the REWARDS registry, `load`, `RewardSet`, the batch checks.

No concrete reward and no model code lives here: packages register factories `(**kwargs) -> Reward` in REWARDS when
imported (mmgrpo's own `rewards` package through the `mmgrpo.plugins` entry point), and `load` imports the declared
plugins before it reports an unknown name. The HTTP client plugs in with `set_url_client` (rewards/client.py does).
"""

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mmgrpo.errors import UserError
from mmgrpo.plugins import load_plugins
from mmgrpo.registry import Registry

REWARDS = Registry("reward")
KINDS = ("pointwise", "groupwise")
INPUTS = ("image", "video", "text", "latent")
"""latent: the generator's raw final latents ([C, h, w] per image, [C, f, h, w] per video): no VAE decode needed"""
URL_PREFIXES = ("http://", "https://")


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


# ----- loading by name or URL
_URL_CLIENT: dict[str, Callable[..., Reward]] = {}  # "http" -> the factory set_url_client registered


def set_url_client(factory: Callable[..., Reward]) -> None:
    """Make `load("http://host:port/name", **kw)` return `factory(url, **kw)` (rewards/client.py registers its
    HttpReward when imported); a second, different factory raises, as a taken registry name does."""
    old = _URL_CLIENT.get("http")
    if old is not None and old is not factory:
        raise ValueError(f"a reward URL client is already set ({old!r}); only one package may serve reward URLs")
    _URL_CLIENT["http"] = factory


def factory_of(name: str) -> Callable[..., Reward]:
    """The factory registered as `name`; when it is not registered yet, the declared plugins are imported first, so
    an unknown name raises ValueError listing every installed reward."""
    if name not in REWARDS:
        load_plugins()
    return REWARDS.get(name)


def load(name_or_url: str, **kwargs: Any) -> Reward:
    """A Reward by registry name (`load("pickscore", device="cuda")`) or HTTP URL (`load("http://host:8000/pickscore")`).

    Unknown names raise ValueError listing the choices; unknown keywords raise ValueError naming them.
    """
    if not isinstance(name_or_url, str):
        raise ValueError(f"reward name must be a string, got {type(name_or_url).__name__}")
    if name_or_url.startswith(URL_PREFIXES):
        if "http" not in _URL_CLIENT:
            load_plugins()
        if "http" not in _URL_CLIENT:
            raise UserError(
                f"reward URL {name_or_url!r}: no reward URL client is installed; install mmgrpo's `rewards` package "
                "(`pip install -e .` in a checkout), or name a registered reward instead"
            )
        return _URL_CLIENT["http"](name_or_url, **kwargs)
    make = factory_of(name_or_url)
    REWARDS.check_kwargs(name_or_url, kwargs)
    reward = make(**kwargs)
    reward.name = name_or_url
    return reward


def names() -> list[str]:
    """Every registered reward name, sorted (`mmgrpo.plugins.load_plugins()` registers the installed packages')."""
    return REWARDS.names()


def describe() -> dict[str, str]:
    """name -> one-line description (input, range, source)."""
    return REWARDS.describe()


def info(name: str) -> dict[str, Any]:
    """The registry metadata of a reward: input, kind, range, paper, load."""
    factory_of(name)
    return dict(REWARDS.meta(name))


# ----- composing: RewardSet
def parse_spec(i: int, spec: Any) -> tuple[str, float, dict, str]:
    """Reward spec number `i` (a name, or {name, weight, kwargs, label}) -> (name, weight, kwargs, label)."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(
            f"reward spec {i} must be a dict with a 'name' (and optional 'weight', 'kwargs', 'label'), got {spec!r}"
        )
    extra = set(spec) - {"name", "weight", "kwargs", "label"}
    if extra:
        raise ValueError(
            f"reward spec {i} ({spec['name']!r}) has unknown key(s) {sorted(extra)}; use name, weight, kwargs, label"
        )
    weight = spec.get("weight", 1.0)
    if not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"reward spec {i} ({spec['name']!r}): weight={weight!r} must be a finite number")
    kwargs = dict(spec.get("kwargs") or {})
    return spec["name"], float(weight), kwargs, str(spec.get("label") or spec["name"])


def with_defaults(name: str, kwargs: dict, defaults: dict) -> dict:
    """Add device/dtype to kwargs when the factory accepts them and the spec did not set them."""
    if name.startswith(URL_PREFIXES):
        return kwargs
    params = inspect.signature(factory_of(name)).parameters
    return {**{k: v for k, v in defaults.items() if k in params and k not in kwargs}, **kwargs}


class RewardSet:
    """Named rewards with weights: `reward_set(samples, prompts, group_size=G, **fields) -> ([N, R], [N])`.

    The per-reward scores [N, R] are what GDPO normalises one by one; total = per_reward @ weights.
    Specs: [{"name": "pickscore", "weight": 1.0, "kwargs": {...}}, ...]; a name may also be an HTTP URL.
    Each reward receives only the fields it declares. NaN/inf scores pass through untouched (the trainer reports them).
    """

    def __init__(
        self, specs: Sequence[dict | str], *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        if not specs:
            raise ValueError("RewardSet needs at least one reward spec, e.g. [{'name': 'format', 'weight': 1.0}]")
        parsed = [parse_spec(i, s) for i, s in enumerate(specs)]
        for name, _, kwargs, _ in parsed:
            if not name.startswith(URL_PREFIXES):
                factory_of(name)  # unknown name -> ValueError listing the choices, before any model loads
                REWARDS.check_kwargs(name, kwargs, field=f"reward {name!r} kwargs")
        # labels name the columns (metrics reward/<label>/mean); one reward may appear twice with other kwargs
        self.names = [label for _, _, _, label in parsed]
        if len(set(self.names)) != len(self.names):
            raise ValueError(
                f"reward labels must be unique in a RewardSet, got {self.names}; give repeated "
                "rewards a 'label', e.g. {name: shapes_geneval, label: strict, kwargs: {mode: strict}}"
            )
        self.weights = torch.tensor([w for _, w, _, _ in parsed], dtype=torch.float32)  # [R]
        defaults = {"device": device, "dtype": dtype}
        self.rewards = [load(name, **with_defaults(name, kw, defaults)) for name, _, kw, _ in parsed]

    def __len__(self) -> int:
        return len(self.rewards)

    def __call__(
        self, samples: Any, prompts: Sequence[str] | None = None, *, group_size: int | None = None, **fields: Any
    ) -> tuple[Tensor, Tensor]:
        samples = as_sample_list(samples)
        cols = [
            self._score_one(name, r, samples, prompts, group_size, fields) for name, r in zip(self.names, self.rewards)
        ]
        per_reward = torch.stack(cols, dim=1)  # [N, R]
        total = per_reward @ self.weights  # [N]
        return per_reward, total

    def _score_one(self, name: str, reward: Reward, samples: list, prompts, group_size, fields) -> Tensor:
        mine = {k: v for k, v in fields.items() if k in getattr(reward, "fields", ())}
        if reward.kind == "groupwise":
            mine["group_size"] = group_size
        try:
            return reward(samples, prompts, **mine)
        except Exception as err:
            index = _find_failing(reward, samples, prompts, mine) if reward.kind == "pointwise" else None
            where = f"on sample {index}" if index is not None else "on the batch (no single sample fails alone)"
            raise RewardError(
                f"reward {name!r} failed {where} ({type(err).__name__}): {err}", reward_name=name, sample_index=index
            ) from err


def _find_failing(reward: Reward, samples: list, prompts, fields: dict) -> int | None:
    """Re-score one sample at a time (only after the batch call failed) and return the first failing index."""
    if len(samples) < 2:
        return 0
    for i in range(len(samples)):
        one = {
            k: (v[i : i + 1] if v is not None and hasattr(v, "__getitem__") and not isinstance(v, str) else v)
            for k, v in fields.items()
        }
        try:
            reward(samples[i : i + 1], None if prompts is None else list(prompts)[i : i + 1], **one)
        except Exception:  # noqa: BLE001  whatever the batch raised, a sample raising alone is the culprit
            return i
    return None
