"""Per-element policy losses on [N, K] log-probs + mask, their aggregation to a scalar, and KL estimators.

Pure tensor maths behind registries (POLICY_LOSSES, AGGREGATIONS, KL); nothing here knows the model or modality.
"""

import inspect

import torch
from torch import Tensor

from mmgrpo.loss_inputs import _MAX_LOG_RATIO, _check_inputs, _float_dtype, _masked_mean, _ratio_metrics
from mmgrpo.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("aggregation mode")
KL = Registry("KL estimator")


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None, level: str) -> None:
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if value < 0:
            raise ValueError(
                f"{name} must be >= 0 (the ratio is clipped to [1 - clip_low, 1 + clip_high]), "
                f"got {value}; use e.g. 0.2"
            )
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(
            f"dual_clip must be > 1 (it bounds negative-advantage losses at -dual_clip*A, above the "
            f"clipped range), got {dual_clip}; use 3.0 as verl does, or None to disable it"
        )
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' (per-element ratio) or 'sequence' (GSPO), got {level!r}")


def _ratios(logp: Tensor, old_logp: Tensor, valid: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """Token log-ratios [N, K] (0 where masked) and the clamped ratio [N, K] the loss uses (per token or GSPO's)."""
    dtype = _float_dtype(logp)
    log_ratio = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), 0.0)  # [N, K]
    used = log_ratio
    if level == "sequence":
        seq = log_ratio.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)  # [N, 1]
        used = log_ratio - log_ratio.detach() + seq.detach()  # [N, K]: value s_i, gradient GSPO-token's
    return log_ratio, used.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [N, K], [N, K]


@torch.no_grad()
def _clip_metrics(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, valid: Tensor, dual: Tensor, clip_low: float, clip_high: float
) -> dict[str, Tensor]:
    """_ratio_metrics plus the fractions of unmasked elements where the upper, lower and dual clips bind."""
    r, dtype = ratio.detach(), ratio.dtype
    metrics = _ratio_metrics(r, log_ratio.detach(), valid)
    metrics["clip/upper_frac"] = _masked_mean(((adv > 0) & (r > 1 + clip_high)).to(dtype), valid)
    metrics["clip/lower_frac"] = _masked_mean(((adv < 0) & (r < 1 - clip_low)).to(dtype), valid)
    metrics["clip/dual_frac"] = _masked_mean(dual.to(dtype), valid)
    return metrics


