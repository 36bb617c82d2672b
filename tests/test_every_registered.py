"""Every registered estimator, loss, prompt sampler, rollout allocator and flow plan trains two steps in the trainer.

The names come from the registries, so a new registration is covered without editing this file; `_SETUP` only says
what a name needs beyond the toy counting task's defaults (another pipeline, several rewards). Each run must change
the weights, keep every metric finite, and log the component's own metrics.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo import advantages, budget, checkpoint, losses, samplers
from mmgrpo.config import load_config
from mmgrpo.plugins import PIPELINES, load_plugins
from mmgrpo.trainer import train

load_plugins()  # pipelines register their own estimators ("tempsamp"), losses ("nft") and plans
from pipelines.flow.plan import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "configs" / "toy_count.yaml")
FLOW = str(ROOT / "configs" / "flow" / "sd3_tiny_cpu.yaml")
TOY_FAST = [
    "run.steps=2",
    "run.progress=false",
    "run.report=false",
    "run.checkpoint_every=0",
    "sample.batch_size=16",
    "sample.group_size=4",
    "algo.micro_batch_size=16",
    "algo.inner_epochs=1",
    "algo.num_minibatches=1",
]
TWO_REWARDS = "rewards=[{name: toy_count, weight: 1.0}, {name: toy_count, label: half, weight: 0.5}]"
FLOW_FAST = [
    "run.steps=2",
    "run.progress=false",
    "run.report=false",
    "run.checkpoint_every=0",
    "run.device=cpu",
    "run.mixed_precision=no",
    "optim.ema_decay=0.0",
    "pipeline.kwargs.prompts=[a red circle, a blue square]",
    "pipeline.kwargs.num_steps=4",
    "pipeline.kwargs.max_sequence_length=8",
    "pipeline.kwargs.k_chunk=null",
    "sample.batch_size=8",
    "sample.group_size=4",
    "algo.micro_batch_size=8",
    "optim.lr=1e-2",
]
_PLAN_KW = {
    "tree": "{split_steps: [0, 2], fanout: 2}",
    "fast": "{branch_range: [0, 2]}",
    "singular": "{branch_steps: [0, 1]}",
}

# what a name needs beyond the defaults: (recipe, overrides). Anything not listed runs on the toy task as is.
_SETUP = {
    ("advantage", "gdpo"): (TOY, [TWO_REWARDS]),
    ("advantage", "faithful"): (TOY, [TWO_REWARDS]),
    ("advantage", "grpo_bonus"): (TOY, [TWO_REWARDS]),
    ("advantage", "tempsamp"): (TOY, [TWO_REWARDS, "algo.advantage_kwargs={shaping: false}"]),
    ("loss", "guard_clipped"): (FLOW, ["pipeline.kwargs.ratio_norm=true", "pipeline.kwargs.step_weights=guard"]),
    ("loss", "nft"): (FLOW, ["pipeline.kwargs.objective=nft"]),
    ("loss", "reg_grpo"): (TOY, ["algo.aggregation=seq_mean_token_mean"]),
    ("loss", "dpo"): (TOY, ["algo.aggregation=seq_mean_token_mean"]),
    ("advantage", "verifier_pairs"): (TOY, ["algo.advantage_kwargs={margin: 0.1}"]),
    ("sampler", "mmr1_vas"): (TOY, ["sample.sampler_kwargs={diversity_weight: 0.2}"]),
    ("allocator", "knapsack"): (TOY, ["sample.sampler=vade", "sample.allocator_kwargs={budget: 12}"]),
}


def _cases() -> list[tuple[str, str]]:
    kinds = {
        "advantage": advantages.ADVANTAGES,
        "loss": losses.POLICY_LOSSES,
        "sampler": samplers.SAMPLERS,
        "plan": SCHEDULES,
        "allocator": budget.ALLOCATORS,
    }
    return [(kind, name) for kind, reg in kinds.items() for name in reg.names()]


def _overrides(kind: str, name: str, out: Path) -> tuple[str, list[str]]:
    recipe, extra = _SETUP.get((kind, name), (FLOW if kind == "plan" else TOY, []))
    base = [f"run.output_dir={out}", *(TOY_FAST if recipe == TOY else FLOW_FAST)]
    field = {
        "advantage": ["algo.advantage=" + name, "algo.advantage_kwargs={}"],
        "loss": ["algo.loss=" + name, "algo.loss_kwargs={}"],
        "sampler": ["sample.sampler=" + name],
        "plan": ["pipeline.kwargs.plan=" + name, f"pipeline.kwargs.plan_kwargs={_PLAN_KW.get(name, '{}')}"],
        "allocator": ["sample.allocator=" + name],
    }[kind]
    return recipe, [*base, *field, *extra]


def _initial_weights(cfg) -> dict[str, torch.Tensor]:
    torch.manual_seed(cfg.run.seed)
    task = PIPELINES.get(cfg.pipeline.name)(seed=cfg.run.seed, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    return {k: v.detach().clone() for k, v in task.policy.state_dict().items()}


def _loss_metrics(name: str, cfg) -> list[str]:
    """The metric names the loss itself returns on a tiny made-up batch (losses that need their pipeline's
    per-element inputs, such as DiffusionNFT's velocities, only promise loss/policy)."""
    logp = torch.zeros(4, 2)
    kw = {"group_size": 4} if losses.needs_groups(name) else {}
    try:
        _, metrics = losses.compute(
            name,
            logp,
            logp,
            torch.tensor([1.0, -1.0, 0.5, -0.5]),
            torch.ones(4, 2, dtype=torch.bool),
            **kw,
            **cfg.algo.loss_kwargs,
        )
    except (TypeError, ValueError, KeyError):
        return ["loss/policy"]
    return ["loss/policy", *metrics]


@pytest.mark.parametrize("kind,name", _cases(), ids=[f"{k}-{n}" for k, n in _cases()])
def test_trains_two_steps(kind, name, tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(ROOT / ".pytest_cache" / "mmgrpo"))
    torch.set_num_threads(1)
    recipe, extra = _overrides(kind, name, tmp_path)
    cfg = load_config(recipe, extra)
    init = _initial_weights(cfg)
    out = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["skipped"] == 0.0 for r in rows)
    bad = {k: v for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    final = load_file(str(checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1] / "weights.safetensors"))
    assert any(not torch.equal(final[k], init[k]) for k in final), "two updates changed no trainable weight"
    last = out["metrics"]
    own = {"advantage": [f"adv/{name}/nonzero_frac"], "sampler": ["sampler/"], "plan": ["ratio/k"]}.get(kind)
    own = ["rollout/"] if kind == "allocator" else own
    own = own or _loss_metrics(name, cfg)
    missing = [m for m in own if not any(k.startswith(m) for k in last)]
    assert not missing, f"no {missing} metric in {sorted(last)}"
    if kind == "advantage":
        assert 0.0 < last[f"adv/{name}/nonzero_frac"] <= 1.0  # some sample was pushed somewhere
