"""Config validation: ranges, registry names and keyword arguments, checked before any model loads.

Every message follows one pattern: the field, the value seen, why it is wrong, and what to set instead.
"""

import dataclasses
import importlib.util
import inspect
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mmgrpo import advantages, budget, losses, phases, sampling
from mmgrpo.errors import UserError
from mmgrpo.plugins import PIPELINES, RESERVED_BUILD_KWARGS, load_plugins, pipeline_settings
from mmgrpo.reward import REWARDS, URL_PREFIXES
from mmgrpo.schema import Config, _coerce, read_text


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _check_name(registry, name: str, field: str) -> None:
    if name not in registry:
        same = [n for n in registry.names() if n.lower() == str(name).lower()]
        if same:  # difflib does not see GRPO as close to grpo
            raise UserError(
                f"{field}: unknown {registry.kind} {name!r} (did you mean {same[0]!r}?); names are case-sensitive"
            )
        raise UserError(f"{field}: {registry.unknown_message(name)}")


def _check_kwargs(registry, name: str, kwargs: dict, field: str, skip: tuple = ()) -> None:
    """Keywords the callable accepts (case-insensitive near misses suggested), of its annotated types, finite."""
    params = _params(registry, name)
    for key in kwargs:
        if key not in params:
            same = [p for p in params if p.lower() == str(key).lower() and p not in skip]
            if same:
                raise UserError(
                    f"{field}: {registry.kind} {name!r} takes no keyword {key!r} (did you mean "
                    f"{same[0]!r}?); keywords are case-sensitive"
                )
    try:
        registry.check_kwargs(name, kwargs, field=field, skip=skip, params=params)
    except ValueError as err:
        raise UserError(str(err)) from None
    for key, value in kwargs.items():
        where = f"{field}.{key}"
        _need(
            not (isinstance(value, float) and math.isnan(value)),
            f"{where} is nan; give a number, e.g. {where}={params[key].default if key in params else 1.0}",
        )
        param = params.get(key)
        if param is None or param.annotation is inspect.Parameter.empty:
            continue
        try:
            _coerce(value, param.annotation, where)
        except UserError as err:
            default = param.default if param.default is not inspect.Parameter.empty else None
            raise UserError(
                f"{err}".split("; fix the value")[0] + f"; {registry.kind} {name!r} takes "
                f"{key}: {_annotation(param.annotation)}, e.g. {where}={default!r}"
            ) from None
        if _path_like(key) and isinstance(value, str):
            _check_path_value(where, value)


def _params(registry, name: str) -> Mapping[str, inspect.Parameter]:
    """The keywords `name` takes: the fields of its typed settings (a pipeline registered with `settings=`, whose
    builder may take **kwargs), else its callable's signature."""
    return inspect.signature(registry.meta(name).get("settings") or registry.get(name)).parameters


def _annotation(tp) -> str:
    return getattr(tp, "__name__", None) if not getattr(tp, "__args__", None) else str(tp).replace("typing.", "")


_PATH_WORDS = ("data", "path", "file", "dir", "prompts", "model", "cache")


def _path_like(key: str) -> bool:
    return any(word in key.lower().split("_") for word in _PATH_WORDS)


def _key_is_dir(where: str) -> bool:
    return where.rsplit(".", 1)[-1].lower().endswith(("_dir", "_root")) or where.endswith(".dir")


_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".yaml", ".yml", ".csv", ".tsv")


def _check_path_value(where: str, value: str) -> None:
    """A path-like keyword: not empty; a text file (by its suffix) must be a file, UTF-8 and hold a line."""
    _need(
        value.strip() != "", f"{where} is an empty string; give a path or name, or remove the key to use the default"
    )
    p = Path(value)
    if _key_is_dir(where):
        _need(not p.is_file(), f"{where} ({value!r}) is a file, but a directory is expected; give a directory")
        return
    if p.suffix.lower() not in _TEXT_SUFFIXES:
        return
    _need(
        not p.is_dir(),
        f"{where} ({value!r}) is a directory, but a {p.suffix} file is expected; give the file inside it",
    )
    if p.is_file():
        text = read_text(p, where)
        _need(
            text.strip() != "",
            f"{where} ({value!r}) is empty; it needs at least one non-blank line (one prompt or record per line)",
        )


def _check_finite(obj, where: str = "") -> None:
    """Every float field of the config is a finite number (an inf lr trains to NaN weights without a word)."""
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, path + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_finite(item, f"{path}.{i}.")
                elif isinstance(item, float) and not math.isfinite(item):
                    raise UserError(f"{path}.{i} ({item}) must be a finite number")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{path} ({value}) must be a finite number, e.g. {path}={f.default!r}")