@POLICY_LOSSES.register("clipped")
def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate per element, with asymmetric clip, optional dual clip and GSPO sequence ratio.

    Papers: PPO arXiv:1707.06347; clip-higher (DAPO) arXiv:2503.14476; dual clip arXiv:1912.09729;
    GSPO arXiv:2507.18071 (level="sequence").
    Formula: loss = -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A); with dual_clip=c and A < 0: min(loss, -c*A).
    r = exp(logp - old_logp) per element (level="token"), or the GSPO ratio s_i = exp(mean_k over the mask of
    (logp - old_logp)) shared by all elements of sequence i (level="sequence").

    GSPO gradient: each element uses the GSPO-token ratio sg[s_i] * exp(logp_ik - sg[logp_ik]) (GSPO eq. for
    GSPO-token). Its value is s_i and d/dlogp_ik = s_i, so with a per-sequence A_i and any aggregation that
    weighs the elements of a sequence equally (all four modes here), the gradient equals GSPO's sequence-level
    gradient s_i * A_i * (1/|y_i|) * sum_k grad logp_ik; with A shaped [N, K] it is GSPO-token.

    Masked elements get loss 0 and gradient 0, whatever logp, old_logp or adv hold there (inf/NaN included).
    Log-ratios are clamped to +-20 before exp (as verl does), so a huge ratio gives a finite loss.

    Args:
        logp: [N, K] log-probs under the current policy (requires grad).
        old_logp: [N, K] log-probs under the rollout (behaviour) policy.
        adv: [N] per-sequence or [N, K] per-element advantages.
        mask: [N, K] bool or 0/1; nonzero marks an element that counts.
        clip_low, clip_high: >= 0; the ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: None, or c > 1 bounding negative-advantage losses by -c*A (verl clip_ratio_c, default there 3).
        level: "token" (per-element ratio) or "sequence" (GSPO).

    Returns:
        loss [N, K] (0 on masked elements) and detached scalar metrics over unmasked elements:
        ratio/mean, ratio/std (population), clip/upper_frac (A > 0 and r > 1+clip_high), clip/lower_frac
        (A < 0 and r < 1-clip_low), clip/dual_frac (A < 0 and r > c, where the dual bound is active),
        kl/old_approx (k3 estimate of KL(pi_old || pi_theta): mean of r - 1 - log r over token log-ratios).
    """
    valid, adv = _check_inputs(logp, old_logp, adv, mask)
    _check_clip(clip_low, clip_high, dual_clip, level)
    log_ratio, ratio = _ratios(logp, old_logp, valid, level)  # [N, K], [N, K]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))  # [N, K]
    dual = torch.zeros_like(valid)  # [N, K]
    if dual_clip is not None:
        dual = (adv < 0) & (loss > -adv * dual_clip)  # [N, K]
        loss = torch.where(dual, -adv * dual_clip, loss)  # [N, K]
    loss = torch.where(valid, loss, 0.0)  # [N, K]
    return loss, _clip_metrics(ratio, log_ratio, adv, valid, dual, clip_low, clip_high)


def _check_reg(n: int, group_size: int | None, reduce: str, eps: float, ddof: int) -> None:
    if group_size is None or group_size < 1 or n % group_size:
        raise ValueError(
            f"reg_grpo needs group_size (G samples per prompt, consecutive) dividing N={n}, got "
            f"group_size={group_size}; pass loss_kwargs group_size=sample.group_size and keep whole "
            f"groups in each micro-batch"
        )
    if reduce not in ("sum", "mean"):
        raise ValueError(
            f"reduce must be 'sum' (log sequence ratio, the paper) or 'mean' (per-token mean), got {reduce!r}"
        )
    if eps < 0 or ddof not in (0, 1):
        raise ValueError(
            f"reg_grpo needs eps >= 0 and ddof in (0, 1), got eps={eps}, ddof={ddof}; use eps=1e-4, ddof=1"
        )


@POLICY_LOSSES.register("reg_grpo")
def reg_grpo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    group_size: int | None = None,
    reduce: str = "sum",
    eps: float = 1e-4,
    ddof: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reg-GRPO: regress the group-normalised log-ratio onto the advantage, no clip and no min (DeepVideo-R1).

    Paper: arXiv:2506.07464, Eq. 8 / Appendix A.4 (reward-model-free: the optimum of the KL-to-old objective gives
    R = lam*(log Z(x) + rho*), and group normalisation cancels log Z and lam).
    Formula: loss_i = (A_i - (rho_i - mean_g rho) / sqrt(var_g rho + eps^2))^2, rho_i = sum_k m*(logp - old_logp).
    The paper's loss is the mean over the G samples of loss_i; here loss_i is written on every unmasked element of
    sequence i, so aggregate(..., "seq_mean_token_mean") reproduces the paper exactly (token_mean weighs by length).
    The paper's KL-to-reference term is left to the caller (kl()), as for the clipped loss.

    Choices the paper leaves open, made here: gradients flow through the group mean and std of rho (as written);
    the std is sqrt(var + eps^2) so the first on-policy step (all rho = 0) is finite: there the gradient is
    REINFORCE-like, d loss / d rho_j = -2 (A_j - mean A) / (G * eps) under seq_mean_token_mean, which scale-free
    optimisers (Adam) absorb but gradient-norm clipping will see; sequences with no unmasked element are left out of
    their group's statistics. Groups whose advantages are all 0 still pull rho towards equal values: filter them.

    Args:
        logp, old_logp: [N, K] log-probs, N = B * group_size with each group's G samples consecutive.
        adv: [N] or [N, K] target (group-normalised) advantages; [N, K] is reduced by its mean over the mask.
        mask: [N, K] bool or 0/1.
        group_size: G (required); every micro-batch must hold whole groups.
        reduce: "sum" (rho = log of the sequence probability ratio, the paper) or "mean" (length-normalised, as GSPO).
        eps: >= 0 in the std; use the ddof of your advantage estimator so target and prediction share one scale.
        ddof: 0 or 1.

    Returns:
        loss [N, K] and detached metrics: ratio/mean, ratio/std, kl/old_approx (as for "clipped") and reg/sq_err (mean
        of loss_i over sequences with an unmasked element).
    """
    valid, adv = _check_inputs(logp, old_logp, adv, mask)
    n = logp.shape[0]
    _check_reg(n, group_size, reduce, eps, ddof)
    dtype = _float_dtype(logp)
    log_ratio = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), 0.0)  # [N, K]
    count = valid.sum(-1).to(dtype)  # [N]
    rho = log_ratio.sum(-1) / (count.clamp_min(1) if reduce == "mean" else 1)  # [N]
    target = adv.sum(-1) / count.clamp_min(1)  # [N]
    w = (count > 0).to(dtype).view(-1, group_size)  # [B, G]
    rho_g = rho.view(-1, group_size)  # [B, G]
    n_g = w.sum(-1, keepdim=True)  # [B, 1]
    mu = (w * rho_g).sum(-1, keepdim=True) / n_g.clamp_min(1)  # [B, 1]
    var = (w * (rho_g - mu) ** 2).sum(-1, keepdim=True) / (n_g - ddof).clamp_min(1)  # [B, 1]
    pred = (rho_g - mu) / (var + eps**2).sqrt()  # [B, G]
    sq_err = (target.view(-1, group_size) - pred) ** 2  # [B, G]
    loss = torch.where(valid, sq_err.reshape(n, 1), 0.0)  # [N, K]
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio.clamp(max=_MAX_LOG_RATIO).exp(), log_ratio, valid)
        metrics["reg/sq_err"] = (w * sq_err).sum() / w.sum().clamp_min(1)
    return loss, metrics


