"""The one training loop every pipeline shares: sample -> score -> advantages -> clipped updates -> log.

Read `train` top to bottom; set-up, update and saving live in small helpers above it. No modality branches.
"""

import copy
import dataclasses
import inspect
import time
import warnings
from typing import Any

import torch
from torch import Tensor

from mmgrpo import losses, phases
from mmgrpo.collect import Batch, collect
from mmgrpo.config import Config
from mmgrpo.credit import compute_advantages, kl_into_reward
from mmgrpo.errors import RewardFailed, TrainingStopped, UserError
from mmgrpo.runtime import (
    StopFlag,
    all_gather,
    all_sum,
    any_rank,
    default_budget_bytes,
    first_message,
    fit_micro_batch,
    peak_bytes,
    shuffle_generator,
    sync_context,
)
from mmgrpo.setup import Run, save_checkpoint, setup
from mmgrpo.stepstats import _Acc, _per_element
from mmgrpo.tracking import save_gallery


def _loss_for(
    run: Run, batch: Batch, idx: Tensor, ks: slice | None, adv: Tensor, mask: Tensor, ref: Tensor | None, denom: Tensor
):
    """Loss of samples idx (and steps ks when the policy chunks K): policy loss (+ KL), global denominator.

    Also returns a [n] device flag per sample of idx: are its unmasked loss elements all finite (read by the host
    only when a step is skipped, to name the samples). Host tensors are copied with non_blocking=True: a blocking
    copy to the GPU waits for the work queued before it."""
    a = run.cfg.algo
    ks_ = ks if ks is not None else slice(None)
    if ks is None:
        logp, aux = run.policy.logp(run.model, batch.rollout, idx)  # [n, K]
    else:
        logp, aux = run.policy.logp(run.model, batch.rollout, idx, k_slice=ks)  # [n, k]
    old = batch.rollout.old_logp[idx][:, ks_].to(logp.device, non_blocking=True)
    if batch.rollout.extras.get("old_logp_deferred"):
        old = logp.detach()  # on-policy (one epoch, one mini-batch): no weight has moved since the rollout
    m = mask[idx][:, ks_].to(logp.device, non_blocking=True)
    kw = dict(a.loss_kwargs)
    if losses.needs_groups(a.loss):
        kw["group_size"] = run.cfg.sample.group_size
    kw.update(aux.get("loss_kwargs", {}))  # per-element inputs a pipeline's loss needs (e.g. GRPO-Guard's std)
    a_idx = adv[idx] if adv.dim() == 1 else adv[idx][:, ks_]
    loss_mat, metrics = losses.compute(a.loss, logp, old, a_idx.to(logp.device, non_blocking=True), m, **kw)
    metrics = dict(metrics)
    if ref is not None:
        # a pipeline that knows the exact KL (flow: Gaussian transitions with equal std) returns it in aux
        # mask=m: padding may hold -inf/NaN, which would otherwise reach the gradient through k2/k3
        ref_k = ref[idx][:, ks_].to(logp.device, non_blocking=True)
        kl_mat = aux["kl"] if "kl" in aux else losses.kl(logp, ref_k, a.kl_kind, mask=m)
        loss_mat = loss_mat + a.kl_coef * kl_mat
        metrics["kl/ref"] = torch.where(m, kl_mat, 0.0).sum() / m.sum().clamp(min=1)
    if "entropy" in aux:
        metrics["entropy"] = torch.where(m, aux["entropy"], 0.0).sum() / m.sum().clamp(min=1)
    if getattr(run.policy, "per_element_metrics", False):
        params = inspect.signature(losses.POLICY_LOSSES.get(a.loss)).parameters  # the loss's own clip range
        clip = {
            n: kw.get(n, params[n].default)
            for n in ("clip_low", "clip_high")
            if n in params and params[n].default is not inspect.Parameter.empty
        }
        metrics.update(_per_element(logp.detach(), old, m, ks_.start or 0, **clip))
    if ks is not None and a.aggregation == "seq_mean_token_mean":
        # a row's mean over all K = sum over chunks of (chunk sum / full-row count): rescale each chunk's mean
        full = mask[idx].sum(1).clamp(min=1).to(logp.device, non_blocking=True)  # [n]
        loss_mat = loss_mat * (m.sum(1).clamp(min=1) / full)[:, None]
    rows_ok = torch.isfinite(torch.where(m, loss_mat.detach(), 0.0)).all(1)  # [n]
    loss = losses.aggregate(loss_mat, m, a.aggregation, norm_len=_norm_len(run, mask), denom=denom)
    return loss * run.accelerator.num_processes, metrics, rows_ok  # DDP averages gradients; denominators global