def _dry_run(cfg: Config) -> None:
    """Call the advantage estimator and the policy loss once on a tiny made-up batch, so a bad value in their
    kwargs (std=grp, clip_low=-0.1, dual_clip=0.5) stops here and not after the model has loaded."""
    a, g = cfg.algo, cfg.sample.group_size
    kw = dict(a.advantage_kwargs)
    fn = advantages.ADVANTAGES.get(a.advantage)
    if not _core(fn) or not _core(losses.POLICY_LOSSES.get(a.loss)):
        return  # a pipeline's own estimator or loss may need inputs only its rollouts give (flow's NFT velocities)
    if "progress" in inspect.signature(fn).parameters:
        kw["progress"] = 0.0
    kind = advantages.ADVANTAGES.meta(a.advantage).get("input", "scalar")
    rewards = torch.linspace(0.0, 1.0, g, dtype=torch.float64).view(1, g)  # [1, G]
    if kind == "multi":
        n = max(1, len(cfg.rewards))
        rewards = rewards[..., None].repeat(1, 1, n)  # [1, G, R]
        kw.setdefault("weights", [1.0] * n)
    elif kind == "pairwise":
        rewards = torch.full((1, g, g), 0.5)  # [1, G, G]
    _try(lambda: advantages.compute(a.advantage, rewards, **kw), "algo.advantage_kwargs", a.advantage_kwargs)
    logp = torch.zeros(g, 2)  # [G, K]
    lkw = dict(a.loss_kwargs)
    if losses.needs_groups(a.loss):
        lkw["group_size"] = g
    _try(
        lambda: losses.compute(a.loss, logp, logp, torch.zeros(g), torch.ones(g, 2, dtype=torch.bool), **lkw),
        "algo.loss_kwargs",
        a.loss_kwargs,
    )


def _core(fn) -> bool:
    return getattr(fn, "__module__", "").startswith("mmgrpo.")


def _try(call, field: str, given: dict) -> None:
    try:
        call()
    except UserError:
        raise
    except ValueError as err:
        raise UserError(f"{field} ({given}): {' '.join(str(err).split())}") from None
    except Exception:  # noqa: BLE001  the made-up batch may not fit every estimator's input; training will tell
        return


def _validate_run(cfg: Config) -> None:
    run = cfg.run
    _need(
        run.output_dir.strip() != "",
        "run.output_dir is empty (it would train into the current directory); set it, e.g. run.output_dir=runs/my_run",
    )
    _need(
        0 <= run.seed < 2**32,
        f"run.seed ({run.seed}) must be in [0, 2**32 - 1] (numpy and torch seeds), e.g. run.seed=0",
    )
    _need(run.resume.strip() != "", "run.resume is empty; use auto, never or a checkpoint directory")
    _need(run.steps >= 1, f"run.steps ({run.steps}) must be >= 1: it is the number of training iterations")
    _need(run.device in ("auto", "cpu", "cuda"), f"run.device ({run.device!r}) must be auto, cpu or cuda")
    _need(
        run.mixed_precision in ("no", "bf16", "fp16"),
        f"run.mixed_precision ({run.mixed_precision!r}) must be no, bf16 or fp16",
    )
    _need(
        run.checkpoint_every >= 0, f"run.checkpoint_every ({run.checkpoint_every}) must be >= 0 (0: only at the end)"
    )
    _need(run.keep_last >= 1, f"run.keep_last ({run.keep_last}) must be >= 1 so a resume point always exists")
    _need(run.log_every >= 1, f"run.log_every ({run.log_every}) must be >= 1")
    _need(run.gallery_every >= 0, f"run.gallery_every ({run.gallery_every}) must be >= 0 (0: first and last step)")
    _need(run.max_bad_steps >= 1, f"run.max_bad_steps ({run.max_bad_steps}) must be >= 1")
    _need(
        run.compile in (True, False, "force"),
        f"run.compile ({run.compile!r}) must be true (CUDA only), force (any device) or false",
    )
    bad = sorted(set(run.compile_kwargs) - {"fullgraph", "dynamic", "backend", "mode", "options", "disable"})
    _need(
        not bad,
        f"run.compile_kwargs: unknown keyword(s) {bad}; torch.compile takes fullgraph, dynamic, backend, "
        f"mode, options and disable",
    )
    for t in run.trackers:
        _need(t in ("tensorboard", "wandb"), f"run.trackers: unknown tracker {t!r}; choose from tensorboard, wandb")
        module = "torch.utils.tensorboard" if t == "tensorboard" else "wandb"
        _need(
            importlib.util.find_spec(module.split(".")[0]) is not None and _importable(module),
            f"run.trackers: {t!r} is not installed; `pip install {t}` or remove it from run.trackers "
            f"(metrics.jsonl is always written)",
        )
    if run.resume not in ("auto", "never"):
        _need(
            Path(run.resume).is_dir(),
            f"run.resume ({run.resume!r}) is neither auto, never nor an existing "
            f"checkpoint directory; pass one of those",
        )
        inside = Path(run.output_dir).resolve() in Path(run.resume).resolve().parents
        _need(
            not (run.overwrite and inside),
            f"run.overwrite=true would delete run.resume ({run.resume!r}), which "
            f"is inside run.output_dir; resume with run.overwrite=false",
        )
    _check_output_dir(run.output_dir)


