"""Is the shipped VLM looking? Fixed test questions scored through the RL code (VLMPolicy.rollout and the policy
module's prefix-shared log-prob forward with the vision-feature cache on) with real and with blank images: if the
pixels stop reaching the model anywhere on that path, the real-image advantage closes and these tests fail.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from mmgrpo_shapes.programs.pretrain_vlm import target_text
from mmgrpo_shapes.scenes import BACKGROUND
from mmgrpo_shapes.vqa import TEMPLATE_ANSWERS, question_template

ROOT = Path(__file__).resolve().parents[1]
VLM = ROOT / "assets" / "shapes-vlm"
N = 32
"""the first N colour and shape test questions (seed 0): the types the shipped model reads best from the pixels"""


@pytest.fixture(scope="module")
def task():
    from pipelines.vlm.build import build_vlm

    # freeze_vision keeps the vision-feature cache on (it is off while the tower trains); prefix sharing forced on
    return build_vlm(
        seed=0,
        device=torch.device("cpu"),
        model=str(VLM),
        data="shapes_vqa",
        train_size=2,
        eval_size=1,
        max_new_tokens=24,
        prefix_sharing="on",
        vision_cache="auto",
        freeze_vision=True,
        check_logp=True,
        question_types=["color", "shape"],
    )


@pytest.fixture(scope="module")
def records():
    from pipelines.vlm.data import shapes_vqa_records

    return shapes_vqa_records("test", N, seed=0, question_types=["color", "shape"])


def _blank(records):
    return [dict(r, image=np.full_like(r["image"], BACKGROUND)) for r in records]


@torch.no_grad()
def _choices(task, records) -> tuple[float, list[Tensor]]:
    """Each question's answer = the candidate (every answer of its template) whose SFT completion has the highest
    log-prob under the policy module's forward: one prefix-shared group of candidates per prompt."""
    policy, tok = task.policy, task.policy.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    right, scores = 0, []
    for rec in records:
        cands = TEMPLATE_ANSWERS[rec["category"]][question_template(rec["prompt"])]
        ids = [
            tok(target_text("vqa", {"category": rec["category"], "answers": a}), add_special_tokens=False)["input_ids"]
            + [end]
            for a in cands
        ]
        k = max(map(len, ids))
        comp = torch.tensor([x + [tok.pad_token_id] * (k - len(x)) for x in ids])  # [C, K]
        lengths = torch.tensor([len(x) for x in ids])  # [C]
        enc = policy.encode(rec)
        logp, _ = task.module([enc] * len(cands), comp, lengths)  # [C, K]
        mask = torch.arange(k)[None] < lengths[:, None]  # [C, K]
        scores.append((logp * mask).sum(1))  # [C] log-prob of each candidate's completion
        right += cands[int(scores[-1].argmax())] == rec["answers"]
    return right / len(records), scores


def test_blank_images_score_far_below_real_ones_in_the_update_forward(task, records):
    (real, s_real), (blank, s_blank) = _choices(task, records), _choices(task, _blank(records))
    cache = task.module.vision_cache
    assert task.module.shared, "prefix sharing must be on in this test"
    assert cache.why_off() == "" and cache.items_reused > 0, "the vision-feature cache must be on in this test"
    # measured with the shipped model (2026-11-27, 22:53): accuracy real 1.000, blank 0.250; mean |log-prob change| 4.89 nats.
    # If the pixels are dropped anywhere on this path, real and blank give the very same log-probs: both fail
    diff = float(torch.cat([a - b for a, b in zip(s_real, s_blank)]).abs().mean())
    assert diff >= 1.0, diff
    assert real - blank >= 0.4, (real, blank)


def test_rollout_sees_the_same_pixels_as_the_update(task, records):
    import rewards

    out = task.policy.rollout(records[:8], 2, seeds=list(range(8)))
    # generate's own log-probs equal the prefix-shared, cached recomputation: both paths read the same pixels
    assert out.metrics["rollout/gen_logp_max_abs_diff"] < 1e-3
    blank = task.policy.rollout(_blank(records[:8]), 2, seeds=list(range(8)))
    acc = [
        float(
            torch.as_tensor(
                rewards.load("accuracy")(
                    o.samples, prompts=None, answers=[r["answers"] for r in records[:8] for _ in range(2)]
                )
            )
            .float()
            .mean()
        )
        for o in (out, blank)
    ]
    # measured (the 22:53 model): real 0.94, blank 0.25 (16 samples each)
    assert acc[0] >= acc[1] + 0.4, acc
