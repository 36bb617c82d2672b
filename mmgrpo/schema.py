"""The run configuration's schema: nested dataclasses, YAML reading, `key.sub=value` overrides and type coercion.

No range or registry checks here (mmgrpo/validate.py does those); `mmgrpo.config.load_config` runs both.
"""

import ast
import dataclasses
import difflib
import inspect
import itertools
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from mmgrpo.errors import UserError


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """directory for checkpoints, metrics.jsonl, galleries and report.html"""
    seed: int = 0
    """seed for prompt sampling, rollouts and initialisation (rollouts are seeded per prompt, so any rank count
    gives the same global batch)"""
    steps: int = 100
    """number of training iterations (one rollout batch + its updates each)"""
    device: str = "auto"
    """"auto" (CUDA when present), "cpu" or "cuda"; under `accelerate launch` accelerate decides"""
    mixed_precision: str = "no"
    """"no", "bf16" or "fp16": autocast of the update's forward/backward; only when CUDA is present (CPU runs stay
    exact fp32)"""
    compile: bool | str = False
    """torch.compile the pipeline's trainable module in place (parameter names unchanged): true compiles on CUDA and
    is skipped with one logged line on the CPU (compiling there needs a C++ toolchain and warms up slowly), "force"
    compiles on any device, false never"""
    compile_kwargs: dict = field(default_factory=dict)
    """keyword arguments of torch.compile when run.compile is on, e.g. {mode: max-autotune, dynamic: true} or
    {backend: aot_eager} (no C++ toolchain needed)"""
    resume: str = "auto"
    """"auto" continues from the newest valid checkpoint in output_dir, "never" starts fresh, or a checkpoint path
    (a run refuses an output_dir that already holds another run: see run.overwrite)"""
    overwrite: bool = False
    """true: delete the earlier run in output_dir (its config.yaml, metrics.jsonl, report.html, gallery/ and
    checkpoints/) once this run has built its model, and start from step 0; false refuses such a directory"""
    checkpoint_every: int = 50
    """save a checkpoint every N steps (0: only at the end and on SIGTERM/SIGINT)"""
    keep_last: int = 2
    """how many of this run's newest checkpoints to keep (older ones of the same run are pruned, never another
    run's)"""
    log_every: int = 1
    """write metrics every N steps"""
    gallery_every: int = 0
    """save a sample gallery every N steps (0: only first and last step)"""
    trackers: list[str] = field(default_factory=list)
    """extra accelerate trackers: "tensorboard", "wandb" (metrics.jsonl is always written)"""
    max_bad_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps skipped for NaN/Inf rewards or losses"""
    progress: bool = True
    """show a tqdm progress bar with the live reward"""
    report: bool = True
    """write report.html (curves, before/after samples, config, timings) at the end"""
    plugins: list[str] = field(default_factory=list)
    """your own modules to import before validation, so the pipelines, rewards, advantage estimators and losses they
    register can be named in this recipe, e.g. [my_package.my_rewards] (importable from PYTHONPATH); installed
    packages can declare an entry point in the `mmgrpo.plugins` group instead"""


@dataclass
class PipelineConfig:
    name: str = "toy_count"
    """registered pipeline that builds the policy and its prompts (`mmgrpo list pipelines`)"""
    kwargs: dict = field(default_factory=dict)
    """the pipeline builder's keyword arguments (model id or path, data path, LoRA rank...)"""