def _k_slices(run: Run, k: int) -> list[slice | None]:
    """Chunks of the decision axis for policies that bound memory by one backward per chunk (flow steps)."""
    chunk = getattr(run.policy, "k_chunk", None)
    if not chunk or chunk >= k:
        return [None]
    if run.cfg.algo.loss_kwargs.get("level", "token") == "sequence" or losses.needs_groups(run.cfg.algo.loss):
        raise ValueError(
            f"algo.loss={run.cfg.algo.loss!r} with sequence-level ratios needs all of K in one pass; "
            f"set the pipeline's k_chunk to null or use the token-level clipped loss"
        )
    return [slice(i, min(i + chunk, k)) for i in range(0, k, chunk)]


def _norm_len(run: Run, mask: Tensor) -> int | None:
    if run.cfg.algo.aggregation != "seq_mean_token_sum_norm":
        return run.cfg.algo.norm_len
    return run.cfg.algo.norm_len or mask.shape[1]


@torch.no_grad()
def _reference(run: Run, batch: Batch) -> Tensor | None:
    if run.cfg.algo.kl_coef == 0:
        return None
    n, mb = batch.rollout.num_samples, run.micro_batch_size
    parts = [run.policy.ref_logp(batch.rollout, torch.arange(i, min(i + mb, n))) for i in range(0, n, mb)]
    return None if parts[0] is None else torch.cat(parts).float()  # [N, K]


@torch.no_grad()
def _against_reference(run: Run, batch: Batch) -> Batch:
    """The batch with the reference policy's log-probs [N, K] in rollout.old_logp, for losses registered with
    reference=True (DPO: its logit is the policy-minus-reference margin)."""
    roll, mb = batch.rollout, run.micro_batch_size
    parts = [
        run.policy.ref_logp(roll, torch.arange(i, min(i + mb, roll.num_samples)))
        for i in range(0, roll.num_samples, mb)
    ]
    if parts[0] is None:
        raise UserError(
            f"algo.loss={run.cfg.algo.loss!r} compares the policy with a frozen reference, which this pipeline has "
            f"switched off; set pipeline.kwargs.reference=auto, or use another algo.loss"
        )
    extras = {k: v for k, v in roll.extras.items() if k != "old_logp_deferred"}
    ref = torch.cat(parts).float().to(roll.old_logp.device)  # [N, K]
    return dataclasses.replace(batch, rollout=dataclasses.replace(roll, old_logp=ref, extras=extras))


