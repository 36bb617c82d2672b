"""FlowPolicy.for_evaluation: `mmgrpo eval` / `sample` roll out as `python -m pipelines.flow.compare` does
(deterministic ODE, one independent initial noise per sample, fixed seeds), whatever the recipe trains with."""

from pathlib import Path

import pytest
import torch

import pipelines.flow  # noqa: F401
from mmgrpo.config import load_config
from mmgrpo.evaluate import evaluate
from pipelines.flow.build import tiny_task
from pipelines.flow.compare import EVAL_OVERRIDES
from pipelines.flow.policy import FlowPolicy

PROMPTS = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]


def _policy(path, **kw):
    return tiny_task(path, guidance_scale=2.0, **kw)


@pytest.mark.parametrize(
    "train_kw",
    [
        {"plan": "tree", "plan_kwargs": {"split_steps": [0, 2]}, "same_noise_per_group": True, "noise_level": 0.7},
        {"plan": "fast", "plan_kwargs": {"sde_steps": 1}, "sde": "dance", "noise_level": 0.3},
        {"objective": "nft", "same_noise_per_group": True},
    ],
)
def test_evaluation_rollout_is_compare_sampling(tiny_sd3, train_kw):
    task = _policy(tiny_sd3, **train_kw)
    pol = task.policy
    pol.for_evaluation()
    ro = pol.rollout(PROMPTS, 4, [5, 6])
    # what compare's overrides build: noise_level 0, independent plan training every step, objective grpo
    ref = _policy(
        tiny_sd3,
        **{
            **train_kw,
            "noise_level": 0.0,
            "plan": "independent",
            "plan_kwargs": {"train": "all"},
            "objective": "grpo",
            "same_noise_per_group": False,
        },
    ).policy
    want = ref.rollout(PROMPTS, 4, [5, 6])
    for a, b in zip(ro.samples, want.samples):
        assert torch.equal(a, b)
    assert torch.equal(pol.rollout(PROMPTS, 4, [5, 6]).extras["x_next"], ro.extras["x_next"])  # fixed seeds
    ex = ro.extras
    x0 = ex["x_t"][:, 0].flatten(1)  # [N, D] initial noises: all distinct (no group shares one)
    assert torch.cdist(x0, x0).add(1e9 * torch.eye(len(x0))).min() > 1.0
    assert not ro.mask.any()  # std 0 at every step: nothing stochastic to score
    # every transition is the deterministic Euler step x + (sigma_next - sigma) v of the same guided velocity
    cond = {key[5:]: v for key, v in ex.items() if key.startswith("cond_")}
    for j in range(ex["x_t"].shape[1]):
        v = pol.model.velocity(task.module, ex["x_t"][:, j], ex["sigma"][:, j], cond)
        dt = (ex["sigma_next"][:, j] - ex["sigma"][:, j]).view(-1, *[1] * (v.dim() - 1))  # [N, 1, ...]
        euler = ex["x_t"][:, j] + dt * v
        torch.testing.assert_close(ex["x_next"][:, j], euler, rtol=0, atol=1e-5)


def test_mmgrpo_eval_of_a_tree_recipe_equals_compare(tmp_path, monkeypatch):
    # evaluate() calls for_evaluation: a BranchGRPO recipe evaluated as is scores exactly as with compare's overrides
    monkeypatch.setenv("MMGRPO_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mmgrpo"))
    over = [
        f"run.output_dir={tmp_path}",
        "run.device=cpu",
        "run.mixed_precision=no",
        "pipeline.kwargs.model=tiny:flux",
        "pipeline.kwargs.data=null",
        "pipeline.kwargs.prompts=[a red circle, a blue square]",
        "pipeline.kwargs.resolution=32",
        "pipeline.kwargs.num_steps=4",
        "pipeline.kwargs.max_sequence_length=8",
        "pipeline.kwargs.torch_dtype=null",
        "pipeline.kwargs.gradient_checkpointing=false",
        "pipeline.kwargs.plan_kwargs={split_steps: [0, 2], fanout: 2}",
        "sample.group_size=4",
        "rewards=[{name: jpeg_compressibility}]",
    ]
    recipe = "configs/flow/flux_branchgrpo.yaml"
    as_trained = evaluate(load_config(recipe, over), "none", group_size=4)
    as_compare = evaluate(load_config(recipe, [*over, *EVAL_OVERRIDES]), "none", group_size=4)
    assert as_trained == as_compare and "jpeg_compressibility" in as_trained["all"]
    monkeypatch.delattr(FlowPolicy, "for_evaluation")  # without the hook: the tree's SDE rollouts, other scores
    assert evaluate(load_config(recipe, over), "none", group_size=4) != as_trained
