"""The flow pipeline's typed settings (`pipeline.kwargs` of `flow`) and their checks: the step kind, the rollout plan,
the objective and GRPO-Guard / VGPO / SAGE-GRPO switches, checked before any model loads (also against algo.loss).
No model code here: diffusers loads only in build.py.
"""

import inspect
from dataclasses import dataclass
from typing import Any

from mmgrpo import losses
from mmgrpo.advantages.anchored import _check_anchor
from mmgrpo.errors import UserError
from pipelines.flow import plan as plans
from pipelines.flow import sde as sde_mod
from pipelines.flow.models import EPS_TYPES
from pipelines.flow.objectives import OBJECTIVES
from pipelines.flow.vgpo import ANCHOR_KEYS

TORCH_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
ATTENTION = ("sdpa", "xformers")
"""Attention kernels of the flow transformer and VAE: diffusers' default torch SDPA (flash / memory-efficient
kernels picked by torch on CUDA, the math kernel on the CPU), or xformers' memory-efficient attention (CUDA)."""
LOSS_INPUTS = {"step_weights": ("weight",), "ratio_norm": ("std", "mean_sq_dist")}
"""switches whose per-element tensors reach the policy loss as keywords (GRPO-Guard, TempFlow-GRPO)"""


@dataclass
class FlowSettings:
    """The flow pipeline's `pipeline.kwargs` (`pipeline.name: flow`): GRPO on diffusers flow models and UNets."""

    model: str = ""
    """diffusers pipeline: hub id, local directory, or tiny:sd3 / tiny:flux / tiny:wan (random, offline)"""
    model_type: str | None = None
    """sd3, flux, wan, shapes, sd (SD 1.x) or sdxl; null = detected from the loaded pipeline"""
    data: str | None = None
    """training prompts: a .txt (one a line), a .jsonl ({"prompt": ...}) or shapes:<split>[:<category>,...]"""
    prompts: list | None = None
    """training prompts as a list (instead of data)"""
    eval_data: str | None = None
    """eval prompts, as data"""
    eval_prompts: list | None = None
    """eval prompts as a list (instead of eval_data)"""
    resolution: int | list[int] = 512
    """image side, or [height, width], in pixels"""
    num_frames: int = 33
    """video models (Wan): frames per sample"""
    num_steps: int = 10
    """denoising steps per rollout (>= 1)"""
    sde: str = "flow_grpo"
    """stochastic step: flow_grpo, dance, cps or sage (flow models), ddim (epsilon-prediction UNets)"""
    noise_level: float = 0.7
    """noise scale of the SDE step"""
    reduce: str = "mean"
    """how a step's log-prob is reduced over the latent: mean or sum"""
    guidance_scale: float = 4.5
    """classifier-free guidance scale"""
    negative_prompt: str = ""
    """negative prompt of classifier-free guidance"""
    max_sequence_length: int | None = None
    """text encoder tokens per prompt; null = the pipeline's default"""
    same_noise_per_group: bool = False
    """one initial noise per group (all samples of a prompt start alike)"""
    plan: str = "independent"
    """rollout plan (step schedule): independent, fast, singular or tree (`plan_kwargs` configure it)"""
    plan_kwargs: dict | None = None
    """the plan's keyword arguments, e.g. {fanout: 2, split_steps: [2]}"""
    lora_rank: int = 32
    """LoRA rank on the transformer; 0 = full fine-tuning"""
    lora_alpha: float | None = None
    """LoRA alpha; null = 2 * lora_rank"""
    lora_targets: list[str] | None = None
    """LoRA target modules; null = the model type's attention projections"""
    reference: bool = True
    """keep a KL reference (LoRA: adapter off; full fine-tuning: a frozen copy)"""
    k_chunk: int | None = None
    """denoising steps per log-prob chunk in the update (bounds memory); null = all at once"""
    torch_dtype: str | None = None
    """weights dtype: float32, bfloat16, float16 (or fp32, bf16, fp16); null = the run's dtype"""
    gradient_checkpointing: bool = False
    """recompute the transformer's activations in the backward pass"""
    decode_batch_size: int = 8
    """latents decoded by the VAE at once"""
    objective: str = "grpo"
    """grpo (SDE log-prob ratios, algo.loss clipped or guard_clipped) or nft (DiffusionNFT, algo.loss nft)"""
    nft_steps: int = 2
    """objective nft: denoising steps trained per sample, in 1..num_steps"""
    ratio_norm: bool = False
    """GRPO-Guard's ratio normalisation (objective grpo, algo.loss guard_clipped)"""
    step_weights: str = "none"
    """per-step loss weights: none, guard, guard_normalized, noise_aware or grad_equalizer (algo.loss guard_clipped)"""
    reward_inputs: list[str] | str | None = None
    """the rewards' input kinds; [latent] skips the VAE in rollouts; null = told by the engine"""
    attention: str = "sdpa"
    """attention kernel: sdpa (diffusers' default) or xformers (CUDA, the cuda extra)"""
    prompt_cache_items: int = 256
    """prompts whose text-encoder outputs are kept (>= 0; 0 re-encodes every batch)"""
    value_anchor: dict | None = None
    """VGPO's per-step credit: {anchor, scale, alpha}; null = off"""
    anchor_every: int = 0
    """SAGE-GRPO: move the KL reference to the policy every this many steps (0 = a fixed reference)"""
    trust_step: float = 0.0
    """SAGE-GRPO: coefficient of the per-update KL to the previous policy (0 = off)"""

    def check(self) -> None:
        """The step kind, plan, objective and switches, each error naming the field, the value and the fix."""
        check_flow_settings(self)

    def check_algo(self, algo: Any) -> None:
        """A switch that hands the loss extra per-element inputs needs a loss that takes them (GRPO-Guard's)."""

        def params(name: str):
            return inspect.signature(losses.POLICY_LOSSES.get(name)).parameters

        takers = [n for n in losses.names() if all(k in params(n) for ks in LOSS_INPUTS.values() for k in ks)]
        for key, needs in LOSS_INPUTS.items():
            value = getattr(self, key)
            if value in (None, False, "none") or all(n in params(algo.loss) for n in needs):
                continue
            off = "false" if isinstance(value, bool) else "none"
            raise UserError(
                f"pipeline.kwargs.{key} ({value!r}) feeds the policy loss per-step {'/'.join(needs)}, which "
                f"algo.loss ({algo.loss!r}) does not take; set algo.loss={' or '.join(takers) or '?'} "
                f"(GRPO-Guard's loss) or pipeline.kwargs.{key}={off}"
            )