def _check_output_dir(path: str) -> None:
    p = Path(path)
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"run.output_dir ({path!r}): {str(probe)!r} is a file, not a directory; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"run.output_dir ({path!r}) is not writable ({str(probe)!r} denies writing); "
            f"choose a directory you can write to, e.g. run.output_dir=runs/my_run"
        )


def _validate_sample(cfg: Config) -> None:
    s = cfg.sample
    _need(
        s.group_size >= 1,
        f"sample.group_size ({s.group_size}) must be >= 1: it is the number of samples per "
        f"prompt; GRPO needs at least 2",
    )
    _need(s.batch_size >= 1, f"sample.batch_size ({s.batch_size}) must be >= 1 samples per step")
    if s.batch_size % s.group_size:
        lo = max(s.group_size, s.batch_size // s.group_size * s.group_size)
        raise UserError(
            f"sample.batch_size ({s.batch_size}) must be divisible by sample.group_size "
            f"({s.group_size}): each prompt needs a full group. Use batch_size={lo} or "
            f"{lo + s.group_size}, or change group_size"
        )
    _need(s.max_refill_rounds >= 0, f"sample.max_refill_rounds ({s.max_refill_rounds}) must be >= 0")
    _need(
        not s.refill or s.filter_zero_std,
        "sample.refill=true needs sample.filter_zero_std=true: refilling replaces the groups the filter drops",
    )
    _check_name(sampling.SAMPLERS, s.sampler, "sample.sampler")
    _check_kwargs(
        sampling.SAMPLERS, s.sampler, s.sampler_kwargs, "sample.sampler_kwargs", skip=("num_prompts", "seed")
    )
    budget.check(cfg, sampling.SAMPLERS.get(s.sampler))  # rollouts per prompt (Knapsack RL), before the model


def _validate_algo(cfg: Config) -> None:
    a, s = cfg.algo, cfg.sample
    _check_name(advantages.ADVANTAGES, a.advantage, "algo.advantage")
    _check_kwargs(
        advantages.ADVANTAGES, a.advantage, a.advantage_kwargs, "algo.advantage_kwargs", skip=("rewards", "progress")
    )
    if (
        s.group_size == 1
        and a.advantage_kwargs.get("std", "group") == "group"
        and a.advantage_kwargs.get("singleton", "zero") == "zero"
    ):
        raise UserError(
            f"sample.group_size=1 with algo.advantage={a.advantage!r} normalises each sample against "
            f"itself, so every advantage is 0 and nothing learns; use sample.group_size>=2"
        )
    _check_name(losses.POLICY_LOSSES, a.loss, "algo.loss")
    _check_kwargs(
        losses.POLICY_LOSSES,
        a.loss,
        a.loss_kwargs,
        "algo.loss_kwargs",
        skip=("logp", "old_logp", "adv", "mask", "group_size"),
    )
    _dry_run(cfg)
    _validate_micro_batch(a)
    if losses.needs_groups(a.loss) and a.micro_batch_size != "auto":
        _need(
            a.micro_batch_size % s.group_size == 0,
            f"algo.micro_batch_size ({a.micro_batch_size}) must be a multiple of sample.group_size "
            f"({s.group_size}) for algo.loss={a.loss!r}, which normalises within whole groups",
        )
    _check_name(losses.AGGREGATIONS, a.aggregation, "algo.aggregation")
    _check_name(losses.KL, a.kl_kind, "algo.kl_kind")
    _need(a.norm_len is None or a.norm_len >= 1, f"algo.norm_len ({a.norm_len}) must be >= 1 or null")
    _need(a.kl_coef >= 0, f"algo.kl_coef ({a.kl_coef}) must be >= 0 (0 disables the KL penalty)")
    _check_name(losses.KL, a.kl_reward_kind, "algo.kl_reward_kind")
    _need(
        a.kl_reward_coef >= 0, f"algo.kl_reward_coef ({a.kl_reward_coef}) must be >= 0 (0 disables KL in the reward)"
    )
    _need(
        a.kl_reward_coef == 0 or advantages.ADVANTAGES.meta(a.advantage).get("input", "scalar") != "multi",
        f"algo.kl_reward_coef ({a.kl_reward_coef}) penalises the total reward, which algo.advantage "
        f"({a.advantage!r}) does not read (it takes the per-reward columns); set algo.kl_reward_coef=0 or use "
        f"algo.kl_coef (KL in the loss)",
    )
    _need(a.inner_epochs >= 1, f"algo.inner_epochs ({a.inner_epochs}) must be >= 1")
    _need(
        1 <= a.num_minibatches <= s.batch_size,
        f"algo.num_minibatches ({a.num_minibatches}) must be between 1 and sample.batch_size ({s.batch_size})",
    )
    phases.check(cfg, _validate_algo)  # the loss's aggregation, then each phase as algo with its overrides


def _validate_micro_batch(a) -> None:
    mbs, budget = a.micro_batch_size, a.memory_budget_gb
    if isinstance(mbs, str):
        _need(
            mbs == "auto",
            f"algo.micro_batch_size ({mbs!r}) must be a whole number of samples >= 1 or auto "
            f"(the largest that fits algo.memory_budget_gb)",
        )
    else:
        _need(mbs >= 1, f"algo.micro_batch_size ({mbs}) must be >= 1 samples (or auto)")
    _need(
        budget is None or budget > 0,
        f"algo.memory_budget_gb ({budget}) must be > 0 GB, e.g. 20, or null "
        f"(80% of the free CUDA memory, half the available RAM on the CPU)",
    )


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    _need(o.lr > 0, f"optim.lr ({o.lr}) must be > 0, e.g. optim.lr=1e-4")
    _need(o.weight_decay >= 0, f"optim.weight_decay ({o.weight_decay}) must be >= 0")
    _need(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"optim.betas ({o.betas}) must be two numbers in [0, 1), e.g. [0.9, 0.999]",
    )
    _need(o.grad_clip >= 0, f"optim.grad_clip ({o.grad_clip}) must be >= 0 (0 disables clipping)")
    _need(
        o.schedule in ("constant", "linear", "cosine"),
        f"optim.schedule ({o.schedule!r}) must be constant, linear or cosine",
    )
    _need(o.warmup_steps >= 0, f"optim.warmup_steps ({o.warmup_steps}) must be >= 0")
    _need(0 <= o.ema_decay < 1, f"optim.ema_decay ({o.ema_decay}) must be in [0, 1) (0 disables the EMA)")


def _validate_components(cfg: Config) -> None:
    load_plugins(cfg.run.plugins)
    _check_name(PIPELINES, cfg.pipeline.name, "pipeline.name")
    _check_kwargs(PIPELINES, cfg.pipeline.name, cfg.pipeline.kwargs, "pipeline.kwargs", skip=RESERVED_BUILD_KWARGS)
    given = {k: v for k, v in cfg.pipeline.kwargs.items() if k not in RESERVED_BUILD_KWARGS}
    meta = PIPELINES.meta(cfg.pipeline.name)
    settings, check = meta.get("settings"), meta.get("check")  # typed pipeline.kwargs; a pipeline's own checks
    if settings is not None:
        typed = pipeline_settings(settings, given)
        if hasattr(typed, "check_algo"):  # the fields against algo, then each phase's algo: loss, KL, objective
            typed.check_algo(cfg.algo)
            phases.check(cfg, lambda c: typed.check_algo(c.algo))
    if check is not None:
        try:
            check(**given)
        except UserError:
            raise
        except ValueError as err:
            msg = " ".join(str(err).split())
            raise UserError(msg if msg.startswith("pipeline.kwargs") else f"pipeline.kwargs: {msg}") from None
    for i, spec in enumerate(cfg.rewards):  # the plugins loaded above registered every installed reward
        if spec.name.startswith(URL_PREFIXES):
            continue
        _check_name(REWARDS, spec.name, f"rewards.{i}.name")
        _check_kwargs(REWARDS, spec.name, spec.kwargs, f"rewards.{i}.kwargs")


def validate(cfg: Config) -> None:
    """Raise UserError on the first invalid field; cheap (no model is loaded)."""
    load_plugins(cfg.run.plugins)  # first: plugins register estimators and losses (video's "tempsamp") algo.* names
    _check_finite(cfg)
    _validate_run(cfg)
    _validate_sample(cfg)
    _validate_algo(cfg)
    _validate_optim(cfg)
    _validate_components(cfg)
