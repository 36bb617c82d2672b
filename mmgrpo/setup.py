"""Building a run (pipeline, rewards, optimizer, sampler, accelerate, resume) and saving it again.

The `Run` holds everything the loop touches; `setup` validates paths and restores a checkpoint before step one.
"""

import copy
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from mmgrpo import checkpoint, rundir, sampling
from mmgrpo.config import Config
from mmgrpo.errors import UserError
from mmgrpo.plugins import PIPELINES, load_plugins
from mmgrpo.report import write_report
from mmgrpo.reward import RewardSet
from mmgrpo.runtime import (
    EMA,
    build_optimizer,
    build_scheduler,
    full_tensors,
    is_sharded,
    load_optimizer_state,
    make_accelerator,
    optimizer_state,
    shard_like,
)
from mmgrpo.tracking import MetricsLog
from mmgrpo.types import Task


@dataclass
class Run:
    cfg: Config
    accelerator: Accelerator
    task: Task
    policy: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    sampler: Any
    reward_set: Any
    ema: EMA | None
    run_dir: Path
    ckpt_root: Path
    metrics_log: MetricsLog | None
    start_step: int = 0
    bad_streak: int = 0
    last_saved: int = -1
    bar: Any = None
    micro_batch_size: int | None = None
    """samples per forward/backward; None until algo.micro_batch_size=auto is resolved at the first update"""
    run_id: str | None = None
    """recorded in every checkpoint's manifest; a checkpoint is pruned only by the run (lineage) that wrote it"""
    saved_metrics: str | None = None
    """the resumed checkpoint's metrics.jsonl (None: a fresh run); read when the outputs are opened"""
    adv_state: dict = field(default_factory=dict)
    """estimator name -> the keyword values its `update` hook returned (FGRPO's multipliers); checkpointed"""

    def outputs(self) -> MetricsLog:
        """config.yaml and metrics.jsonl, written only when there is something to record (the first log or save),
        so a run that fails before its first step leaves a resumed run's files as they were. Rank 0 only."""
        if self.metrics_log is None:
            self.cfg.save(self.run_dir / "config.yaml")
            resumed = self.saved_metrics is not None
            self.metrics_log = MetricsLog(
                self.run_dir, self.accelerator, self.start_step if resumed else None, saved=self.saved_metrics or ""
            )
        return self.metrics_log

    def say(self, msg: str) -> None:
        if self.accelerator.is_main_process:
            if self.bar is not None:
                self.bar.write(msg)
            else:
                print(msg, flush=True)

    def progress(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            kl = metrics.get("kl/ref", metrics.get("kl/old_approx"))  # without a reference: to old
            shown = {"reward": f"{metrics.get('reward/total_mean', float('nan')):.3f}"}
            if kl is not None:  # likelihood-free objectives (DiffusionNFT) log no KL: show none rather than nan
                shown["kl"] = f"{kl:.4f}"
            self.bar.set_postfix(**shown)

    def close(self, together: bool = False) -> None:
        """Stop trackers and tear down the process group; `together` when every rank got here together."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if together:  # a rank that destroys its group while another still talks to it aborts that rank (gloo)
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def finish_report(self) -> None:
        """report.html, when this run recorded anything (a stop before its first log leaves the old report)."""
        if self.cfg.run.report and self.accelerator.is_main_process and self.metrics_log is not None:
            path = write_report(self.run_dir, yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
            self.say(f"report: {path}")


def build_task(cfg: Config, device: torch.device) -> Task:
    load_plugins(cfg.run.plugins)
    builder = PIPELINES.get(cfg.pipeline.name)
    task = builder(seed=cfg.run.seed, device=device, dtype=torch.float32, **cfg.pipeline.kwargs)
    if not task.train_data:
        raise UserError(
            f"pipeline {cfg.pipeline.name!r} produced an empty training set; check pipeline.kwargs "
            f"(data path, split) so that it yields at least one prompt"
        )
    return task


def build_rewards(cfg: Config, task: Task, device: torch.device) -> RewardSet:
    load_plugins(cfg.run.plugins)  # the rewards named here register when their packages are imported
    specs = [
        {"name": s.name, "weight": s.weight, "kwargs": s.kwargs, "label": s.label or s.name} for s in cfg.rewards
    ] or task.rewards
    if not specs:
        raise UserError(
            f"no rewards configured and pipeline {cfg.pipeline.name!r} has no default; add a "
            f"`rewards:` list, e.g. [{{name: format, weight: 1.0}}]"
        )
    reward_set = RewardSet(specs, device=device)
    if hasattr(task.policy, "set_reward_inputs"):  # flow: no VAE decode when every reward reads latents
        try:
            task.policy.set_reward_inputs([r.input for r in reward_set.rewards])
        except ValueError as err:
            raise UserError(f"rewards: {err}") from None
    return reward_set


def compile_module(cfg: Config, module: torch.nn.Module, acc: Accelerator) -> bool:
    """run.compile: torch.compile the trainable module in place (nn.Module.compile keeps its parameter names, so
    checkpoints and the optimizer see the same weights); skipped with one line on the CPU unless forced."""
    if not cfg.run.compile:
        return False
    if acc.device.type == "cpu" and cfg.run.compile != "force":
        if acc.is_main_process:
            print(
                "run.compile=true: skipped on the CPU (compiling needs a C++ toolchain there and warms up slowly); "
                "set run.compile=force to compile anyway",
                flush=True,
            )
        return False
    try:
        # lazy: torch._dynamo takes ~1 s to import; only run.compile needs it
        import torch._dynamo

        supported = torch._dynamo.is_dynamo_supported()
    except ImportError:
        supported = False
    if not supported:
        raise UserError(
            f"run.compile={cfg.run.compile}: torch.compile is not supported with this Python and torch "
            f"({torch.__version__}); set run.compile=false"
        )
    try:
        module.compile(**cfg.run.compile_kwargs)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(
            f"run.compile_kwargs ({cfg.run.compile_kwargs}): {err}; use torch.compile's keywords "
            f"(mode, dynamic, fullgraph, backend, options)"
        ) from None
    return True


def _prepare_dirs(cfg: Config) -> tuple[Path, Path]:
    run_dir = Path(cfg.run.output_dir)
    rundir.claim(cfg)  # before anything is built or written: a directory holding another run is refused
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # one probe per process: ranks share the directory, and a shared name lets one rank unlink another's
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"run.output_dir ({cfg.run.output_dir!r}) cannot be written ({err.strerror}); choose a "
            f"writable directory, e.g. run.output_dir=runs/my_run"
        ) from None
    return run_dir, run_dir / "checkpoints"


def _check_launch(cfg: Config, acc: Accelerator) -> None:
    b_prompts = cfg.sample.batch_size // cfg.sample.group_size
    if b_prompts % acc.num_processes:
        raise UserError(
            f"sample.batch_size / sample.group_size = {b_prompts} prompts per step cannot be split over "
            f"{acc.num_processes} processes; make it a multiple of {acc.num_processes}"
        )
    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise UserError(
            "accelerate config: DeepSpeed steps the optimizer inside backward(), which the mmgrpo loop "
            "cannot use (it accumulates micro-batches and skips NaN updates itself); launch with "
            "configs/accelerate/fsdp.yaml (sharded) or configs/accelerate/ddp.yaml instead"
        )


def setup(cfg: Config) -> Run:
    """Everything before step one: dirs, accelerate, the pipeline's task, rewards, optimizer, resume."""
    run_dir, ckpt_root = _prepare_dirs(cfg)
    acc = make_accelerator(cfg)
    _check_launch(cfg, acc)
    torch.manual_seed(cfg.run.seed)
    task = build_task(cfg, acc.device)
    reward_set = build_rewards(cfg, task, acc.device)
    if cfg.run.overwrite:
        _overwrite(run_dir, acc)
    ckpt = _find_checkpoint(cfg, acc, ckpt_root)
    data = checkpoint.load(ckpt, acc.process_index) if ckpt is not None else None
    if data is not None:
        task.policy.load_state_dict(data["weights"])  # before prepare, which may shard what is loaded (FSDP)
    compile_module(cfg, task.module, acc)
    model, optimizer = acc.prepare(task.module, build_optimizer(list(task.policy.trainable_parameters()), cfg))
    names = {id(p): n for n, p in task.module.named_parameters()}
    params = list(task.policy.trainable_parameters())  # after prepare: FSDP swaps in sharded parameters
    ema = EMA({names[id(p)]: p for p in params}, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
    sampler = sampling.make_sampler(
        cfg.sample.sampler, len(task.train_data), seed=cfg.run.seed, **cfg.sample.sampler_kwargs
    )
    if hasattr(task.policy, "defer_old_logp"):
        # one epoch of one mini-batch updates the weights once, after every forward: the old log-probs equal the
        # first forward's, so the rollout may skip its no-grad scoring pass (TRL does this when num_iterations=1)
        task.policy.defer_old_logp = cfg.algo.inner_epochs == 1 and cfg.algo.num_minibatches == 1
    run = Run(
        cfg,
        acc,
        task,
        task.policy,
        model,
        optimizer,
        build_scheduler(optimizer, cfg),
        sampler,
        reward_set,
        ema,
        run_dir,
        ckpt_root,
        None,
    )
    run.micro_batch_size = None if cfg.algo.micro_batch_size == "auto" else cfg.algo.micro_batch_size
    same_dir = ckpt is not None and ckpt.resolve().parent == ckpt_root.resolve()
    run.run_id = checkpoint.owner(ckpt) if same_dir else uuid.uuid4().hex[:12]  # continuing its lineage, or a new one
    if data is not None:
        _restore(run, ckpt, data)
    if acc.is_main_process:
        run.saved_metrics = data["metrics_jsonl"] if data is not None else None
        if cfg.run.trackers:
            acc.init_trackers(run_dir.name, config=_flat(cfg.to_dict()))
    if cfg.run.progress and acc.is_main_process:
        run.bar = tqdm(total=cfg.run.steps, initial=run.start_step, desc="mmgrpo", dynamic_ncols=True)
    return run


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _config_changes(saved: Path, cfg: Config) -> str:
    """Fields that differ from the checkpoint's config ("run.steps: 60 -> 100"), so a resumed run says what changed."""
    if not saved.is_file():
        return ""
    old, new = _flat(yaml.safe_load(saved.read_text()) or {}), _flat(cfg.to_dict())
    diffs = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k not in ("run.resume", "run.output_dir")
    ]
    return ", ".join(diffs[:8]) + (f" and {len(diffs) - 8} more" if len(diffs) > 8 else "")


def _overwrite(run_dir: Path, acc: Accelerator) -> None:
    """run.overwrite=true: the earlier run goes only now, after this run's model and rewards were built."""
    if acc.is_main_process:
        gone = rundir.clear(run_dir)
        if gone:
            print(f"run.overwrite=true: deleted the earlier run's {', '.join(gone)} in {run_dir}", flush=True)
    acc.wait_for_everyone()


def _find_checkpoint(cfg: Config, acc: Accelerator, root: Path) -> Path | None:
    """The checkpoint to resume from: the newest valid one (resume=auto), a given one, or None."""
    if acc.is_main_process:
        checkpoint.clear_tmp(root)
    acc.wait_for_everyone()
    if cfg.run.resume == "never" or (cfg.run.resume == "auto" and cfg.run.overwrite):
        return None

    def say(msg: str) -> None:
        if acc.is_main_process:
            print(msg, flush=True)

    path = checkpoint.latest_valid(root, log=say) if cfg.run.resume == "auto" else Path(cfg.run.resume)
    if path is None:
        return None
    reason = checkpoint.check(path)
    if reason:
        raise UserError(f"run.resume ({str(path)!r}) is not a valid checkpoint: {reason}; pass another one or auto")
    return path


def _restore(run: Run, path: Path, data: dict[str, Any]) -> None:
    """Optimizer, schedule, sampler, EMA, RNG and counters of a checkpoint (the weights were loaded before prepare)."""
    st = data["state"]
    load_optimizer_state(run.accelerator, run.model, run.optimizer, st["optimizer"])
    run.scheduler.load_state_dict(st["scheduler"])
    run.sampler.load_state_dict(st["sampler"])
    run.adv_state = copy.deepcopy(st.get("advantage_state", {}))
    if run.ema is not None and "ema" in data:
        for k, v in data["ema"].items():
            run.ema.shadow[k].copy_(shard_like(v, run.ema.shadow[k]))
    if data["rng"] is not None:
        checkpoint.set_rng_state(data["rng"])
    run.start_step, run.bad_streak, run.last_saved = st["step"], st.get("bad_streak", 0), st["step"]
    changed = _config_changes(path / "config.yaml", run.cfg)
    run.say(f"resumed from {path} at step {st['step']}" + (f" (config changed since: {changed})" if changed else ""))


def save_checkpoint(run: Run, step: int) -> Path:
    """Atomic save: every rank writes its RNG file, rank 0 writes the rest, then rank 0 renames the directory.

    Under FSDP every rank joins in gathering the sharded weights, EMA and optimizer state; otherwise only rank 0
    copies them (a full copy per rank would cost each GPU the model's size)."""
    final = run.ckpt_root / f"{checkpoint.PREFIX}{step:08d}"
    if step == run.last_saved:
        return final
    acc, main = run.accelerator, run.accelerator.is_main_process
    acc.wait_for_everyone()
    checkpoint.write_rank_files(run.ckpt_root, step, acc.process_index)
    if main or is_sharded(acc):
        weights = full_tensors(run.policy.state_dict())
        ema = full_tensors(run.ema.shadow) if run.ema is not None else None
        state = {
            "step": step,
            "bad_streak": run.bad_streak,
            "optimizer": optimizer_state(acc, run.model, run.optimizer),
            "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict(),
            "advantage_state": copy.deepcopy(run.adv_state),
        }
    if main:
        # the export hook reads the policy's own (unsharded) weights, so sharded runs go without it
        export = None if is_sharded(acc) else getattr(run.policy, "export", None)
        checkpoint.write_main_files(
            run.ckpt_root,
            step,
            weights=weights,
            state=state,
            config_yaml=yaml.safe_dump(run.cfg.to_dict(), sort_keys=False),
            ema=ema,
            metrics_jsonl=run.outputs().text(),
            export=export,
        )
    acc.wait_for_everyone()
    if main:
        checkpoint.finalize(run.ckpt_root, step, run.cfg.run.keep_last, run.run_id)
    acc.wait_for_everyone()
    run.last_saved = step
    return final