def check_flow_settings(s: FlowSettings) -> None:
    """The checks `build_flow` makes before loading anything; the engine's validation (`mmgrpo config`, `train`)
    runs them too (FlowSettings.check), so a bad plan or step kind fails before any model loads."""
    kw = vars(s)
    sde, plan, plan_kwargs, objective = kw["sde"], kw["plan"], kw["plan_kwargs"], kw["objective"]
    num_steps, lora_rank, k_chunk, nft_steps = kw["num_steps"], kw["lora_rank"], kw["k_chunk"], kw["nft_steps"]
    ratio_norm, step_weights, torch_dtype = kw["ratio_norm"], kw["step_weights"], kw["torch_dtype"]
    same_noise_per_group, attention = kw["same_noise_per_group"], kw["attention"]
    if sde not in sde_mod.STEPS or sde == "ode":
        raise UserError(
            f"pipeline.kwargs.sde ({sde!r}) must be a stochastic step: flow_grpo, dance or cps (flow "
            f"models), ddim (epsilon-prediction UNets: SD 1.x, SDXL)"
        )
    if kw["reduce"] not in ("mean", "sum"):
        raise UserError(
            f"pipeline.kwargs.reduce ({kw['reduce']!r}) must be mean (Flow-GRPO, DanceGRPO, DDPO: the mean "
            f"over latent elements) or sum (the whole latent's log-density)"
        )
    _check_ddim(sde, kw["model_type"], objective, step_weights)
    _check_value_anchor(kw["value_anchor"], plan_kwargs or {}, objective)
    _check_trust(kw["anchor_every"], kw["trust_step"], kw["reference"], objective)
    _check_plan(plan, plan_kwargs or {}, objective)
    if num_steps < 1 or lora_rank < 0 or (k_chunk is not None and k_chunk < 1):
        raise UserError(
            f"pipeline.kwargs: num_steps ({num_steps}) must be >= 1, lora_rank ({lora_rank}) >= 0 "
            f"(0 = full fine-tuning) and k_chunk ({k_chunk}) null or >= 1"
        )
    _dry_run_plan(plan, plan_kwargs or {}, num_steps=num_steps, sde=sde, same_noise=same_noise_per_group)
    if objective not in OBJECTIVES or not 1 <= nft_steps <= num_steps:
        raise UserError(
            f"pipeline.kwargs: objective ({objective!r}) must be {' or '.join(OBJECTIVES.names())} "
            f"(pipelines/flow/objectives.py OBJECTIVES; grpo: SDE log-prob ratios, algo.loss clipped; nft: "
            f"DiffusionNFT, algo.loss nft), and nft_steps ({nft_steps}) in 1..num_steps ({num_steps})"
        )
    _check_guard(objective, ratio_norm, step_weights)
    if torch_dtype is not None and torch_dtype not in TORCH_DTYPES:
        raise UserError(f"pipeline.kwargs.torch_dtype ({torch_dtype!r}) must be one of {sorted(TORCH_DTYPES)} or null")
    if attention not in ATTENTION:
        raise UserError(f"pipeline.kwargs.attention ({attention!r}) must be one of {', '.join(ATTENTION)}")
    if not isinstance(kw["prompt_cache_items"], int) or kw["prompt_cache_items"] < 0:
        raise UserError(
            f"pipeline.kwargs.prompt_cache_items ({kw['prompt_cache_items']!r}) must be an integer >= 0 "
            f"(prompts whose text-encoder outputs are kept; 0 re-encodes every batch)"
        )


