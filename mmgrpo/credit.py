"""Step 3 of the loop: from the scored batch to advantages (KL in the reward, the estimator, its loss mask).

Rewards are gathered over all ranks so every rank normalises with the same group statistics.
"""

import inspect

import torch
from torch import Tensor

from mmgrpo import advantages, losses, sampling
from mmgrpo.collect import Batch
from mmgrpo.errors import UserError
from mmgrpo.runtime import all_gather
from mmgrpo.setup import Run


@torch.no_grad()
def kl_into_reward(run: Run, batch: Batch) -> dict[str, float]:
    """algo.kl_reward_coef > 0: batch.total minus coef * sum over each sample's tokens / steps of KL(old || ref)."""
    a, roll = run.cfg.algo, batch.rollout
    n, mb = roll.num_samples, run.micro_batch_size or roll.num_samples
    chunks = [torch.arange(i, min(i + mb, n)) for i in range(0, n, mb)]
    refs = [run.policy.ref_logp(roll, idx) for idx in chunks]
    if refs[0] is None:
        raise UserError(
            f"algo.kl_reward_coef ({a.kl_reward_coef}) needs a reference policy, which this pipeline "
            f"has switched off; set pipeline.kwargs.reference=auto or algo.kl_reward_coef=0"
        )
    ref = torch.cat(refs).float().cpu()  # [N_local, K]
    old = roll.old_logp.float()
    if roll.extras.get("old_logp_deferred"):  # not scored at rollout: the weights have not moved since
        old = torch.cat([run.policy.logp(run.model, roll, idx)[0].float().cpu() for idx in chunks])  # [N_local, K]
    penalty = losses.kl_reward_penalty(old, ref, roll.mask, coef=a.kl_reward_coef, kind=a.kl_reward_kind)  # [N]
    batch.total = batch.total - penalty.to(batch.total.dtype)  # [N_local]
    per = all_gather(run.accelerator, penalty)  # [N_global]
    return {"kl/reward_penalty": float(per.mean()), "kl/reward_coef": a.kl_reward_coef}


def compute_advantages(run: Run, batch: Batch, progress: float) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Advantages [N_local] and the sample mask [N_local] from rewards gathered over all ranks."""
    cfg, acc = run.cfg, run.accelerator
    g = cfg.sample.group_size
    name, kw = cfg.algo.advantage, dict(cfg.algo.advantage_kwargs)
    kw.update(run.adv_state.get(name, {}))  # a stateful estimator's kwargs as its update hook left them (FGRPO)
    if "progress" in inspect.signature(advantages.ADVANTAGES.get(name)).parameters:
        kw["progress"] = progress
    kind = advantages.ADVANTAGES.meta(name).get("input", "scalar")
    source = batch.per_reward if kind == "multi" else batch.total  # [N, R] or [N]
    if kind == "multi" and "weights" not in kw:
        kw["weights"] = run.reward_set.weights.tolist()
    rewards = all_gather(acc, source.contiguous())
    rewards = rewards.view(-1, g, *rewards.shape[1:])  # [B, G] or [B, G, R]; NaN pads smaller groups (knapsack)
    # a preference estimator fed by a pointwise reward gets P_bij [B, G, G] from the totals' order
    prep = advantages.prefs_from_scores if kind == "pairwise" else (lambda r: r)
    # by_size runs the estimator once per block of equal-size groups: one plain call when no group is padded
    adv = advantages.by_size(rewards, lambda r: advantages.compute(name, prep(r), **kw)).reshape(-1)  # [N]
    use = advantages.by_size(rewards, lambda r: advantages.loss_mask(name, prep(r), **kw), fill=False)  # [B, G]
    use = use.reshape(-1)  # [N]
    n_local = batch.total.numel()
    lo = acc.process_index * n_local
    adv, use = adv[lo : lo + n_local], use[lo : lo + n_local]
    if getattr(run.policy, "wants_step_advantages", False):
        # the rollout plan credits each decision separately (BranchGRPO trees): [N_local, K] from this rank's groups
        adv = run.policy.step_advantages(batch.rollout, batch.total.view(-1, g))
    use = use & batch.keep.repeat_interleave(g)
    totals = all_gather(acc, batch.total).view(-1, g)  # [B, G]
    real = adv if batch.real is None else adv[batch.real]  # padding of smaller groups is no sample
    stats = {
        "adv/mean": float(real.mean()),
        "adv/std": float(real.std()) if real.numel() > 1 else 0.0,
        "adv/min": float(real.min()),
        "adv/max": float(real.max()),
        "adv/zero_std_frac": sampling.zero_std_fraction(totals),
        "adv/kept_group_frac": float(batch.keep.float().mean()),
    }
    # the estimator's own: the share of the samples entering the loss that it pushes up or down (MC-GRPO's pivot,
    # asymmetric scaling and flat groups lower it)
    live = use if adv.dim() == 1 else use[:, None].expand_as(adv)  # [N_local] or [N_local, K] (per-step credit)
    nonzero = (adv != 0) & live  # [N_local] or [N_local, K]
    stats[f"adv/{name}/nonzero_frac"] = float(nonzero.sum() / live.sum().clamp(min=1))
    stats[f"adv/{name}/used_frac"] = float(
        use.float().mean() if batch.real is None else use[batch.real].float().mean()
    )
    update = advantages.ADVANTAGES.meta(name).get("update")
    if update is not None:  # e.g. dual ascent on FGRPO's multipliers, from the global batch (same on every rank)
        run.adv_state[name] = update(rewards, **kw)
        for key, value in run.adv_state[name].items():
            for i, v in enumerate(value if isinstance(value, list) else [value]):
                stats[f"adv/{name}/{key}/{i}"] = float(v)
    return adv, use, stats