def _minibatches(run: Run, mask: Tensor, step: int, epoch: int) -> list[Tensor]:
    """This rank's sample indices of each mini-batch of one inner epoch. Whole groups of the GLOBAL batch are
    shuffled with one generator on every rank, so a mini-batch holds the same samples on any rank count (whole
    groups: group-level losses such as Reg-GRPO need them)."""
    cfg, acc = run.cfg, run.accelerator
    g = cfg.sample.group_size
    b_local = mask.shape[0] // g
    groups = torch.randperm(b_local * acc.num_processes, generator=shuffle_generator(cfg.run.seed, step, epoch))  # [B]
    out = []
    for mb_groups in groups.chunk(cfg.algo.num_minibatches):
        mine = mb_groups[mb_groups // b_local == acc.process_index] - acc.process_index * b_local  # this rank's
        mb = (mine[:, None] * g + torch.arange(g)).reshape(-1)  # [n_mb]
        if not losses.needs_groups(cfg.algo.loss):  # rows with no unmasked element (filtered groups, pruned
            mb = mb[mask[mb].any(1)]  # leaves) add nothing: no forward for them
        out.append(mb)
    return out


def _pieces(run: Run, mbs: list[Tensor], k: int) -> list[list[tuple[Tensor, slice | None, float]]]:
    """(samples, K chunk, weight) per forward/backward of each mini-batch on this rank, padded with weight-0 pieces
    to the most any rank has: FSDP gathers weights in every forward, so all ranks must run as many (DDP only needs
    the last backward in step, and loses no time: the padded rank would otherwise wait for the busiest one). One
    gather for all the mini-batches of an epoch."""
    g, chunks = run.cfg.sample.group_size, _k_slices(run, k)
    plans = [
        [(idx, ks, 1.0) for idx in (mb.split(run.micro_batch_size) if len(mb) else ()) for ks in chunks] for mb in mbs
    ]  # split() of an empty tensor gives one empty piece, hence the guard
    most = all_gather(run.accelerator, torch.tensor([[len(p) for p in plans]])).max(0).values.tolist()  # [M]
    return [p + [(torch.arange(g), chunks[0], 0.0)] * (m - len(p)) for p, m in zip(plans, most)]


def update(run: Run, batch: Batch, adv: Tensor, use: Tensor, step: int) -> tuple[dict[str, float], bool, list[int]]:
    """Inner epochs over shuffled mini-batches with gradient accumulation.

    Returns the metrics, False when a NaN/Inf loss or gradient skipped an optimizer step, and the local indices of
    the samples whose loss was not finite. The host reads a device value once per optimizer step (the NaN check)."""
    acc, a = run.accelerator, run.cfg.algo
    mask = batch.rollout.mask & use[:, None]  # [N, K]
    if run.micro_batch_size is None:
        run.micro_batch_size = _auto_micro_batch(run, batch, adv, mask)
    if losses.POLICY_LOSSES.meta(a.loss).get("reference"):
        batch = _against_reference(run, batch)  # DPO reads the frozen reference's log-probs as old_logp
    ref = _reference(run, batch)
    acc_metrics, ok, rows = _Acc(), True, []
    for epoch in range(a.inner_epochs):
        mbs = _minibatches(run, mask, step, epoch)
        for mb, pieces in zip(mbs, _pieces(run, mbs, mask.shape[1])):
            denom = all_sum(acc, losses.denominator(mask[mb], a.aggregation, norm_len=_norm_len(run, mask)).float())
            finite = torch.ones((), dtype=torch.bool, device=acc.device)  # stays on the device until the step
            for j, (idx, ks, scale) in enumerate(pieces):
                with sync_context(acc, run.model, last=j == len(pieces) - 1), acc.autocast():
                    loss, metrics, rows_ok = _loss_for(run, batch, idx, ks, adv, mask, ref, denom)
                    loss = loss * scale
                    if scale:
                        finite = finite & torch.isfinite(loss.detach()).to(finite.device)
                    acc.backward(torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0))
                rows += [(idx, rows_ok)] if scale else []
                metrics["loss/policy"] = loss.detach() / acc.num_processes
                acc_metrics.add(metrics, mask[idx][:, ks or slice(None)].sum() * scale)  # elements weigh
            ok = _optimizer_step(run, finite, acc_metrics) and ok
    # the host reads which samples were not finite only when a step was skipped (to name them)
    bad = [] if ok else sorted({i for idx, r in rows for i in idx[~r.cpu()].tolist()})
    return acc_metrics.means(), ok, bad