def needs_groups(name: str) -> bool:
    """Whether policy loss `name` normalises within whole groups (takes `group_size`, e.g. Reg-GRPO)."""
    return "group_size" in inspect.signature(POLICY_LOSSES.get(name)).parameters


def compute(name: str, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, **kw) -> tuple[Tensor, dict]:
    """Run the policy loss registered as `name`; unknown names and keywords raise ValueError listing the choices."""
    POLICY_LOSSES.check_kwargs(name, kw, field="loss_kwargs", skip=("logp", "old_logp", "adv", "mask"))
    return POLICY_LOSSES.get(name)(logp, old_logp, adv, mask, **kw)


def names() -> list[str]:
    """Registered policy-loss names."""
    return POLICY_LOSSES.names()


# ---- aggregation: numerator per micro-batch, denominator over the whole (global) batch ----


def _n_seqs(valid: Tensor) -> Tensor:
    return valid.any(-1).sum()


@AGGREGATIONS.register("token_mean")
def _token_mean(loss: Tensor, valid: Tensor, *, norm_len: float | None = None) -> tuple[Tensor, Tensor]:
    """Sum over unmasked elements / their count (verl token-mean, TRL bnpo/dapo, DAPO arXiv:2503.14476)."""
    return loss.sum(), valid.sum()


@AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(loss: Tensor, valid: Tensor, *, norm_len: float | None = None) -> tuple[Tensor, Tensor]:
    """Mean over sequences of each sequence's token mean (GRPO arXiv:2402.03300, TRL loss_type=grpo)."""
    per_seq = loss.sum(-1) / valid.sum(-1).clamp_min(1)  # [N]
    return per_seq.sum(), _n_seqs(valid)


