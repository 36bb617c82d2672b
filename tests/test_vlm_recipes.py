"""Every configs/vlm recipe validates, and two `mmgrpo.trainer.train` steps of each on tiny random Qwen2-VL,
Qwen2.5-VL and Qwen3-VL keep the loss finite and change the trainable weights (the TRL "params changed" pattern)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines.vlm  # noqa: F401  registers "vlm" until pipelines/__init__ imports it
from mmgrpo import checkpoint
from mmgrpo.config import load_config
from mmgrpo.trainer import train
from rewards.api import REWARDS, FunctionReward

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "vlm").glob("*.yaml"))


def _letters(samples, prompts=None):
    """Share of ASCII letters in the text: varies between random completions, so advantages are non-zero."""
    return [sum(c.isascii() and c.isalpha() for c in s) / max(len(s), 1) for s in samples]


def _letters_reward() -> FunctionReward:
    """Test reward: share of ASCII letters in the completion (text, range [0, 1])."""
    return FunctionReward(_letters, name="vlm_test_letters", preprocess="counts ASCII letters")


if "vlm_test_letters" not in REWARDS:
    REWARDS.register("vlm_test_letters", _letters_reward)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_models"))


def _tiny(cache: str, out: Path, model: str) -> list[str]:
    """Overrides that shrink any VLM recipe to a CPU smoke run on a tiny random model of the same classes."""
    return [
        f"run.output_dir={out}",
        "run.steps=2",
        "run.progress=false",
        "run.report=false",
        "run.device=cpu",
        "run.mixed_precision=no",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"pipeline.kwargs.model={model}",
        f"pipeline.kwargs.cache_dir={cache}",
        "pipeline.kwargs.data=shapes_vqa",
        "pipeline.kwargs.eval_data=null",
        "pipeline.kwargs.train_size=8",
        "pipeline.kwargs.eval_size=2",
        "pipeline.kwargs.model_dtype=null",
        "pipeline.kwargs.min_pixels=null",
        "pipeline.kwargs.max_pixels=null",
        "pipeline.kwargs.max_new_tokens=8",
        "pipeline.kwargs.skip_bad_images=false",
        "sample.batch_size=8",
        "sample.group_size=4",
        "algo.micro_batch_size=4",
        "algo.num_minibatches=1",
        "optim.warmup_steps=0",
        "rewards=[{name: vlm_test_letters, weight: 1.0}]",
    ]


def test_every_recipe_validates():
    assert {p.name for p in RECIPES} >= {"shapes_vqa.yaml", "qwen25vl_3b_geometry.yaml", "qwen25vl_7b_mathvision.yaml"}
    for path in RECIPES:
        cfg = load_config(path)
        assert cfg.pipeline.name == "vlm"
        text = path.read_text()
        assert text.startswith("#") and "Run:" in text  # header: how to run it and what to expect


def _initial_weights(cfg) -> dict[str, torch.Tensor]:
    from pipelines.vlm.build import build_vlm

    task = build_vlm(seed=cfg.run.seed, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    return task.policy.state_dict()


def _same_class(recipe: Path) -> str:
    """The tiny random model of the recipe's own model class (assets/shapes-vlm is a Qwen2-VL)."""
    model = load_config(recipe).pipeline.kwargs["model"].lower()
    if "qwen3-vl" in model:
        return "tiny-random-qwen3-vl"
    return "tiny-random-qwen2.5-vl" if "qwen2.5-vl" in model else "tiny-random-qwen2-vl"


def test_recipes_run_on_tiny_models_of_their_class():
    assert {r.name: _same_class(r) for r in RECIPES} == {
        "qwen25vl_3b_geometry.yaml": "tiny-random-qwen2.5-vl",
        "qwen25vl_7b_mathvision.yaml": "tiny-random-qwen2.5-vl",
        "shapes_vqa.yaml": "tiny-random-qwen2-vl",
        "shapes_vqa_arithmetic.yaml": "tiny-random-qwen2-vl",
        "shapes_vqa_flags.yaml": "tiny-random-qwen2-vl",
        "shapes_vqa_lists.yaml": "tiny-random-qwen2-vl",
        "shapes_vqa_reading.yaml": "tiny-random-qwen2-vl",
    }


@pytest.mark.parametrize(
    "recipe,model",
    [(r.name, _same_class(r)) for r in RECIPES]
    + [("shapes_vqa.yaml", "tiny-random-qwen2.5-vl"), ("shapes_vqa.yaml", "tiny-random-qwen3-vl")],
)
def test_two_training_steps_change_weights(cache, tmp_path, recipe, model):
    cfg = load_config(ROOT / "configs" / "vlm" / recipe, _tiny(cache, tmp_path, model))
    before = _initial_weights(cfg)
    out = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["skipped"] == 0.0 and torch.isfinite(torch.tensor(r["loss/policy"]))
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)  # first step is on-policy
    assert out["metrics"]["rollout/length_mean"] > 0
    after = load_file(str(checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1] / "weights.safetensors"))
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no trainable weight changed in two steps"
    if cfg.pipeline.kwargs.get("lora_rank", 0):
        assert all("lora_" in k for k in before)
        assert all(k in changed for k in before if "lora_B" in k)  # B starts at 0 and gets the first gradient


def test_deferred_old_logp_trains_exactly_like_scored(cache, tmp_path, monkeypatch):
    """On-policy (one epoch, one mini-batch) the rollout skips its no-grad scoring pass and the loss uses the update's
    own detached log-probs; the weights after two steps equal those of a run that scores old log-probs."""
    from pipelines.vlm.policy import VLMPolicy

    def run(out: Path) -> dict[str, torch.Tensor]:
        cfg = load_config(ROOT / "configs" / "vlm" / "shapes_vqa.yaml", _tiny(cache, out, "tiny-random-qwen2-vl"))
        train(cfg)
        return load_file(str(checkpoint.list_checkpoints(out / "checkpoints")[-1] / "weights.safetensors"))

    calls = []
    score = VLMPolicy._score
    monkeypatch.setattr(VLMPolicy, "_score", lambda self, *a, **k: calls.append(1) or score(self, *a, **k))
    deferred = run(tmp_path / "deferred")
    assert not calls  # no scoring pass at all
    monkeypatch.setattr(VLMPolicy, "defer_old_logp", property(lambda self: False, lambda self, v: None), raising=False)
    scored = run(tmp_path / "scored")
    assert calls
    assert deferred.keys() == scored.keys()
    worst = max(float((deferred[k] - scored[k]).abs().max()) for k in scored)
    # Adam moves a weight by about lr = 1e-3 a step; the scored run's old log-probs come from a differently batched
    # forward (ratio 1 +- 1e-7, measured difference 1.9e-6 after two steps), so 1e-5 is 1% of one step
    assert worst < 1e-5, worst
