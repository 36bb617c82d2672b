"""Seeing through what wraps the transformers model: peft (`unwrap`), and FSDP / accelerate sharding (whether
`generate` must run in lockstep over ranks, whether a vision cache hit would skip an all-gather).

A leaf of pipelines/vlm: the policy, the rollout backends, the vision cache and the data checks all build on it.
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel


def unwrap(hf: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or hf itself)."""
    return hf.get_base_model() if hasattr(hf, "get_base_model") else hf


def needs_synced_gpus(model: nn.Module, *, world_size: int | None = None, distributed_type: str | None = None) -> bool:
    """Whether `generate` must run with synced_gpus=True: the weights are FSDP-sharded over more than one rank.

    Under FSDP every forward all-gathers the sharded weights, so a rank whose samples all stopped must keep running
    (dummy) forwards until every rank is done, or the others hang in the all-gather. Sharded = a module of `model`
    is an FSDP2 `FSDPModule` or an FSDP1 `FullyShardedDataParallel` unit, or accelerate's state says FSDP.
    world_size / distributed_type default to torch.distributed's and accelerate's (tests pass them).
    """
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size <= 1:
        return False
    if distributed_type is None:
        distributed_type = _accelerate_distributed_type()
    return str(distributed_type).rsplit(".", 1)[-1].upper() == "FSDP" or fsdp_managed(model)


def fsdp_managed(model: nn.Module) -> bool:
    """Whether any module of `model` is FSDP-wrapped (FSDP2 fully_shard swaps in FSDPModule subclasses in place)."""
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _accelerate_distributed_type() -> str | None:
    """accelerate's distributed type when an Accelerator exists, else None (never creates accelerate state)."""
    try:
        # lazy: accelerate adds ~0.1 s to `import pipelines`; only the FSDP check needs it
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    return getattr(AcceleratorState, "_shared_state", {}).get("distributed_type")