def _optimizer_step(run: Run, finite: Tensor, acc_metrics: _Acc) -> bool:
    """Clip, check finiteness on every rank, step (or skip the whole step when any rank saw NaN/Inf).

    The one host-device synchronisation of an optimizer step: reading the all-rank finiteness flag."""
    acc, clip = run.accelerator, run.cfg.optim.grad_clip
    params = [p for p in run.model.parameters() if p.requires_grad]
    grad_norm = torch.as_tensor(acc.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
    finite = (finite & torch.isfinite(grad_norm).to(finite.device)).float()
    all_ok = all_sum(acc, finite).item() == acc.num_processes
    if all_ok:
        run.optimizer.step()
        if run.ema is not None:
            run.ema.update()
        acc_metrics.add({"grad_norm": grad_norm}, 1.0)
    run.optimizer.zero_grad(set_to_none=True)
    return all_ok


def _auto_micro_batch(run: Run, batch: Batch, adv: Tensor, mask: Tensor) -> int:
    """algo.micro_batch_size=auto: the largest micro-batch whose forward+backward fits the memory budget, from one
    probe at 2 units, then 1 (units: samples, or whole groups for group losses). Probing 2 first counts one-time
    allocations (kernels' workspaces) as per-unit cost, which errs towards a smaller micro-batch."""
    cfg, acc = run.cfg, run.accelerator
    unit = cfg.sample.group_size if losses.needs_groups(cfg.algo.loss) else 1
    n = batch.rollout.num_samples
    live = mask.any(1).nonzero().flatten() if unit == 1 else torch.arange(n)  # rows the update will run
    if any_rank(acc, len(live) < 2 * unit):  # all ranks probe or none (FSDP gathers weights in every forward)
        units, why = n // unit, "too few samples to probe"
    else:
        budget = cfg.algo.memory_budget_gb * 1e9 if cfg.algo.memory_budget_gb else default_budget_bytes(acc.device)
        ks = _k_slices(run, mask.shape[1])[0]
        peaks = {u: _probe(run, batch, live[: u * unit], ks, adv, mask) for u in (2, 1)}
        try:
            units = fit_micro_batch(peaks[1], peaks[2], budget, most=n // unit)
        except ValueError:
            units = 0  # decided together below: a rank that raised alone would leave the others waiting
        why = (
            f"forward+backward peaks {peaks[2] / 1e6:.4g} MB at {2 * unit} samples and {peaks[1] / 1e6:.4g} MB "
            f"at {unit}, budget {budget / 1e9:.3g} GB"
        )
    units = int(all_gather(acc, torch.tensor([units])).min())  # every rank runs the same micro-batches
    if units == 0:
        raise UserError(
            f"algo.memory_budget_gb ({budget / 1e9:.3g} GB) is too small for one micro-batch of {unit} "
            f"sample(s) on some rank ({why}); raise it, shorten the samples, or enable the pipeline's "
            f"gradient_checkpointing"
        )
    run.say(f"algo.micro_batch_size=auto: {units * unit} samples per forward/backward ({why})")
    return units * unit


def _probe(run: Run, batch: Batch, idx: Tensor, ks: slice | None, adv: Tensor, mask: Tensor) -> int:
    """Peak bytes of one forward+backward of samples idx as the update runs it; leaves no gradient and no RNG draw."""
    acc = run.accelerator
    ref = None
    if run.cfg.algo.kl_coef > 0:
        with torch.no_grad():
            rows = run.policy.ref_logp(batch.rollout, idx)  # [n, K]
        if rows is not None:
            ref = torch.zeros(batch.rollout.old_logp.shape)  # [N, K], only rows idx are read
            ref[idx] = rows.float().cpu()

    def step() -> None:
        with sync_context(acc, run.model, last=False), acc.autocast():
            loss = _loss_for(run, batch, idx, ks, adv, mask, ref, torch.ones(()))[0]
            acc.backward(torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0))

    with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
        peak = peak_bytes(step, acc.device)
    run.optimizer.zero_grad(set_to_none=True)
    return peak


def _reward_metrics(run: Run, batch: Batch) -> dict[str, float]:
    real = slice(None) if batch.real is None else batch.real  # padding of smaller groups is no sample
    per = all_gather(run.accelerator, batch.per_reward[real])  # [N_global, R]
    out = {}
    for r, name in enumerate(run.reward_set.names):
        out[f"reward/{name}/mean"] = float(per[:, r].mean())
        out[f"reward/{name}/std"] = float(per[:, r].std()) if per.shape[0] > 1 else 0.0
    total = all_gather(run.accelerator, batch.total[real])
    out["reward/total_mean"], out["reward/total_std"] = float(total.mean()), float(total.std())
    return out


def _nonfinite_rewards(run: Run, batch: Batch) -> str | None:
    """None when every reward is finite on every rank, else which rewards and samples were not (same on all ranks)."""
    bad = ~torch.isfinite(batch.per_reward)  # [N, R]
    bad = (bad if batch.real is None else bad & batch.real[:, None]).nonzero().tolist()  # [[n, r], ...]
    bad_any = all_sum(run.accelerator, torch.tensor(float(len(bad)))).item()
    if not bad_any:
        return None
    g, first = run.cfg.sample.group_size, run.accelerator.process_index * batch.total.numel()
    mine = "; ".join(
        f"reward {run.reward_set.names[r]!r} on sample {first + n} (prompt {batch.prompts[n // g].get('prompt')!r})"
        for n, r in bad[:5]
    )
    return f"non-finite rewards ({int(bad_any)} values): {first_message(run.accelerator, mine or None)}"


def _nonfinite_loss(run: Run, batch: Batch, bad: list[int]) -> str:
    """Which samples made the loss NaN/Inf, from the lowest rank that saw any (every rank gets the same text)."""
    g, first = run.cfg.sample.group_size, run.accelerator.process_index * batch.total.numel()
    mine = "; ".join(f"sample {first + n} (prompt {batch.prompts[n // g].get('prompt')!r})" for n in bad[:5])
    where = first_message(run.accelerator, mine or None)
    return f"non-finite loss on {where}" if where else "non-finite gradient (every sample's loss was finite)"


def _samples(cfg: Config, batch: Batch) -> int:
    """Samples rolled out this step: the padding of smaller groups (knapsack allocation, one process) is none."""
    return cfg.sample.batch_size * batch.rounds if batch.real is None else int(batch.real.sum())


def _gallery(run: Run, batch: Batch, step: int, last: bool) -> None:
    every = run.cfg.run.gallery_every
    if not (step == 0 or last or (every and step % every == 0)) or not hasattr(run.policy, "gallery"):
        return
    if run.accelerator.is_main_process:
        items = run.policy.gallery(batch.rollout, batch.prompts, batch.total)
        save_gallery(run.run_dir / "gallery" / f"step_{step:08d}", items)


def _rollout_phase(run: Run, step: int) -> Batch:
    """Steps 1-2: prompts, G samples each, rewards; a failing reward saves a checkpoint and stops every rank."""
    if hasattr(run.policy, "set_iteration"):
        run.policy.set_iteration(step)  # schedules inside the policy (MixGRPO window) follow the step
    before = copy.deepcopy(run.sampler.state_dict())
    try:
        return collect(run, step)
    except RewardFailed as err:
        run.sampler.load_state_dict(before)  # the checkpoint resumes at this step, so it draws these prompts again
        path = save_checkpoint(run, step)
        raise TrainingStopped(
            f"stopped at step {step}: {err}; checkpoint saved as {path}; fix the reward, then resume from it",
            checkpoint=path,
        ) from err


def _learn_phase(run: Run, batch: Batch, step: int) -> tuple[dict[str, float], str | None]:
    """Steps 3-4 under this step's phase of algo.phases (run.cfg is the phase's for their length)."""
    base, run.cfg = run.cfg, phases.config_at(run.cfg, step)
    try:
        metrics, bad = _advantages_and_update(run, batch, step)
    finally:
        run.cfg = base
    if base.algo.phases:
        metrics["phase"] = float(phases.phase_index(base.algo.phases, step))
    with warnings.catch_warnings():  # a skipped (NaN) update still advances the schedule: lr = f(step)
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()
    return metrics, bad


def _advantages_and_update(run: Run, batch: Batch, step: int) -> tuple[dict[str, float], str | None]:
    """Group-relative advantages over the global batch, then clipped updates; the reason when skipped."""
    bad = _nonfinite_rewards(run, batch)
    metrics: dict[str, float] = {}
    if bad is None and run.cfg.algo.kl_reward_coef > 0:
        metrics.update(kl_into_reward(run, batch))
    if bad is None:
        t0 = time.perf_counter()
        adv, use, adv_stats = compute_advantages(run, batch, progress=step / run.cfg.run.steps)
        t1 = time.perf_counter()
        upd, ok, bad_samples = update(run, batch, adv, use, step)
        metrics.update({**adv_stats, **upd, "time/advantages": t1 - t0, "time/update": time.perf_counter() - t1})
        bad = None if ok else _nonfinite_loss(run, batch, bad_samples)
    return metrics, bad


def train_step(run: Run, step: int) -> tuple[Batch, dict[str, float], str | None]:
    """One GRPO iteration, the unit `train` loops over and `bench/` measures: roll out and score (steps 1-2), then
    advantages and clipped updates (3-4; skipped on NaN/Inf rewards, losses or gradients, with the reason returned).
    Logging, galleries, checkpoints and stop signals (step 5) stay in `train`. Returns (batch, metrics, reason)."""
    batch = _rollout_phase(run, step)
    metrics = {**batch.rollout.metrics, **_reward_metrics(run, batch), **run.sampler.metrics()}
    learned, bad = _learn_phase(run, batch, step)
    return batch, metrics | learned, bad


def train(cfg: Config) -> dict[str, Any]:
    """Run GRPO-style training as configured; returns the last step's metrics and the run directory."""
    run = setup(cfg)
    stop, last_metrics, finished, stopped, path = StopFlag().install(), {}, False, None, None
    try:
        for step in range(run.start_step, cfg.run.steps):
            t0 = time.perf_counter()
            # 1-4. sample prompts, roll out G samples per prompt, score them (refilling flat groups if asked), then
            # advantages and clipped updates (skipped on NaN/Inf rewards, losses or gradients)
            batch, metrics, bad = train_step(run, step)
            # 5. log, gallery, checkpoint, faults
            run.bad_streak = 0 if bad is None else run.bad_streak + 1
            if bad:
                run.say(f"step {step}: skipped the update: {bad}")
            secs = time.perf_counter() - t0
            metrics.update({f"time/{k}": v for k, v in batch.seconds.items()})
            metrics.update(
                {
                    "lr": run.scheduler.get_last_lr()[0],
                    "time/step": secs,
                    "skipped": float(bad is not None),
                    "perf/samples_per_sec": _samples(cfg, batch) / secs,
                    "rollout/rounds": batch.rounds,
                }
            )
            if run.accelerator.is_main_process and (step % cfg.run.log_every == 0 or step == cfg.run.steps - 1):
                run.outputs().log(step, metrics)
            run.progress(metrics)
            _gallery(run, batch, step, last=step == cfg.run.steps - 1)
            last_metrics, done = metrics, step + 1
            if run.bad_streak >= cfg.run.max_bad_steps:
                path = save_checkpoint(run, done)
                raise TrainingStopped(
                    f"stopped at step {step}: {run.bad_streak} consecutive steps skipped, the last "
                    f"for {bad}; checkpoint saved as {path}; lower optim.lr or check the reward, "
                    f"then resume from it",
                    checkpoint=path,
                )
            # a signal may reach one rank first: every rank must agree before the collective save
            stopping = any_rank(run.accelerator, stop.signal_name is not None)
            if stopping or (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0):
                path = save_checkpoint(run, done)
            if stopping:
                stopped = stop.signal_name or "a stop signal on another rank"
                run.say(
                    f"received {stopped}: checkpoint saved at step {done} as {path}; resume with run.resume={path}"
                )
                break
        else:
            path = save_checkpoint(run, cfg.run.steps)
        finished = True
    except TrainingStopped:
        run.finish_report()  # curves and samples up to the stop, for the post-mortem
        raise
    finally:
        stop.restore()
        run.close(together=finished)
    run.finish_report()
    return {"run_dir": str(run.run_dir), "metrics": last_metrics, "checkpoint": path, "stopped": stopped}
