"""The "flow" pipeline builder: load a diffusers text-to-image/video pipeline, add LoRA, read prompts, make the Task.

Light to import: diffusers and peft are imported inside `build_flow`, so `mmgrpo list pipelines` stays fast.
"""

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.types import Task

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

ATTENTION = ("sdpa", "xformers")
"""Attention kernels of the flow transformer and VAE: diffusers' default torch SDPA (flash / memory-efficient
kernels picked by torch on CUDA, the math kernel on the CPU), or xformers' memory-efficient attention (CUDA)."""


def shapes_prompts(spec: str) -> list[dict[str, Any]]:
    """ShapesWorld prompts "shapes:<split>[:<category>,...]" as records with their GenEval-style category."""
    from pipelines.shapes.scenes import CATEGORIES, SPLITS, list_prompts

    parts = spec.split(":")
    split = parts[1] if len(parts) > 1 else "train"
    cats = parts[2].split(",") if len(parts) > 2 and parts[2] else list(CATEGORIES)
    bad = [c for c in cats if c not in CATEGORIES]
    if split not in SPLITS or bad:
        raise UserError(f"pipeline.kwargs.data ({spec!r}): use shapes:<split>[:<category>,...] with split in "
                        f"{', '.join(SPLITS)} and categories from {', '.join(CATEGORIES)}")
    return [{"prompt": p, "category": c} for c in cats for p in list_prompts(split, c)]


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Prompt records from a .txt file (one prompt per line), .jsonl ({"prompt": ..., ground-truth fields}) or
    ShapesWorld ("shapes:train", "shapes:test:position,counting")."""
    if path.startswith("shapes:"):
        return shapes_prompts(path)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"pipeline.kwargs.data ({path!r}) is not a file; pass a .txt (one prompt per line) or a "
                        f".jsonl file with a \"prompt\" field per line")
    lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    if p.suffix != ".jsonl":
        return [{"prompt": ln.strip()} for ln in lines]
    out = []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{i + 1} is not valid JSON ({err.msg}); write one JSON object per line") from None
        if not isinstance(rec, dict) or "prompt" not in rec:
            raise UserError(f"{path}:{i + 1} has no \"prompt\" field; each line must be {{\"prompt\": ..., ...}}")
        out.append(rec)
    return out


def _records(data: str | None, prompts: list | None, what: str) -> list[dict[str, Any]]:
    if data is not None and prompts is not None:
        raise UserError(f"pipeline.kwargs: give {what} either as a file (data) or a list (prompts), not both")
    if data is not None:
        return read_prompts(data)
    return [p if isinstance(p, dict) else {"prompt": str(p)} for p in (prompts or [])]


def load_pipeline(model: str, torch_dtype: torch.dtype):
    """`DiffusionPipeline.from_pretrained(model)` with a one-line UserError when it is not there."""
    from diffusers import DiffusionPipeline

    if not model:
        raise UserError("pipeline.kwargs.model is empty; pass a hub id (e.g. stabilityai/stable-diffusion-3.5-medium), "
                        "a local directory saved with save_pretrained, or tiny:sd3 / tiny:flux / tiny:wan")
    if model.startswith("tiny:"):  # a tiny random pipeline built on the spot, for CPU recipes and tests
        from pipelines.flow.tiny import save_tiny

        cache = Path(os.environ.get("MMGRPO_CACHE", Path.home() / ".cache" / "mmgrpo")) / f"tiny-{model[5:]}"
        if not (cache / "model_index.json").is_file():
            tmp = save_tiny(model[5:], cache.with_name(f"{cache.name}.tmp{os.getpid()}"))
            try:
                os.rename(tmp, cache)  # atomic: concurrent builders never see a half-written directory
            except OSError:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        model = str(cache)
    from pipelines.flow.shapes_model import ShapesT2IPipeline, is_shapes_dir

    if is_shapes_dir(model):  # ShapesWorld's pixel-space model: no VAE, components loaded one by one
        return ShapesT2IPipeline.from_pretrained(model, dtype=torch_dtype)
    looks_local = model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1]
    if looks_local and not Path(model).expanduser().is_dir():
        raise UserError(f"pipeline.kwargs.model ({model!r}) is not a directory; pass an existing local pipeline "
                        f"directory or a hub id such as stabilityai/stable-diffusion-3.5-medium")
    try:
        return DiffusionPipeline.from_pretrained(str(Path(model).expanduser()) if looks_local else model,
                                                 dtype=torch_dtype)
    except (OSError, ValueError) as err:
        offline = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise UserError(f"pipeline.kwargs.model ({model!r}) could not be loaded{offline}: {first}; download it "
                        f"first (huggingface-cli download {model}) or pass a local directory, "
                        f"e.g. pipeline.kwargs.model=/path/to/model") from None


def _add_lora(transformer, model_type: str, rank: int, alpha: float | None, targets: list[str] | None) -> None:
    from peft import LoraConfig

    from pipelines.flow.models import LORA_TARGETS

    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, init_lora_weights="gaussian",
                     target_modules=list(targets or LORA_TARGETS[model_type]))
    try:
        transformer.add_adapter(cfg)
    except ValueError as err:
        raise UserError(f"pipeline.kwargs.lora_targets ({cfg.target_modules}) match no layer of this transformer "
                        f"({err}); name modules such as to_q, to_k, to_v, to_out.0") from None
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable adapter weights stay fp32 under bf16 base weights


STEP_WEIGHTS = ("none", "guard", "guard_normalized", "noise_aware", "grad_equalizer")


def _check_guard(objective: str, ratio_norm: bool, step_weights: str) -> None:
    """ratio_norm / step_weights feed the guard_clipped loss (GRPO-Guard, TempFlow-GRPO): SDE objective only."""
    if step_weights not in STEP_WEIGHTS:
        raise UserError(f"pipeline.kwargs.step_weights ({step_weights!r}) must be one of {', '.join(STEP_WEIGHTS)}; "
                        f"guard = GRPO-Guard's 1/|dt|, noise_aware = TempFlow-GRPO's std_t / mean std, "
                        f"grad_equalizer = SAGE-GRPO's equal gradient norm per step")
    if objective == "nft" and (ratio_norm or step_weights != "none"):
        raise UserError(f"pipeline.kwargs: ratio_norm ({ratio_norm}) and step_weights ({step_weights!r}) need "
                        f"objective grpo with algo.loss guard_clipped; DiffusionNFT has no ratio, unset them")


def _check_plan(plan: str, plan_kwargs: dict, objective: str) -> None:
    """Plan name and keywords before any model loads (e.g. granularities on a tree plan fail here)."""
    from pipelines.flow import plan as plans

    if plan not in plans.SCHEDULES:
        raise UserError(f"pipeline.kwargs.plan: {plans.SCHEDULES.unknown_message(plan)}")
    try:
        plans.SCHEDULES.check_kwargs(plan, plan_kwargs, field="pipeline.kwargs.plan_kwargs",
                                     skip=("num_steps", "group_size", "sde", "iteration", "same_noise", "seeds"))
    except ValueError as err:
        raise UserError(str(err)) from None
    credit = plan_kwargs.get("edge_credit", "once")
    if credit not in plans.EDGE_CREDIT:
        raise UserError(f"pipeline.kwargs.plan_kwargs.edge_credit ({credit!r}) must be once (each shared tree edge "
                        f"trained once, BranchGRPO) or per_leaf (once per leaf below it)")
    grans = plan_kwargs.get("granularities")
    if objective == "nft" and isinstance(grans, list | tuple) and len(grans) > 1:
        raise UserError(f"pipeline.kwargs.plan_kwargs.granularities ({grans}) credit a singular SDE step with its "
                        f"completions' rewards; objective nft trains no SDE step, drop granularities or use grpo")


def _dry_run_plan(plan: str, plan_kwargs: dict, *, num_steps: int, sde: str, same_noise: bool) -> None:
    """Build the plan once for a group size its own kwargs imply, so bad values (window past num_steps, split steps
    out of range, an unknown width_prune...) fail before the model loads; the real group size is checked at rollout."""
    from pipelines.flow import plan as plans

    kw = dict(plan_kwargs)
    if plan == "tree":  # group = roots * fanout^splits; without split_steps the group size decides them: one split
        splits = len(kw["split_steps"]) if isinstance(kw.get("split_steps"), list | tuple) else 1
        group = int(kw.get("roots", 1)) * int(kw.get("fanout", 2)) ** splits
    elif plan == "singular" and isinstance(kw.get("granularities"), list | tuple):
        group = max(1, len(kw["granularities"]))
    else:
        group = 1
    try:
        built, _ = plans.make_plan(plan, num_steps=num_steps, group_size=group, sde=sde, iteration=0,
                                   same_noise=same_noise, seeds=[0], **kw)
        built.check()  # branch points inside the schedule, SDE where a group splits
    except (ValueError, TypeError) as err:
        raise UserError(f"pipeline.kwargs.plan_kwargs ({plan_kwargs}) for plan {plan!r} with num_steps={num_steps}: "
                        f"{' '.join(str(err).split())}") from None


def _check_ddim(sde: str, model_type: str | None, objective: str, step_weights: str) -> None:
    """sde ddim steps on alpha_bar, not a flow sigma: no flow-only objective or sigma-based step weights with it."""
    from pipelines.flow.models import EPS_TYPES

    if model_type is not None and (sde == "ddim") != (model_type in EPS_TYPES):
        raise UserError(f"pipeline.kwargs.sde ({sde!r}) does not fit model_type {model_type!r}: epsilon-prediction "
                        f"UNets ({', '.join(EPS_TYPES)}) take sde ddim, flow models flow_grpo, dance or cps")
    if sde == "ddim" and (objective != "grpo" or step_weights not in ("none", "noise_aware", "grad_equalizer")):
        raise UserError(f"pipeline.kwargs: sde ddim trains with objective grpo and step_weights none or noise_aware, "
                        f"got objective {objective!r}, step_weights {step_weights!r} (DiffusionNFT and GRPO-Guard's "
                        f"1/|dt| assume a flow-matching sigma)")


def _check_value_anchor(value_anchor, plan_kwargs: dict, objective: str) -> None:
    """VGPO's per-step credit (pipelines/flow/vgpo.py): keys of value_anchored, an SDE objective, no granularities."""
    if value_anchor is None:
        return
    from mmgrpo.advantages.anchored import _check_anchor
    from pipelines.flow.vgpo import ANCHOR_KEYS

    bad = sorted(set(value_anchor) - set(ANCHOR_KEYS)) if isinstance(value_anchor, dict) else None
    if bad is None or bad:
        raise UserError(f"pipeline.kwargs.value_anchor ({value_anchor!r}) must be a mapping with keys from "
                        f"{', '.join(ANCHOR_KEYS)}, e.g. {{anchor: 0.5, scale: 0.1}}; unknown: {bad}")
    try:
        _check_anchor(**{"anchor": 0.0, "scale": 0.1, "alpha": None, **value_anchor})
    except (TypeError, ValueError) as err:
        raise UserError(f"pipeline.kwargs.value_anchor ({value_anchor}): {err}") from None
    grans = plan_kwargs.get("granularities")
    if objective != "grpo" or (isinstance(grans, list | tuple) and len(grans) > 1):
        raise UserError(f"pipeline.kwargs.value_anchor (VGPO per-step credit) needs objective grpo and no "
                        f"plan_kwargs.granularities (got objective {objective!r}, granularities {grans}); unset one")