@dataclass
class SampleConfig:
    batch_size: int = 64
    """samples per step over all ranks (prompts x group_size), like TRL's generation batch"""
    group_size: int = 8
    """G: samples per prompt that share a baseline"""
    sampler: str = "uniform"
    """prompt sampler: "uniform", "vade" (Thompson sampling on p(1-p)), "mmr1_vas" (variance-aware)"""
    sampler_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the prompt sampler"""
    filter_zero_std: bool = False
    """drop groups whose rewards are all equal (they carry no gradient), DAPO arXiv:2503.14476; under
    algo.advantage=ngrpo only the groups all at max_reward (an all-wrong group gets negative advantages there)"""
    refill: bool = False
    """with filter_zero_std: roll out more prompts until the batch is full again (DAPO dynamic sampling)"""
    max_refill_rounds: int = 4
    """extra rollout rounds allowed per step before refill gives up with a message"""
    allocator: str = "uniform"
    """rollouts per prompt: "uniform" (group_size each) or "knapsack" (Knapsack RL arXiv:2509.25849: sizes up to
    group_size by value and cost under a budget, padded to [B, group_size]; needs sampler vade)"""
    allocator_kwargs: dict = field(default_factory=dict)
    """its keyword arguments, e.g. {budget: 32, min_size: 2, info: paper, cost_field: null}"""


@dataclass
class PhaseConfig:
    steps: int = 1
    """consecutive training steps of this phase"""
    advantage: str = ""
    """advantage estimator during the phase ("" keeps algo.advantage); VerIPO's DPO phase: verifier_pairs"""
    advantage_kwargs: dict | None = None
    """its keyword arguments (null keeps algo.advantage_kwargs)"""
    loss: str = ""
    """policy loss during the phase ("" keeps algo.loss); VerIPO's DPO phase: dpo"""
    loss_kwargs: dict | None = None
    """its keyword arguments (null keeps algo.loss_kwargs)"""
    aggregation: str = ""
    """aggregation during the phase ("" keeps algo.aggregation)"""


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """advantage estimator (`mmgrpo list advantages`)"""
    advantage_kwargs: dict = field(default_factory=dict)
    """its keyword arguments, e.g. {std: group, eps: 1e-6}"""
    loss: str = "clipped"
    """policy loss (`mmgrpo list losses`)"""
    loss_kwargs: dict = field(default_factory=dict)
    """its keyword arguments, e.g. {clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0, level: token}"""
    aggregation: str = "token_mean"
    """how [N, K] losses become a scalar: token_mean, seq_mean_token_mean, seq_mean_token_sum,
    seq_mean_token_sum_norm"""
    norm_len: int | None = None
    """constant length for seq_mean_token_sum_norm (Dr. GRPO); default K of the rollout"""
    kl_coef: float = 0.0
    """weight of the KL penalty to the reference policy (0 disables it and the reference pass)"""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3"""
    kl_reward_coef: float = 0.0
    """KL in the reward (verl use_kl_in_reward): each sample's reward minus this times the sum over its tokens or
    denoising steps of the KL(rollout || reference) estimate, before the advantages; 0 disables it"""
    kl_reward_kind: str = "k1"
    """KL estimator of the reward penalty: k1 (verl's default "kl"), k2 or k3"""
    inner_epochs: int = 1
    """passes over each rollout batch (PPO epochs); >1 makes updates off-policy and clipping active"""
    num_minibatches: int = 1
    """optimizer steps per inner epoch; the batch is split into this many shuffled mini-batches"""
    micro_batch_size: int | str = 8
    """samples per forward/backward on each rank (gradient accumulation inside a mini-batch), or "auto": the
    largest that fits algo.memory_budget_gb, from one probe of 2 and 1 samples at the first update (logged once)"""
    memory_budget_gb: float | None = None
    """with micro_batch_size=auto (ignored otherwise): GB (1e9 bytes) one forward/backward may add on top of what
    is already allocated (weights, optimizer state, rollout); null: 80% of the free CUDA memory at the probe, or
    half the available RAM on the CPU"""
    phases: list[PhaseConfig] = field(default_factory=list)
    """a schedule cycled over the steps, each phase overriding the estimator, loss and aggregation for its steps
    (VerIPO arXiv:2505.19000: GRPO phases, then DPO phases on verifier pairs); empty: every step uses the above"""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this value (0 disables clipping)"""
    schedule: str = "constant"
    """learning-rate schedule after warm-up: constant, linear or cosine (decaying to 0 at run.steps)"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    ema_decay: float = 0.0
    """keep an exponential moving average of the trainable weights with this decay (0 disables it)"""


@dataclass
class RewardSpec:
    name: str = ""
    """registered reward (`mmgrpo rewards list`) or an http:// URL of a reward server"""
    weight: float = 1.0
    """weight in the summed reward (GDPO uses the per-reward scores and these weights)"""
    kwargs: dict = field(default_factory=dict)
    """the reward's keyword arguments (model path, mode...)"""
    label: str = ""
    """column name in metrics and tables (default: name); lets one reward appear twice with other kwargs"""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    """rewards to score samples with; empty means the pipeline's default"""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `no`/`off`/`yes` stay strings (mixed_precision: no), 1e-4 is a float
    and dates stay strings; PyYAML's YAML 1.1 defaults read `no` as False and `1e-4` as text. A key repeated in
    one mapping is refused: PyYAML would keep the last value silently (lr 3e-3, then lr 30 -> trains at 30)."""

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # unhashable: the base class reports it
                continue
            if first is not None:
                raise DuplicateKey(
                    None,
                    None,
                    f"duplicate key {key!r} on lines {first} and {line}; keep one of them",
                    key_node.start_mark,
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping names the same key twice."""


_REPLACED_TAGS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """Parse YAML as recipes and overrides mean it (1.2 scalars: see _Yaml12Loader)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # safe: _Yaml12Loader is a SafeLoader subclass


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string right after each field), read from its source; a subclass
    also has its dataclass bases' (in field order: the bases' first)."""
    docs = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float). Raise UserError otherwise."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # int | str: the first type that accepts the value (micro_batch_size: auto)
            try:
                return _coerce(value, option, where)
            except UserError:
                pass
        if len(inner) == 1:
            return _coerce(value, inner[0], where)
        try:
            return _coerce(value, inner[-1], where)
        except UserError:
            names = " or ".join(_type_name(a) for a in inner)
            raise UserError(
                f"{where}: expected {names}, got {value!r} ({type(value).__name__}); fix the value in "
                f"the YAML file or override it as {where}=<value>"
            ) from None
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}; write it as [a, b] in YAML")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{where}.{i}") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}; write it as {{key: value}} in YAML")
        return dict(value)
    if tp is Any:
        return value
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp, True)
    if not ok:
        raise UserError(
            f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"fix the value in the YAML file or override it as {where}=<{_type_name(tp)}>"
        )
    return float(value) if tp is float else value


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{where or 'config'}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = [n for n in names if n.lower() == str(key).lower()] or difflib.get_close_matches(
                str(key).lower(), names, n=1, cutoff=0.5
            )
            hint = f"did you mean {(where + '.' if where else '') + close[0]!r}? " if close else ""
            raise UserError(f"unknown config key {path!r}; {hint}valid keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        key: Any = part
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                fix = f"use an index in 0..{len(node) - 1} or set" if node else "it is empty, so set"
                raise UserError(
                    f"override {dotted!r}: {part!r} is not an index of {here} ({len(node)} item(s)); "
                    f"{fix} the whole list, e.g. {here}=[...]"
                )
            key = int(part)
        elif not isinstance(node, dict):
            raise UserError(
                f"override {dotted!r}: {here} is the value {node!r}, not a section with keys; "
                f"override it as {here}=<value>"
            )
        if i == len(parts) - 1:
            node[key] = value
            return
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = [] if parts[i + 1].isdigit() else {}
        node = node[key]


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key.sub=value` strings to (path, value); values are parsed as YAML (so 3 is int, [a, b] a list)."""
    out = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UserError(f"override {item!r} is not of the form key.sub=value, e.g. algo.kl_coef=0.01")
        key, raw = item.split("=", 1)
        try:
            value = yaml_load(raw) if raw != "" else ""
        except DuplicateKey as err:
            raise UserError(f"override {item!r}: {err.problem}") from None
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A UTF-8 text file's contents; an undecodable byte is a UserError naming the file, byte offset and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(
            f"{what} {str(path)!r} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} "
            f"(line {line}) cannot be decoded; re-save the file as UTF-8"
        ) from None