@AGGREGATIONS.register("seq_mean_token_sum")
def _seq_mean_token_sum(loss: Tensor, valid: Tensor, *, norm_len: float | None = None) -> tuple[Tensor, Tensor]:
    """Mean over sequences of each sequence's token sum (verl seq-mean-token-sum)."""
    return loss.sum(), _n_seqs(valid)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(
    loss: Tensor, valid: Tensor, *, norm_len: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """Sum over unmasked elements / (N x norm_len): Dr. GRPO's constant normaliser (arXiv:2503.20783)."""
    return loss.sum(), None if norm_len is None else _n_seqs(valid) * norm_len


def _agg_parts(loss: Tensor, mask: Tensor, mode: str, norm_len: float | None) -> tuple[Tensor, Tensor | None]:
    fn = AGGREGATIONS.get(mode)
    if mask.shape != loss.shape or loss.dim() != 2:
        raise ValueError(
            f"mask {tuple(mask.shape)} != loss {tuple(loss.shape)}: aggregate takes the [N, K] loss "
            f"and the same-shape mask it was computed with"
        )
    if norm_len is not None and not norm_len > 0:
        raise ValueError(
            f"norm_len must be > 0 (the constant length of Dr. GRPO's N x norm_len), got {norm_len}; "
            f"use the maximum response length or number of trained steps"
        )
    valid = mask.bool()
    num, den = fn(torch.where(valid, loss, 0.0), valid, norm_len=norm_len)
    return num, den


def _missing_norm_len() -> ValueError:
    return ValueError(
        "seq_mean_token_sum_norm needs norm_len (Dr. GRPO divides by N x norm_len, a constant), got "
        "None; pass norm_len=max response length (or trained steps), or denom=denominator(...)"
    )


def denominator(mask: Tensor, mode: str, *, norm_len: float | None = None) -> Tensor:
    """The aggregation denominator of `mask` (scalar): token count, non-empty sequence count, or that x norm_len.

    Denominators are additive over micro-batches and ranks: compute this over the whole optimizer batch (or sum it
    over micro-batches, then all-reduce it with SUM across data-parallel ranks) and pass it as `aggregate(denom=)`.

    Args:
        mask: [N, K] bool or 0/1 over the whole batch.
        mode: an AGGREGATIONS name.
        norm_len: required for seq_mean_token_sum_norm.

    Returns:
        0-dim tensor: an exact int64 count, or a float for seq_mean_token_sum_norm.
    """
    _, den = _agg_parts(torch.zeros(mask.shape, device=mask.device), mask, mode, norm_len)
    if den is None:
        raise _missing_norm_len()
    return den


def aggregate(
    loss: Tensor, mask: Tensor, mode: str, *, norm_len: float | None = None, denom: Tensor | float | None = None
) -> Tensor:
    """Reduce an [N, K] loss to a scalar: this micro-batch's numerator / a (global) denominator.

    Modes (AGGREGATIONS): token_mean = sum(m*l) / sum(m); seq_mean_token_mean = sum_i [sum_k m*l / sum_k m] / N';
    seq_mean_token_sum = sum(m*l) / N'; seq_mean_token_sum_norm = sum(m*l) / (N' * norm_len) (Dr. GRPO,
    arXiv:2503.20783), where N' counts sequences with at least one unmasked element (fully masked rows add 0 to both).

    Gradient accumulation: pass denom=denominator(full_batch_mask, mode) to every micro-batch; the micro-batch
    results then sum to the full-batch value and their gradients to its gradient. With DDP, whose backward averages
    gradients over W ranks, all-reduce (SUM) the denominator and multiply the loss by W (verl's `* dp_size`).
    Without denom, the micro-batch's own denominator is used (correct only for a single micro-batch).
    An empty denominator (all masked) gives 0 with zero gradient, never NaN.
    Anchors: verl token-mean / TRL bnpo, dapo = token_mean (TRL bnpo uses the local count, so its accumulated
    gradient is not the big-batch one); TRL grpo = seq_mean_token_mean per micro-batch / accumulation steps;
    TRL dr_grpo = seq_mean_token_sum_norm (TRL also counts empty rows); verl's seq-mean-token-sum-norm divides by
    N' and the horizon K as here since 0.9 (older verl omitted N'). Checked against both: tests/test_peers.py.

    Args:
        loss: [N, K]; masked elements may hold anything, inf/NaN included.
        mask: [N, K] bool or 0/1.
        mode: an AGGREGATIONS name.
        norm_len: required for seq_mean_token_sum_norm unless denom is given.
        denom: optional global denominator (scalar tensor or float) from denominator().

    Returns:
        0-dim tensor in loss's dtype.
    """
    num, den = _agg_parts(loss, mask, mode, norm_len)
    if denom is not None:
        den = torch.as_tensor(denom, device=num.device)
    elif den is None:
        raise _missing_norm_len()
    den = den.to(num.dtype)
    return num / torch.where(den > 0, den, torch.ones_like(den))


# ---- KL estimators (Schulman, http://joschu.net/blog/kl-approx.html), samples drawn from pi_theta ----


@KL.register("k1")
def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = logp - ref_logp: unbiased, high variance, can be negative (verl kl/k1, OpenRLHF k1)."""
    return logp - ref_logp


@KL.register("k2")
def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2: low variance, biased (verl mse/k2)."""
    return 0.5 * (logp - ref_logp) ** 2


@KL.register("k3")
def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, >= 0, low variance (TRL beta KL, verl/EasyR1 low_var_kl)."""
    d = ref_logp - logp
    return d.exp() - d - 1


def kl(logp: Tensor, ref_logp: Tensor, kind: str, *, mask: Tensor | None = None, clamp: float | None = None) -> Tensor:
    """Per-element estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1, k2, k3).

    Paper/blog: http://joschu.net/blog/kl-approx.html; k3 is what TRL (beta > 0) and verl/EasyR1 (low_var_kl) put
    in the loss. Formula: d = ref_logp - logp; k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1.
    Flow-GRPO's KL on the Gaussian step means, mean((mu - mu_ref)^2) / (2 std_t^2), is not one of these: it drops
    a |dt| factor from the exact Gaussian KL (see pipelines/flow and anchors.md); it belongs to the SDE code.

    Args:
        logp: [N, K] log-probs under the current policy.
        ref_logp: [N, K] log-probs under the reference policy.
        kind: "k1", "k2" or "k3".
        mask: optional [N, K] bool or 0/1; masked elements give exactly 0 with zero gradient whatever logp or
            ref_logp hold there (padding at -inf/NaN included). Without it, aggregate() still zeroes their value,
            but the backward pass through exp(d) of such garbage gives 0 * inf = NaN gradients: pass the mask.
        clamp: None (exact), or c > 0: clamp d to +-20 and the estimate to [-c, c], as verl's low_var_kl does with
            c = 10 (guards against one token with a huge ratio; clamped elements get zero gradient).

    Returns:
        [N, K] per-element KL estimate (aggregate it with the same mask and mode as the policy loss).
    """
    fn = KL.get(kind)
    if ref_logp.shape != logp.shape:
        raise ValueError(
            f"ref_logp {tuple(ref_logp.shape)} != logp {tuple(logp.shape)}: the KL is per element; "
            f"score the same [N, K] elements under the reference policy"
        )
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}; verl uses 10")
    dtype = _float_dtype(logp)
    logp, ref_logp = logp.to(dtype), ref_logp.to(dtype)
    if mask is not None:
        if mask.shape != logp.shape:
            raise ValueError(
                f"mask {tuple(mask.shape)} != logp {tuple(logp.shape)}: pass the [N, K] mask of the policy loss"
            )
        valid = mask.bool()  # [N, K]
        # replace both sides before the maths (d = 0 gives 0 for every kind); masking the result afterwards would
        # still send 0 * inf = NaN gradients through exp() of the garbage
        logp, ref_logp = torch.where(valid, logp, 0.0), torch.where(valid, ref_logp, 0.0)  # [N, K]
    if clamp is None:
        return fn(logp, ref_logp)
    d = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [N, K]
    return fn(ref_logp - d, ref_logp).clamp(-clamp, clamp)


def kl_reward_penalty(old_logp: Tensor, ref_logp: Tensor, mask: Tensor, *, coef: float, kind: str = "k1") -> Tensor:
    """KL in the reward (verl `use_kl_in_reward`, `apply_kl_penalty`): the per-sample penalty subtracted from the
    reward before the advantages, coef * sum_k mask_k KL_k(old || ref), KL_k the `kind` estimate on element k (a
    token, or a denoising step of a flow model). verl subtracts coef * KL_k from each token's reward and its GRPO
    sums a sequence's token rewards, which is the same total.

    Args:
        old_logp, ref_logp: [N, K] rollout-policy and reference log-probs of the rollout's elements.
        mask: [N, K] elements that count.  coef: >= 0.  kind: "k1", "k2" or "k3".
    Returns:
        [N] penalty (no gradient: the rollout's log-probs are data).
    """
    if coef < 0:
        raise ValueError(f"coef={coef} must be >= 0 (it is subtracted from the reward)")
    with torch.no_grad():
        per = kl(old_logp.detach(), ref_logp.detach(), kind, mask=mask)  # [N, K]
        return coef * torch.where(mask.bool(), per, 0.0).sum(1)  # [N]