def _check_trust(anchor_every, trust_step, reference, objective: str) -> None:
    """SAGE-GRPO's dual trust region (trust.py) moves or adds to the KL reference: it needs one and an SDE objective."""
    ok = isinstance(anchor_every, int) and not isinstance(anchor_every, bool) and anchor_every >= 0 and \
        isinstance(trust_step, int | float) and not isinstance(trust_step, bool) and trust_step >= 0
    if not ok:
        raise UserError(f"pipeline.kwargs: anchor_every ({anchor_every!r}) must be an integer >= 0 (0 = a fixed "
                        f"reference) and trust_step ({trust_step!r}) a number >= 0 (0 = no per-update KL)")
    if (anchor_every or trust_step) and (reference is False or objective != "grpo"):
        raise UserError(f"pipeline.kwargs: anchor_every ({anchor_every}) / trust_step ({trust_step}) shape the KL to "
                        f"the reference, which needs reference: true and objective grpo (got reference {reference}, "
                        f"objective {objective!r}); set them to 0 or turn the reference on, with algo.kl_coef > 0")


def _model_type(pipe, model_type: str | None, sde: str) -> str:
    """The checked model type of a loaded pipeline: model_type if given (it must match the class), else detected."""
    from pipelines.flow.models import MODEL_TYPES, model_type_of

    detected = model_type_of(type(pipe).__name__)
    model_type = model_type or detected
    if model_type not in MODEL_TYPES or (detected and detected != model_type):
        raise UserError(f"pipeline.kwargs.model_type ({model_type!r}) must be one of {MODEL_TYPES} and match the "
                        f"loaded {type(pipe).__name__} ({detected!r}); leave model_type unset to detect it")
    _check_ddim(sde, model_type, "grpo", "none")
    return model_type


