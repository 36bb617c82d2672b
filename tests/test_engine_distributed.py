"""The engine's multi-process paths: an FSDP2 checkpoint round trip on two CPU ranks and the launch checks
(DeepSpeed refused, prompts that do not split over the processes)."""

from pathlib import Path

import pytest

from mmgrpo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "toy_count.yaml")


FSDP_SCRIPT = """
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mmgrpo.runtime import full_tensors, load_optimizer_state, optimizer_state, shard_like

dist.init_process_group("gloo")
rank, path = dist.get_rank(), sys.argv[1]
acc = SimpleNamespace(distributed_type=DistributedType.FSDP)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def build(state=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    if state is not None:
        model.load_state_dict(state)  # as setup does: full weights go in before sharding
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def step(model, opt):
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


a, opt_a = build()
step(a, opt_a)
weights = full_tensors(dict(a.state_dict()))  # every rank joins the gather
state = optimizer_state(acc, a, SimpleNamespace(optimizer=opt_a))
if rank == 0:
    torch.save({"weights": weights, "optimizer": state}, path)
dist.barrier()
saved = torch.load(path, weights_only=False)
b, opt_b = build(saved["weights"])
load_optimizer_state(acc, b, SimpleNamespace(optimizer=opt_b), saved["optimizer"])
shadow = {k: v.detach().clone() * 0 for k, v in b.state_dict().items()}  # an EMA shadow laid out like the weights
for k, v in saved["weights"].items():
    shadow[k].copy_(shard_like(v, shadow[k]))
step(a, opt_a)
step(b, opt_b)
wa, wb, ws = full_tensors(dict(a.state_dict())), full_tensors(dict(b.state_dict())), full_tensors(shadow)
diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
ema_diff = max(float((ws[k] - saved["weights"][k]).abs().max()) for k in ws)
sharded = type(b[0].weight).__name__
if rank == 0:
    keys = sorted(saved["optimizer"]["state"])
    print(f"RESULT sharded={sharded} diff={diff:.3e} ema_diff={ema_diff:.3e} keys={keys}")
dist.barrier()  # without it a rank may tear down gloo while the other is still in it: 'terminate called' (2 in 20)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # the sharded modules still hold the gloo group; its teardown at interpreter exit can abort
"""


def test_fsdp2_checkpoint_state_round_trip(tmp_path, two_ranks):
    """Two CPU ranks under FSDP2: gathered weights and optimizer state, saved by rank 0 and restored into a freshly
    sharded model, continue exactly like the original (the checkpoint path setup.py takes under FSDP)."""
    script = tmp_path / "fsdp_round_trip.py"
    script.write_text(FSDP_SCRIPT)
    res = two_ranks(script, tmp_path / "state.pt")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    assert "sharded=DTensor" in line, line
    assert "diff=0.000e+00" in line and "ema_diff=0.000e+00" in line, line
    assert "keys=['0.bias', '0.weight', '2.bias', '2.weight']" in line, line


def test_deepspeed_launch_is_refused_with_the_alternatives():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from mmgrpo.errors import UserError
    from mmgrpo.setup import _check_launch

    cfg = load_config(RECIPE)
    _check_launch(cfg, SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_GPU))
    with pytest.raises(UserError, match="DeepSpeed steps the optimizer inside backward.*fsdp.yaml.*ddp.yaml"):
        _check_launch(cfg, SimpleNamespace(num_processes=2, distributed_type=DistributedType.DEEPSPEED))
    with pytest.raises(UserError, match="8 prompts per step cannot be split over 3 processes"):
        _check_launch(cfg, SimpleNamespace(num_processes=3, distributed_type=DistributedType.MULTI_GPU))