STEP_WEIGHTS = ("none", "guard", "guard_normalized", "noise_aware", "grad_equalizer")


def _check_guard(objective: str, ratio_norm: bool, step_weights: str) -> None:
    """ratio_norm / step_weights feed the guard_clipped loss (GRPO-Guard, TempFlow-GRPO): SDE objective only."""
    if step_weights not in STEP_WEIGHTS:
        raise UserError(
            f"pipeline.kwargs.step_weights ({step_weights!r}) must be one of {', '.join(STEP_WEIGHTS)}; "
            f"guard = GRPO-Guard's 1/|dt|, noise_aware = TempFlow-GRPO's std_t / mean std, "
            f"grad_equalizer = SAGE-GRPO's equal gradient norm per step"
        )
    if objective == "nft" and (ratio_norm or step_weights != "none"):
        raise UserError(
            f"pipeline.kwargs: ratio_norm ({ratio_norm}) and step_weights ({step_weights!r}) need "
            f"objective grpo with algo.loss guard_clipped; DiffusionNFT has no ratio, unset them"
        )


def _check_plan(plan: str, plan_kwargs: dict, objective: str) -> None:
    """Plan name and keywords before any model loads (e.g. granularities on a tree plan fail here)."""
    if plan not in plans.SCHEDULES:
        raise UserError(f"pipeline.kwargs.plan: {plans.SCHEDULES.unknown_message(plan)}")
    try:
        plans.SCHEDULES.check_kwargs(
            plan,
            plan_kwargs,
            field="pipeline.kwargs.plan_kwargs",
            skip=("num_steps", "group_size", "sde", "iteration", "same_noise", "seeds"),
        )
    except ValueError as err:
        raise UserError(str(err)) from None
    credit = plan_kwargs.get("edge_credit", "once")
    if credit not in plans.EDGE_CREDIT:
        raise UserError(
            f"pipeline.kwargs.plan_kwargs.edge_credit ({credit!r}) must be once (each shared tree edge "
            f"trained once, BranchGRPO) or per_leaf (once per leaf below it)"
        )
    grans = plan_kwargs.get("granularities")
    if objective == "nft" and isinstance(grans, list | tuple) and len(grans) > 1:
        raise UserError(
            f"pipeline.kwargs.plan_kwargs.granularities ({grans}) credit a singular SDE step with its "
            f"completions' rewards; objective nft trains no SDE step, drop granularities or use grpo"
        )