def adapter_for(model_type: str):
    """The FlowModel class of a model type: models.py (SD3, FLUX, Wan), shapes_model.py (the pixel-space ShapesWorld
    model) or unet.py (epsilon-prediction SD 1.x / SDXL)."""
    from pipelines.flow.models import ADAPTERS, EPS_TYPES

    if model_type == "shapes":
        from pipelines.flow.shapes_model import ShapesModel

        return ShapesModel
    if model_type in EPS_TYPES:
        from pipelines.flow.unet import ADAPTERS as UNET_ADAPTERS

        return UNET_ADAPTERS[model_type]
    return ADAPTERS[model_type]


def _reward_inputs(reward_inputs: list[str] | str | None) -> list[str] | None:
    """The reward input kinds as a checked list (a single kind may be given as a string)."""
    from rewards.api import INPUTS

    if reward_inputs is None:
        return None
    kinds = [reward_inputs] if isinstance(reward_inputs, str) else list(reward_inputs)
    if not kinds or any(k not in INPUTS for k in kinds) or ("latent" in kinds and len(set(kinds)) > 1):
        raise UserError(f"pipeline.kwargs.reward_inputs ({reward_inputs!r}) must list kinds from {', '.join(INPUTS)}, "
                        f"either only latent (rollouts skip the VAE) or only pixel kinds; e.g. [latent] or [image]")
    return kinds


