"""The plumbing the training loop calls: accelerate setup, optimizer and schedule, EMA, seeds, signals, ranks.

Kept out of trainer.py so the loop reads top to bottom; nothing here knows a modality.
"""

import math
import os
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from torch.profiler import ProfilerActivity, profile

from mmgrpo.config import Config
from mmgrpo.errors import UserError


def make_accelerator(cfg: Config) -> Accelerator:
    """CPU unless CUDA is there (and asked for); mixed precision only with CUDA, so CPU runs stay exact fp32."""
    cuda = torch.cuda.is_available() and cfg.run.device != "cpu"
    precision = cfg.run.mixed_precision if cuda else "no"
    return Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        log_with=list(cfg.run.trackers) or None,
        project_dir=cfg.run.output_dir,
    )


def build_optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    if not params:
        raise ValueError("the policy has no trainable parameters; check the pipeline's LoRA/freeze settings")
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Linear warm-up to 1 over `warmup` steps, then constant, linear or cosine decay to 0 at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))


def build_scheduler(opt: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    o = cfg.optim
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=o.warmup_steps, total=cfg.run.steps, schedule=o.schedule)
    )


class EMA:
    """Exponential moving average of trainable weights: ema = decay * ema + (1 - decay) * w."""

    def __init__(self, named: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.named = named
        self.shadow = {k: p.detach().clone() for k, p in named.items()}

    @torch.no_grad()
    def update(self) -> None:
        for k, p in self.named.items():
            self.shadow[k].lerp_(p.detach(), 1.0 - self.decay)


def prompt_seed(seed: int, step: int, round_: int, position: int) -> int:
    """Seed of one prompt's group: a function of its global position only, so any rank count rolls out the same."""
    return (seed * 1_000_003 + step * 10_007 + round_ * 7_919 + position) % (2**62)


def shuffle_generator(seed: int, step: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 9_973 + step * 131 + epoch) % (2**62))


@dataclass
class StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint after the current step and exits cleanly."""

    signal_name: str | None = None
    _old: dict = field(default_factory=dict)

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.signal_name = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def sync_context(accelerator: Accelerator, model: torch.nn.Module, last: bool):
    """No gradient all-reduce until the last micro-batch of a mini-batch (DDP gradient accumulation)."""
    return nullcontext() if last or accelerator.num_processes == 1 else accelerator.no_sync(model)


def all_sum(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    if accelerator.num_processes == 1:
        return value
    return accelerator.reduce(value.to(accelerator.device).clone(), reduction="sum")


def all_gather(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    """Concatenate a per-rank tensor over ranks in rank order (rank r holds global prompts r*B_local...)."""
    if accelerator.num_processes == 1:
        return value
    return accelerator.gather(value.to(accelerator.device).contiguous()).cpu()


def any_rank(accelerator: Accelerator, flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (signals and faults must stop all ranks together)."""
    return all_sum(accelerator, torch.tensor(float(flag))).item() > 0


def first_message(accelerator: Accelerator, message: str | None) -> str | None:
    """The lowest rank's non-empty message, on every rank (so every rank stops with the same explanation)."""
    if accelerator.num_processes == 1:
        return message

    return next((m for m in gather_object([message]) if m), None)


def is_sharded(accelerator: Accelerator) -> bool:
    """FSDP shards weights and optimizer state over ranks; checkpoints then gather them collectively."""
    return accelerator.distributed_type == DistributedType.FSDP


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain full tensors from possibly sharded ones (FSDP2 DTensors): a collective, so every rank calls it."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def shard_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out like `target`: sharded the same way when target is a DTensor, else unchanged."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements)
    return value


def optimizer_state(accelerator: Accelerator, model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state to checkpoint; under FSDP the full state gathered from every rank (all ranks call)."""
    if not is_sharded(accelerator):
        return optimizer.state_dict()
    # lazy: torch.distributed.checkpoint is slow to import; only FSDP runs need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, state: dict) -> None:
    if not is_sharded(accelerator):
        optimizer.load_state_dict(state)
        return
    # lazy: torch.distributed.checkpoint is slow to import; only FSDP runs need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer.optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
    )


# ---- micro-batch sizing from a memory budget (algo.micro_batch_size=auto)


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes of tensors allocated while fn() runs, over those live when it starts.

    CUDA: torch.cuda.max_memory_allocated after a reset. CPU: torch.profiler(profile_memory=True) records every
    allocator event (+bytes on alloc, -bytes on free); the peak is the maximum of their running sum in time order,
    deterministic for a fixed program (tracemalloc does not see torch's CPU allocator)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise UserError(
            f"algo.micro_batch_size=auto measures memory on CUDA or the CPU, not on {device.type}; "
            f"set algo.micro_batch_size to a number"
        )

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # kineto prints start/stop and "no GPU" lines from C++ that a user need not read
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    return profiler_peak_bytes(prof)


def profiler_peak_bytes(prof) -> int:
    """The peak of the running sum of a finished torch.profiler(profile_memory=True) run's allocator events
    (+bytes on alloc, -bytes on free) in time order: peak bytes over what was live when it started."""
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(accumulate((nbytes for _, nbytes in events), initial=0))


@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (C++ logging bypasses sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def default_budget_bytes(device: torch.device) -> float:
    """Without algo.memory_budget_gb: 80% of the CUDA memory free now (what the caching allocator holds unused
    counts as free), or half of the RAM the kernel reports available on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.8 * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return 0.5 * kib * 1024
    except (OSError, StopIteration, ValueError):
        try:
            return 0.5 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            raise UserError(
                "algo.micro_batch_size=auto cannot read the available memory here; set algo.memory_budget_gb, e.g. 8"
            ) from None


def fit_micro_batch(peak_1: float, peak_2: float, budget: float, *, most: int) -> int:
    """Largest m in [1, most] whose predicted peak fits: fixed + m * per <= budget, from a probe's peaks at 1 and 2
    units (samples, or whole groups for group losses): per = peak_2 - peak_1, fixed = peak_1 - per (activations and
    their gradients grow linearly with the micro-batch; weight gradients are the fixed part).

    Raises ValueError when one unit does not fit."""
    per = peak_2 - peak_1
    fixed = peak_1 - per
    if fixed + max(per, 0.0) > budget:
        raise ValueError(f"one unit needs about {(fixed + max(per, 0.0)) / 1e9:.3g} GB")
    if per <= 0:  # no measurable growth (tiny models, allocator reuse): the largest is as cheap as one
        return most
    return max(1, min(most, math.floor((budget - fixed) / per)))