def _dry_run_plan(plan: str, plan_kwargs: dict, *, num_steps: int, sde: str, same_noise: bool) -> None:
    """Build the plan once for a group size its own kwargs imply, so bad values (window past num_steps, split steps
    out of range, an unknown width_prune...) fail before the model loads; the real group size is checked at rollout."""
    kw = dict(plan_kwargs)
    if plan == "tree":  # group = roots * fanout^splits; without split_steps the group size decides them: one split
        splits = len(kw["split_steps"]) if isinstance(kw.get("split_steps"), list | tuple) else 1
        group = int(kw.get("roots", 1)) * int(kw.get("fanout", 2)) ** splits
    elif plan == "singular" and isinstance(kw.get("granularities"), list | tuple):
        group = max(1, len(kw["granularities"]))
    else:
        group = 1
    try:
        built, _ = plans.make_plan(
            plan, num_steps=num_steps, group_size=group, sde=sde, iteration=0, same_noise=same_noise, seeds=[0], **kw
        )
        built.check()  # branch points inside the schedule, SDE where a group splits
    except (ValueError, TypeError) as err:
        raise UserError(
            f"pipeline.kwargs.plan_kwargs ({plan_kwargs}) for plan {plan!r} with num_steps={num_steps}: "
            f"{' '.join(str(err).split())}"
        ) from None


def _check_ddim(sde: str, model_type: str | None, objective: str, step_weights: str) -> None:
    """sde ddim steps on alpha_bar, not a flow sigma: no flow-only objective or sigma-based step weights with it."""
    if model_type is not None and (sde == "ddim") != (model_type in EPS_TYPES):
        raise UserError(
            f"pipeline.kwargs.sde ({sde!r}) does not fit model_type {model_type!r}: epsilon-prediction "
            f"UNets ({', '.join(EPS_TYPES)}) take sde ddim, flow models flow_grpo, dance or cps"
        )
    if sde == "ddim" and (objective != "grpo" or step_weights not in ("none", "noise_aware", "grad_equalizer")):
        raise UserError(
            f"pipeline.kwargs: sde ddim trains with objective grpo and step_weights none or noise_aware, "
            f"got objective {objective!r}, step_weights {step_weights!r} (DiffusionNFT and GRPO-Guard's "
            f"1/|dt| assume a flow-matching sigma)"
        )


def _check_value_anchor(value_anchor, plan_kwargs: dict, objective: str) -> None:
    """VGPO's per-step credit (pipelines/flow/vgpo.py): keys of value_anchored, an SDE objective, no granularities."""
    if value_anchor is None:
        return

    bad = sorted(set(value_anchor) - set(ANCHOR_KEYS)) if isinstance(value_anchor, dict) else None
    if bad is None or bad:
        raise UserError(
            f"pipeline.kwargs.value_anchor ({value_anchor!r}) must be a mapping with keys from "
            f"{', '.join(ANCHOR_KEYS)}, e.g. {{anchor: 0.5, scale: 0.1}}; unknown: {bad}"
        )
    try:
        _check_anchor(**{"anchor": 0.0, "scale": 0.1, "alpha": None, **value_anchor})
    except (TypeError, ValueError) as err:
        raise UserError(f"pipeline.kwargs.value_anchor ({value_anchor}): {err}") from None
    grans = plan_kwargs.get("granularities")
    if objective != "grpo" or (isinstance(grans, list | tuple) and len(grans) > 1):
        raise UserError(
            f"pipeline.kwargs.value_anchor (VGPO per-step credit) needs objective grpo and no "
            f"plan_kwargs.granularities (got objective {objective!r}, granularities {grans}); unset one"
        )


def _check_trust(anchor_every, trust_step, reference, objective: str) -> None:
    """SAGE-GRPO's dual trust region (trust.py) moves or adds to the KL reference: it needs one and an SDE objective."""
    ok = (
        isinstance(anchor_every, int)
        and not isinstance(anchor_every, bool)
        and anchor_every >= 0
        and isinstance(trust_step, int | float)
        and not isinstance(trust_step, bool)
        and trust_step >= 0
    )
    if not ok:
        raise UserError(
            f"pipeline.kwargs: anchor_every ({anchor_every!r}) must be an integer >= 0 (0 = a fixed "
            f"reference) and trust_step ({trust_step!r}) a number >= 0 (0 = no per-update KL)"
        )
    if (anchor_every or trust_step) and (reference is False or objective != "grpo"):
        raise UserError(
            f"pipeline.kwargs: anchor_every ({anchor_every}) / trust_step ({trust_step}) shape the KL to "
            f"the reference, which needs reference: true and objective grpo (got reference {reference}, "
            f"objective {objective!r}); set them to 0 or turn the reference on, with algo.kl_coef > 0"
        )