def check_flow_kwargs(**given) -> None:
    """The checks `build_flow` makes before loading anything; the engine's validation (`mmgrpo config`, `train`)
    runs them too, with build_flow's defaults filled in, so a bad plan or step kind fails before any model loads."""
    from pipelines.flow import sde as sde_mod

    defaults = {n: p.default for n, p in inspect.signature(build_flow).parameters.items()
                if p.default is not inspect.Parameter.empty}
    kw = {**defaults, **given}
    sde, plan, plan_kwargs, objective = kw["sde"], kw["plan"], kw["plan_kwargs"], kw["objective"]
    num_steps, lora_rank, k_chunk, nft_steps = kw["num_steps"], kw["lora_rank"], kw["k_chunk"], kw["nft_steps"]
    ratio_norm, step_weights, torch_dtype = kw["ratio_norm"], kw["step_weights"], kw["torch_dtype"]
    same_noise_per_group, attention = kw["same_noise_per_group"], kw["attention"]
    if sde not in sde_mod.STEPS or sde == "ode":
        raise UserError(f"pipeline.kwargs.sde ({sde!r}) must be a stochastic step: flow_grpo, dance or cps (flow "
                        f"models), ddim (epsilon-prediction UNets: SD 1.x, SDXL)")
    _check_ddim(sde, kw["model_type"], objective, step_weights)
    _check_value_anchor(kw["value_anchor"], plan_kwargs or {}, objective)
    _check_trust(kw["anchor_every"], kw["trust_step"], kw["reference"], objective)
    _check_plan(plan, plan_kwargs or {}, objective)
    if num_steps < 1 or lora_rank < 0 or (k_chunk is not None and k_chunk < 1):
        raise UserError(f"pipeline.kwargs: num_steps ({num_steps}) must be >= 1, lora_rank ({lora_rank}) >= 0 "
                        f"(0 = full fine-tuning) and k_chunk ({k_chunk}) null or >= 1")
    _dry_run_plan(plan, plan_kwargs or {}, num_steps=num_steps, sde=sde, same_noise=same_noise_per_group)
    if objective not in ("grpo", "nft") or not 1 <= nft_steps <= num_steps:
        raise UserError(f"pipeline.kwargs: objective ({objective!r}) must be grpo (SDE log-prob ratios, algo.loss "
                        f"clipped) or nft (DiffusionNFT, algo.loss nft), and nft_steps ({nft_steps}) in 1..num_steps "
                        f"({num_steps})")
    _check_guard(objective, ratio_norm, step_weights)
    if torch_dtype is not None and torch_dtype not in _DTYPES:
        raise UserError(f"pipeline.kwargs.torch_dtype ({torch_dtype!r}) must be one of {sorted(_DTYPES)} or null")
    if attention not in ATTENTION:
        raise UserError(f"pipeline.kwargs.attention ({attention!r}) must be one of {', '.join(ATTENTION)}")
    if not isinstance(kw["prompt_cache_items"], int) or kw["prompt_cache_items"] < 0:
        raise UserError(f"pipeline.kwargs.prompt_cache_items ({kw['prompt_cache_items']!r}) must be an integer >= 0 "
                        f"(prompts whose text-encoder outputs are kept; 0 re-encodes every batch)")


