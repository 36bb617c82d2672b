"""Steps 1-2 of the loop: choose prompts, roll out G samples each, score them, filter or refill groups.

Every rank rolls out its own slice of the global prompt batch; rewards are gathered so all ranks agree.
"""

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmgrpo import budget, sampling
from mmgrpo.advantages import ADVANTAGES
from mmgrpo.errors import RewardFailed, UserError
from mmgrpo.reward import RewardError
from mmgrpo.runtime import all_gather, all_sum, any_rank, first_message, prompt_seed
from mmgrpo.types import Rollout


@dataclass
class Batch:
    """One step's training data on this rank: B_local prompts x G samples, scored."""

    prompt_ids: list[int]
    """[B_local] dataset indices"""
    prompts: list[dict[str, Any]]
    """[B_local] prompt records"""
    rollout: Rollout
    per_reward: Tensor
    """[N_local, R] per-reward scores"""
    total: Tensor
    """[N_local] weighted sum"""
    keep: Tensor
    """[B_local] bool: groups that enter the loss (False: filtered as zero-variance, or padding after refill)"""
    rounds: int = 1
    """rollout rounds this step took (more than 1 with DAPO refill)"""
    seconds: dict[str, float] = field(default_factory=dict)
    """wall time per phase on this rank, summed over rounds: {"rollout": s, "reward": s}"""
    real: Tensor | None = None
    """[N_local] bool: real samples (False: padding of a smaller group, masked with NaN rewards); None = all real"""


