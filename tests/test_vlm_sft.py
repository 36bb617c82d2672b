"""TON's thought-dropout SFT stage (arXiv:2505.16854) on a tiny random Qwen2-VL: the loss is the token-mean NLL of the
targets (checked against the HF model's own logits), a few steps fit the targets, and the CLI saves a model (LoRA
merged) that the GRPO recipe loads as pipeline.kwargs.model."""

from pathlib import Path

import pytest
import torch

from mmgrpo.errors import UserError
from pipelines.vlm.build import build_vlm
from pipelines.vlm.methods import thought_dropout
from pipelines.vlm.sft import main, sft_batch, sft_loss, thought_dropout_sft

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_sft_models"))


def _task(cache, **kw):
    return build_vlm(
        seed=0, device=CPU, model="tiny-random-qwen2-vl", cache_dir=cache, train_size=4, eval_size=1, **kw
    )


def _records(task):
    reasons = ["count the circles", "look at the colour", "add them up", "compare sizes"]
    return [{**r, "reasoning": why} for r, why in zip(task.train_data, reasons)]


def test_sft_loss_is_the_token_mean_nll_of_the_targets(cache):
    task = _task(cache)
    pol, hf = task.policy, task.module.hf
    recs = thought_dropout(_records(task)[:3], p=0.5, seed=3)
    assert len({len(r["target"]) for r in recs}) > 1  # unequal target lengths
    loss = sft_loss(pol, recs)
    # independently: each [prompt | target + EOS] through the HF model, logits at positions lp-1 .. lp+m-2
    encs, comps, lengths = sft_batch(pol, recs)
    total, count = 0.0, 0
    for enc, c, m in zip(encs, comps, lengths.tolist()):
        ids = torch.cat([enc["input_ids"], c[None, :m]], 1)
        mm = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, m, dtype=torch.long)], 1)
        inputs = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, **inputs).logits[0]
        lp = enc["input_ids"].shape[1]
        step = logits[lp - 1 : lp + m - 1].double()  # [m, V]
        step[:, task.module.suppress_ids] = float("-inf")  # placeholders are outside the policy's distribution
        total -= float(step.log_softmax(-1).gather(-1, c[:m, None]).sum())
        count += m
    assert comps[0, lengths[0] - 1] == pol.tokenizer.eos_token_id  # the target ends with EOS, which is trained
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-5)


def test_thought_dropout_sft_fits_the_targets(cache):
    task = _task(cache)
    losses = thought_dropout_sft(task.policy, _records(task), steps=12, p=0.5, lr=1e-2, batch_size=4, seed=0)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses  # random model: about log(267) = 5.6 nats at the start
    with pytest.raises(UserError, match="steps"):
        thought_dropout_sft(task.policy, _records(task), steps=0)


def test_cli_saves_a_merged_model_the_grpo_recipe_loads(cache, tmp_path):
    out = tmp_path / "ton_sft"
    overrides = [
        "pipeline.kwargs.model=tiny-random-qwen2-vl",
        f"pipeline.kwargs.cache_dir={cache}",
        "pipeline.kwargs.train_size=4",
        "pipeline.kwargs.eval_size=1",
        "pipeline.kwargs.lora_rank=4",
    ]
    losses = main(
        [
            str(ROOT / "configs" / "vlm" / "shapes_vqa.yaml"),
            *overrides,
            "--out",
            str(out),
            "--steps",
            "3",
            "--lr",
            "1e-2",
            "--batch-size",
            "2",
        ]
    )
    assert len(losses) == 3
    sft = build_vlm(seed=0, device=CPU, model=str(out), train_size=4, eval_size=1)
    fresh = _task(cache)
    recs = thought_dropout(_records(fresh)[:2], p=0.0)
    sft.module.eval()
    fresh.module.eval()
    with torch.no_grad():
        trained, untrained = float(sft_loss(sft.policy, recs)), float(sft_loss(fresh.policy, recs))
    assert trained < untrained  # the saved directory holds the SFT weights (LoRA merged), not the random start
    assert not any("lora" in n for n, _ in sft.module.hf.named_parameters())