def check_attention(attention: str, device: torch.device) -> None:
    """xformers needs CUDA and the package (the `cuda` extra); say so in one line before any weight loads."""
    if attention != "xformers":
        return
    import importlib.util

    if torch.device(device).type != "cuda" or importlib.util.find_spec("xformers") is None:
        why = "no CUDA device" if torch.device(device).type != "cuda" else "the xformers package is not installed"
        raise UserError(f"pipeline.kwargs.attention=xformers needs CUDA and xformers ({why}); install the cuda extra "
                        f"(pip install -e \".[cuda]\") on a CUDA machine, or use attention=sdpa")


def build_flow(*, seed: int, device: torch.device, dtype: torch.dtype = torch.float32, model: str = "",
               model_type: str | None = None, data: str | None = None, prompts: list | None = None,
               eval_data: str | None = None, eval_prompts: list | None = None, resolution: int | list[int] = 512,
               num_frames: int = 33, num_steps: int = 10, sde: str = "flow_grpo", noise_level: float = 0.7,
               reduce: str = "mean", guidance_scale: float = 4.5, negative_prompt: str = "",
               max_sequence_length: int | None = None, same_noise_per_group: bool = False,
               plan: str = "independent", plan_kwargs: dict | None = None, lora_rank: int = 32,
               lora_alpha: float | None = None, lora_targets: list[str] | None = None, reference: bool = True,
               k_chunk: int | None = None, torch_dtype: str | None = None, gradient_checkpointing: bool = False,
               decode_batch_size: int = 8, objective: str = "grpo", nft_steps: int = 2, ratio_norm: bool = False,
               step_weights: str = "none", reward_inputs: list[str] | str | None = None,
               attention: str = "sdpa", prompt_cache_items: int = 256, value_anchor: dict | None = None,
               anchor_every: int = 0, trust_step: float = 0.0) -> Task:
    """GRPO on a diffusers flow model (SD3/SD3.5, FLUX.1, Wan 2.1) or epsilon UNet (SD 1.x, SDXL; sde ddim).

    reward_inputs: the input kinds of the configured rewards (rewards.api INPUTS); ["latent"] skips the VAE in
    rollouts (samples are the final latents). None decodes to pixels unless the engine reports the rewards' inputs
    through policy.set_reward_inputs. attention: "sdpa" (diffusers' default) or "xformers" (CUDA, the cuda extra)."""
    check_flow_kwargs(**{k: v for k, v in locals().items() if k not in ("seed", "device", "dtype")})  # all kwargs
    from pipelines.flow.models import denoiser_of, num_params
    from pipelines.flow.policy import FlowPolicy

    check_attention(attention, device)
    reward_inputs = _reward_inputs(reward_inputs)
    train = _records(data, prompts, "training prompts")
    if not train:
        raise UserError("pipeline.kwargs needs prompts: data: prompts.txt|.jsonl or prompts: [\"a cat\", ...]")
    weights_dtype = _DTYPES[torch_dtype] if torch_dtype else dtype
    pipe = load_pipeline(model, weights_dtype)
    model_type = _model_type(pipe, model_type, sde)
    pipe.to(device)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        part = getattr(pipe, name, None)
        if part is not None:
            part.requires_grad_(False).eval()
    transformer = denoiser_of(pipe).requires_grad_(False)
    if lora_rank > 0:
        _add_lora(transformer, model_type, lora_rank, lora_alpha, lora_targets)
    else:
        transformer.requires_grad_(True)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if attention == "xformers":
        pipe.enable_xformers_memory_efficient_attention()  # transformer (LoRA included) and VAE
    h, w = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    adapter = adapter_for(model_type)(pipe, height=h, width=w, num_frames=num_frames, guidance_scale=guidance_scale,
                                   negative_prompt=negative_prompt, max_sequence_length=max_sequence_length,
                                   device=device, dtype=weights_dtype, prompt_cache_items=prompt_cache_items)
    adapter.latent_shape()  # resolution / frame-count errors before any rollout
    policy = FlowPolicy(pipe, adapter, num_steps=num_steps, sde_kind=sde, noise_level=noise_level, reduce=reduce,
                        plan=plan, plan_kwargs=plan_kwargs or {}, same_noise=same_noise_per_group,
                        lora=lora_rank > 0, reference=reference, k_chunk=k_chunk, seed=seed,
                        decode_batch_size=decode_batch_size, objective=objective, nft_steps=nft_steps,
                        ratio_norm=ratio_norm, step_weights=step_weights, reward_inputs=reward_inputs,
                        value_anchor=value_anchor, anchor_every=anchor_every, trust_step=trust_step)
    policy.num_params = {"transformer": num_params(transformer), "trainable": num_params(transformer, True)}
    return Task(policy=policy, module=transformer, train_data=train,
                eval_data=_records(eval_data, eval_prompts, "evaluation prompts"))