def _pad_dim1(tensors: list[Tensor]) -> list[Tensor]:
    """Right-pad dim 1 to a common size (completions of different rounds differ in length); mask pads with False."""
    if tensors[0].dim() < 2 or len({t.shape[1] for t in tensors}) == 1:
        return tensors
    k = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = torch.zeros((t.shape[0], k - t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
        out.append(torch.cat([t, pad], dim=1))
    return out


def _cat_extras(values: list[Any]) -> Any:
    """Per-sample payloads of several rounds joined along N: tensors (padded on dim 1), lists, dicts of those."""
    first = values[0]
    if isinstance(first, Tensor):
        return torch.cat(_pad_dim1(values), dim=0)
    if isinstance(first, list):
        return [v for vs in values for v in vs]
    if isinstance(first, dict):
        return {k: _cat_extras([v[k] for v in values]) for k in first}
    return first  # scalars and configs shared by every round


def _select(value: Any, idx: Tensor, n: int) -> Any:
    if isinstance(value, Tensor) and value.dim() and value.shape[0] == n:
        return value[idx]
    if isinstance(value, list) and len(value) == n:
        return [value[i] for i in idx.tolist()]
    if isinstance(value, dict):
        return {k: _select(v, idx, n) for k, v in value.items()}
    return value


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts along N; extras that are tensors are concatenated, lists extended."""
    if len(parts) == 1:
        return parts[0]
    extras = {key: _cat_extras([p.extras[key] for p in parts]) for key in parts[0].extras}
    metrics = {k: sum(p.metrics.get(k, 0.0) for p in parts) / len(parts) for k in parts[0].metrics}
    return Rollout(
        samples=[s for p in parts for s in p.samples],
        old_logp=torch.cat(_pad_dim1([p.old_logp for p in parts])),
        mask=torch.cat(_pad_dim1([p.mask for p in parts])),
        extras=extras,
        metrics=metrics,
    )


def select_groups(rollout: Rollout, groups: list[int], group_size: int) -> Rollout:
    """The rollout restricted to whole groups `groups` (in that order)."""
    idx = torch.tensor([g * group_size + j for g in groups for j in range(group_size)], dtype=torch.long)
    return select_rows(rollout, idx)


def select_rows(rollout: Rollout, idx: Tensor) -> Rollout:
    """The rollout's samples idx [n] (in that order, repeats allowed), extras included."""
    extras = {k: _select(v, idx, rollout.num_samples) for k, v in rollout.extras.items()}
    return Rollout(
        samples=[rollout.samples[i] for i in idx.tolist()],
        old_logp=rollout.old_logp[idx],
        mask=rollout.mask[idx],
        extras=extras,
        metrics=rollout.metrics,
    )


def reward_fields(prompts: list[dict[str, Any]], group_size: int) -> tuple[list[Any], dict[str, list[Any]]]:
    """Prompt texts and ground-truth fields repeated G times (samples of a group are contiguous)."""
    texts = [p.get("prompt") for p in prompts for _ in range(group_size)]
    keys = sorted({k for p in prompts for k in p if k != "prompt"})
    fields = {k: [p.get(k) for p in prompts for _ in range(group_size)] for k in keys}
    return texts, fields


def _sample_text(sample: Any) -> str:
    if isinstance(sample, str):
        return repr(sample if len(sample) <= 80 else sample[:77] + "...")
    shape = getattr(sample, "shape", None) or getattr(sample, "size", None)
    return f"{type(sample).__name__} {tuple(shape) if shape is not None else ''}".strip()


def _failure_message(err: Exception, rollout: Rollout, prompts: list[dict], g: int, first: int) -> str:
    """The reward's message plus where the failing sample sits in the global batch and what it was."""
    idx = getattr(err, "sample_index", None)
    msg = " ".join(str(err).split())
    if idx is None or not 0 <= idx < rollout.num_samples:
        return msg
    return (
        f"{msg} [global sample {first + idx}: prompt {prompts[idx // g].get('prompt')!r}, "
        f"output {_sample_text(rollout.samples[idx])}]"
    )


def _score(run, rollout: Rollout, prompts: list[dict], g: int, first: int) -> tuple[Tensor, Tensor]:
    """Per-reward [N, R] and total [N] scores; a reward that raises on any rank stops every rank together
    (a rank leaving alone would leave the others waiting in the next collective)."""
    texts, fields = reward_fields(prompts, g)
    fields.update(rollout.extras.get("reward_fields", {}))  # per-sample values the policy knows (token lengths)
    failure = None
    try:
        per_reward, total = run.reward_set(rollout.samples, texts, group_size=g, **fields)  # [N, R], [N]
    except RewardError as err:  # a reward's "this sample failed"; any other exception is a bug and propagates
        failure = err
    if any_rank(run.accelerator, failure is not None):
        mine = _failure_message(failure, rollout, prompts, g, first) if failure is not None else None
        msg = first_message(run.accelerator, mine)
        raise RewardFailed(msg or "a reward failed on another rank") from failure
    return per_reward.float(), total.float()


def _diversity(run, rollout: Rollout, g: int) -> Tensor:
    """[B_local] trajectory diversity of each group: the policy's own `diversity(rollout, G)` if it has one,
    else distinct-1 over text samples."""
    if hasattr(run.policy, "diversity"):
        return torch.as_tensor(run.policy.diversity(rollout, g), dtype=torch.float64)  # [B_local]
    try:
        return sampling.distinct_1(rollout.samples, g)  # [B_local]
    except ValueError as err:
        raise UserError(
            f"sample.sampler_kwargs.diversity_weight > 0: {err}; this pipeline's samples have no "
            f"text diversity, set diversity_weight=0"
        ) from None


def _one_round(run, step: int, round_: int) -> tuple[list[int], list[dict], Rollout, Tensor, Tensor, dict]:
    """Sample the global prompt batch, roll out this rank's slice, score, gather rewards to every rank."""
    cfg, acc = run.cfg, run.accelerator
    g, b_global = cfg.sample.group_size, cfg.sample.batch_size // cfg.sample.group_size
    b_local = b_global // acc.num_processes
    global_ids = run.sampler.sample(b_global)
    lo = acc.process_index * b_local
    ids = global_ids[lo : lo + b_local]
    prompts = [run.task.train_data[i] for i in ids]
    seeds = [prompt_seed(cfg.run.seed, step, round_, lo + i) for i in range(b_local)]
    sizes = budget.allocate(run, global_ids, [run.task.train_data[i] for i in global_ids])  # [B] or None
    t0 = time.perf_counter()
    if sizes is not None and not bool((sizes == g).all()):
        rollout, per_reward, total, real, t1 = _ragged_round(run, prompts, seeds, sizes.tolist(), g)
    else:
        with torch.no_grad():
            rollout = run.policy.rollout(prompts, g, seeds)
        rollout.check(b_local, g)
        t1, real = time.perf_counter(), None
        per_reward, total = _score(run, rollout, prompts, g, first=lo * g)  # [N, R], [N]
    global_total = all_gather(acc, total).view(b_global, g)  # [B, G]
    if getattr(run.sampler, "diversity_weight", 0) > 0:  # MMR1 VAS scores prompts by outcome variance + diversity
        div = all_gather(acc, _diversity(run, rollout, g).to(acc.device)).cpu()  # [B]
        run.sampler.update(global_ids, global_total, diversity=div)
    else:
        run.sampler.update(global_ids, global_total)
    secs = {"rollout": t1 - t0, "reward": time.perf_counter() - t1}
    return ids, prompts, rollout, per_reward, total, secs, real


def _ragged_round(run, prompts: list[dict], seeds: list[int], sizes: list[int], g: int):
    """Prompts of equal allocated size rolled out and scored together at that size, then laid out as [B, G]:
    group b's first sizes[b] rows are its samples; the rest repeat its first sample with mask False and NaN rewards
    (the advantages skip NaN, the loss skips masked rows). Returns rollout, per_reward, total, real [N] and
    start + rollout seconds (the caller's clock split between rollout and reward time)."""
    parts, per, tot, start, offset, t_roll, t_begin = [], [], [], {}, 0, 0.0, time.perf_counter()
    for size in sorted(set(sizes)):
        bs = [b for b, n in enumerate(sizes) if n == size]
        sub = [prompts[b] for b in bs]
        t0 = time.perf_counter()
        with torch.no_grad():
            roll = run.policy.rollout(sub, size, [seeds[b] for b in bs])
        roll.check(len(bs), size)
        t_roll += time.perf_counter() - t0
        p_s, t_s = _score(run, roll, sub, size, first=offset)  # [n_s, R], [n_s]
        start.update({b: offset + k * size for k, b in enumerate(bs)})
        parts, per, tot, offset = [*parts, roll], [*per, p_s], [*tot, t_s], offset + len(bs) * size
    real = torch.tensor([j < sizes[b] for b in range(len(sizes)) for j in range(g)])  # [B*G]
    idx = torch.tensor([start[b] + (j if j < sizes[b] else 0) for b in range(len(sizes)) for j in range(g)])
    rollout = select_rows(cat_rollouts(parts), idx)
    rollout.mask = rollout.mask & real[:, None]  # [N, K]
    rollout.metrics = {**rollout.metrics, "rollout/group_size_mean": sum(sizes) / len(sizes)}
    rollout.metrics.update({"rollout/group_size_min": min(sizes), "rollout/group_size_max": max(sizes)})
    nan = torch.tensor(float("nan"))
    per_reward = torch.where(real[:, None], torch.cat(per)[idx], nan)  # [N, R]
    total = torch.where(real, torch.cat(tot)[idx], nan)  # [N]
    return rollout, per_reward, total, real, t_begin + t_roll


def _flat_bound(algo) -> float | None:
    """The reward under which a flat group still has a gradient under algo.advantage, else None.

    Why: the filter drops the groups that carry no gradient; NGRPO's virtual best sample gives an all-wrong group
    negative advantages, so only its all-at-max_reward groups are flat (the estimator names the kwarg by meta)."""
    key = ADVANTAGES.meta(algo.advantage).get("flat_below")
    if key is None:
        return None
    default = inspect.signature(ADVANTAGES.get(algo.advantage)).parameters[key].default
    return float(algo.advantage_kwargs.get(key, default))


def collect(run, step: int) -> Batch:
    """Roll out and score one step's batch; with filter_zero_std drop flat groups, with refill roll out more."""
    cfg, acc = run.cfg, run.accelerator
    g = cfg.sample.group_size
    b_local = cfg.sample.batch_size // g // acc.num_processes
    parts, rounds, seconds = [], 0, {}
    below = _flat_bound(cfg.algo) if cfg.sample.filter_zero_std else None
    while True:
        ids, prompts, rollout, per_reward, total, secs, real = _one_round(run, step, rounds)
        for k, v in secs.items():
            seconds[k] = seconds.get(k, 0.0) + v
        keep = torch.ones(b_local, dtype=torch.bool)
        if cfg.sample.filter_zero_std and torch.isfinite(total[real] if real is not None else total).all():
            keep = sampling.group_keep_mask(total.view(b_local, g), below=below)  # [B_local]
        parts.append((ids, prompts, rollout, per_reward, total, keep))
        rounds += 1
        kept = sum(int(p[5].sum()) for p in parts)
        short = all_sum(acc, torch.tensor(float(kept < b_local)))
        if not cfg.sample.refill or short.item() == 0 or rounds > cfg.sample.max_refill_rounds:
            break
    if len(parts) == 1:
        ids, prompts, rollout, per_reward, total, keep = parts[0]
        batch = Batch(ids, prompts, rollout, per_reward, total, keep, rounds, real=real)
    else:
        batch = _assemble(parts, b_local, g, rounds)
    batch.seconds = seconds
    kept = int(batch.keep.sum())
    if cfg.sample.refill and kept < b_local:
        run.say(
            f"step {step}: only {kept} of {b_local} groups had reward variance after {rounds} rollout rounds; "
            f"training on those. Raise sample.max_refill_rounds, or check that the reward can tell samples apart"
        )
    return batch


def _assemble(parts: list[tuple], b_local: int, g: int, rounds: int) -> Batch:
    """DAPO refill: the first b_local kept groups over all rounds; if too few, pad with flat groups (masked out)."""
    ids = [i for p in parts for i in p[0]]
    prompts = [q for p in parts for q in p[1]]
    rollout = cat_rollouts([p[2] for p in parts])
    per_reward = torch.cat([p[3] for p in parts])  # [rounds*N_local, R]
    total = torch.cat([p[4] for p in parts])  # [rounds*N_local]
    keep_all = torch.cat([p[5] for p in parts])  # [rounds*B_local]
    order = keep_all.nonzero().flatten().tolist() + (~keep_all).nonzero().flatten().tolist()
    chosen = order[:b_local]
    sample_idx = torch.tensor([c * g + j for c in chosen for j in range(g)], dtype=torch.long)
    return Batch(
        prompt_ids=[ids[c] for c in chosen],
        prompts=[prompts[c] for c in chosen],
        rollout=select_groups(rollout, chosen, g),
        per_reward=per_reward[sample_idx],
        total=total[sample_idx],
        keep=keep_all[chosen],
        rounds=rounds,
    )
