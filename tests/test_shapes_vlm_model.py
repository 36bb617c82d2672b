"""Tests of the tiny ShapesWorld VLMs: the SFT targets, labels and loss, and the shipped assets/shapes-vlm (VQA) and
assets/shapes-video (temporal grounding) folders: offline from_pretrained load, size, the RL pipelines loading them
by path with the same prompts as pretraining, and each model's accuracy band on a fixed test sample.
"""

import math
from pathlib import Path

import pytest
import torch

from mmgrpo_shapes.programs import pretrain_vlm as P
from mmgrpo_shapes.programs.tiny_vlm import sft_loss
from mmgrpo_shapes.vqa import QUESTION_TYPES

ROOT = Path(__file__).resolve().parents[1]
VLM, VIDEO = ROOT / "assets" / "shapes-vlm", ROOT / "assets" / "shapes-video"
PARTS = (
    ROOT / "assets" / "shapes-vlm-parts"
)  # the arithmetic RL recipe's base (configs/vlm/shapes_vqa_arithmetic.yaml)
READING = ROOT / "assets" / "shapes-vlm-reading"  # the six-type RL recipe's base (configs/vlm/shapes_vqa_reading.yaml)
LISTS = (
    ROOT / "assets" / "shapes-vlm-lists"
)  # the same build with object-list thinks (configs/vlm/shapes_vqa_lists.yaml)
FLAGS = ROOT / "assets" / "shapes-vlm-flags"  # the same with flagged lists, seed 1 (configs/vlm/shapes_vqa_flags.yaml)
EARLY = ROOT / "assets" / "shapes-video-early"  # the grounding RL recipe's base (configs/video/shapes_grounding.yaml)
VPARTS = (
    ROOT / "assets" / "shapes-video-parts"
)  # the video QA RL recipe's base (configs/video/shapes_videoqa_count.yaml)
MAX_BYTES = 20 * 2**20
VQA_N, VIDEO_N = 48, 24
"""fixed test samples (the first N records of the test split, seed 0) for the accuracy bands"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pipelines.vlm.tiny import qwen_tokenizer

    return qwen_tokenizer(tmp_path_factory.mktemp("tok"))


# ---------------------------------------------------------------- targets, labels, loss


def test_targets_fit_the_recipes_token_budget_and_score_full_marks(tok):
    import rewards

    fmt, acc, iou = rewards.load("format", mode="strict"), rewards.load("accuracy"), rewards.load("temporal_iou")
    # the longest answers: "yellow" (colour), "triangle" (shape), a two-digit count
    for kind in QUESTION_TYPES:
        for answer in ("yellow", "triangle", "12"):
            text = P.target_text("vqa", {"category": kind, "answers": answer} | POSITION_RECORD)
            assert len(tok(text, add_special_tokens=False)["input_ids"]) <= 24  # configs/vlm/shapes_vqa.yaml
            assert fmt([text], prompts=None).tolist() == [1.0]
            assert acc([text], prompts=None, answers=[answer]).tolist() == [1.0]
    text = P.target_text("grounding", {"spans": [5.75, 6.0]})
    assert text.endswith("<answer>5.75 to 6.00</answer>")
    assert len(tok(text, add_special_tokens=False)["input_ids"]) <= 32  # configs/video/shapes_grounding.yaml
    assert fmt([text], prompts=None).tolist() == [1.0]
    assert iou([text], prompts=None, spans=[[5.75, 6.0]]).tolist() == [1.0]


POSITION_RECORD = {
    "prompt": "Is the yellow triangle left of the blue square?",
    "objects": [
        {"shape": "square", "color": "blue", "cx": 0.80, "cy": 0.10, "size": 0.1},
        {"shape": "triangle", "color": "yellow", "cx": 0.30, "cy": 0.74, "size": 0.1},
    ],
}


def test_position_thinks_in_the_token_grid_by_hand():
    from mmgrpo_shapes.vqa_think import position_think

    # colour and shape initials, then the cell of 4 x 4 visual tokens: column = floor(4 cx), row = floor(4 cy).
    # Triangle cx 0.30 -> 1, square 0.80 -> 3; "above"
    # reads rows: triangle cy 0.74 -> 2, square 0.10 -> 0; the named order is kept, whatever the objects' order
    assert position_think(POSITION_RECORD) == "x yt1 bs3"
    above = POSITION_RECORD | {"prompt": "Is the blue square above the yellow triangle?"}
    assert position_think(above) == "y bs0 yt2"
    edge = {
        "prompt": "Is the red circle left of the blue square?",
        "objects": [
            {"shape": "circle", "color": "red", "cx": 0.0, "cy": 0.5, "size": 0.1},
            {"shape": "square", "color": "blue", "cx": 1.0, "cy": 0.5, "size": 0.1},
        ],
    }
    assert position_think(edge) == "x rc0 bs3"  # cx = 1.0 clamps to the last column


def test_where_questions_ask_one_unique_objects_cell_by_hand():
    import numpy as np

    from mmgrpo_shapes.vqa_think import where_record

    # POSITION_RECORD: yellow triangle cx 0.30 -> column 1, cy 0.74 -> row 2; blue square column 3, row 0
    want = {
        ("column", "yellow triangle"): ("x yt1", "1"),
        ("row", "yellow triangle"): ("y yt2", "2"),
        ("column", "blue square"): ("x bs3", "3"),
        ("row", "blue square"): ("y bs0", "0"),
    }
    seen = set()
    rng = np.random.default_rng(0)
    for _ in range(40):
        r = where_record(POSITION_RECORD, rng)
        word, name = r["prompt"].removeprefix("Which ").removesuffix(" in?").split(" is the ")
        assert (r["think"], r["answers"]) == want[(word, name)] and r["category"] == "where"
        assert P.target_text("vqa", r) == f"<think>{r['think']}</think><answer>{r['answers']}</answer>"
        seen.add((word, name))
    assert seen == set(want)  # both axes, both objects
    twins = {"objects": [POSITION_RECORD["objects"][0]] * 2}  # two blue squares: no unique name to ask about
    assert where_record(twins, rng) is None


def test_train_stream_turns_a_fraction_into_where_questions():
    import itertools

    recs = list(itertools.islice(P.train_stream("vqa", seed=3, chunk=64, where=0.5, blank=("count",)), 200))
    where = [r for r in recs if r["category"] == "where"]
    assert 70 <= len(where) <= 130  # about half (binomial sd 7)
    assert all(r["objects"] for r in where)  # asked of real scenes, never of the blanked types
    assert "count" in {r["category"] for r in recs}


def test_a_blank_position_question_keeps_its_scenes_cell_think():
    """--blank-types position: the canvas is blank and the objects gone, but the think still names the scene's cells
    (worked out from the unblanked record of the same stream position), so the base learns the think's format and its
    prior and RL has the marks to check (shapes_think_cells)."""
    import itertools

    from mmgrpo_shapes.vqa_think import position_think

    kw = dict(seed=5, chunk=64, types=("position",))
    real = list(itertools.islice(P.train_stream("vqa", **kw), 20))
    blank = list(itertools.islice(P.train_stream("vqa", blank=("position",), **kw), 20))
    assert [r["prompt"] for r in real] == [r["prompt"] for r in blank]  # blanking draws nothing from the stream's rng
    for r, b in zip(real, blank):
        assert b["objects"] == [] and b["think"] == position_think(r)  # e.g. "x gt0 bs2" from r's objects
        assert P.target_text("vqa", b) == f"<think>{b['think']}</think><answer>{r['answers']}</answer>"


def test_key_tokens_of_a_vqa_completion_weigh_more_by_hand(tok):
    from mmgrpo_shapes.vqa_think import key_token_weights

    # position's cell digits and every answer token weigh `key_weight`; initials, spaces, tags and <|im_end|> stay at 1
    ids = tok("<think>x yt1 bs3</think><answer>yes</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[:6] == ["<think>", "x", "Ġ", "y", "t", "1"]  # the byte-level tokens the weights are read from
    want = [1, 1, 1, 1, 1, 4, 1, 1, 1, 4, 1, 1, 4, 4, 4, 1, 1]
    assert key_token_weights(toks, 4.0).tolist() == want
    # the fixed thinks carry no digit: only the answer ("12" is two tokens) weighs more
    toks = tok.convert_ids_to_tokens(
        tok("<think>Count, sum.</think><answer>12</answer>", add_special_tokens=False)["input_ids"]
    )
    assert key_token_weights(toks, 3.0).tolist() == [1.0] * 14 + [3.0, 3.0, 1.0]


def test_key_weights_align_with_the_labels(tok, monkeypatch):
    # pretrain_vlm.sft_step hands each example's key_token_weights to tiny_vlm.weighted_sft_loss, which lays them
    # after the example's prompt: prompt 0, <answer> 1, "n" "o" 4, </answer> 1
    from mmgrpo_shapes.programs import tiny_vlm
    from mmgrpo_shapes.vqa_think import key_token_weights

    ids = tok("<answer>no</answer>", add_special_tokens=False)["input_ids"]
    batch = [{"input_ids": torch.zeros(1, 2), "completion": torch.tensor(ids)}]
    batch[0]["weights"] = key_token_weights(tok.convert_ids_to_tokens(ids), 4.0)
    labels = torch.full((1, 2 + len(ids)), -100)  # [B, L]
    seen = []
    monkeypatch.setattr(tiny_vlm, "sft_loss", lambda model, inputs, labels, w=None: seen.append(w))
    tiny_vlm.weighted_sft_loss(None, {}, labels, batch)
    assert seen[0].tolist() == [[0.0, 0.0, 1.0, 4.0, 4.0, 1.0]]


def test_collate_labels_only_the_completion():
    a = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "mm_token_type_ids": torch.tensor([[0, 1, 0]]),
        "completion": torch.tensor([8, 9]),
    }
    b = {
        "input_ids": torch.tensor([[1, 2]]),
        "mm_token_type_ids": torch.tensor([[1, 0]]),
        "completion": torch.tensor([3, 4, 4]),
    }
    inputs, labels = P.collate([a, b], pad_id=0)
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 4]]
    assert labels.tolist() == [[-100, -100, -100, 8, 9], [-100, -100, 3, 4, 4]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    short = {"input_ids": torch.tensor([[1]]), "completion": torch.tensor([2])}
    inputs, labels = P.collate([a, short], pad_id=0)
    assert inputs["input_ids"][1].tolist() == [1, 2, 0, 0, 0] and inputs["attention_mask"][1].tolist() == [
        1,
        1,
        0,
        0,
        0,
    ]
    assert labels[1].tolist() == [-100, 2, -100, -100, -100]


class _Logits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, **inputs):
        return type("Out", (), {"logits": self.logits})()


def test_sft_loss_is_token_mean_cross_entropy_of_the_completion():
    # one row, L = 3, V = 2; labels [-100, 1, 0]: position 0 predicts token 1, position 1 predicts token 0
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0], [9.0, -9.0]]])
    labels = torch.tensor([[-100, 1, 0]])
    # p(1 | pos 0) = 3 / (1 + 3) = 0.75; p(0 | pos 1) = 4 / (4 + 1) = 0.8; position 2's logits are never used
    expected = -(math.log(0.75) + math.log(0.8)) / 2  # = 0.25541...
    got = sft_loss(_Logits(logits), {}, labels)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_built_model_is_a_qwen2_vl_with_16_visual_tokens_per_image():
    model, processor = P.build_model("vqa", hidden=64, layers=1, vision_dim=32, vision_depth=1)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    rec = P.records("vqa", "train", 1, seed=0)[0]
    enc = P.encoder("vqa", processor)(rec)
    n_image = int((enc["input_ids"] == model.config.image_token_id).sum())
    assert n_image == 16  # 32 px -> 112 x 112: 8 x 8 patches of 14 px, merged 2 x 2
    loss = sft_loss(
        model,
        *P.collate(
            [P.example("vqa", P.encoder("vqa", processor), processor.tokenizer, rec)], processor.tokenizer.pad_token_id
        ),
    )
    assert math.isfinite(loss.item()) and loss.item() > 0


# ---------------------------------------------------------------- the shipped models


def _load(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not (path / "model.safetensors").is_file():
        pytest.fail(
            f"{path} is missing; train it with python -m mmgrpo_shapes.programs.pretrain_vlm (see assets/README.md)"
        )
    return AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)


@pytest.mark.parametrize(
    "path",
    [VLM, VIDEO, PARTS, READING, LISTS, FLAGS, EARLY, VPARTS],
    ids=["vlm", "video", "vlm-parts", "vlm-reading", "vlm-lists", "vlm-flags", "video-early", "video-parts"],
)
def test_shipped_folder_layout_and_size(path):
    processor, model = _load(path)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= names
    assert sum(p.stat().st_size for p in path.iterdir()) <= MAX_BYTES
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    tags = processor.tokenizer("<think></think><answer></answer>", add_special_tokens=False)["input_ids"]
    assert len(tags) == 4  # each reasoning tag is one token


def test_vlm_pipeline_loads_the_shipped_model_by_path_with_the_pretraining_prompts():
    from pipelines.vlm.build import build_vlm

    task = build_vlm(seed=0, device=torch.device("cpu"), model=str(VLM), train_size=2, eval_size=1)
    rec = task.train_data[0]
    processor, _ = _load(VLM)
    ours = P.encoder("vqa", processor)(rec)
    theirs = task.policy.encode(rec)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_video_pipeline_loads_the_shipped_model_by_path_with_the_pretraining_prompts():
    from pipelines.video.build import build_video

    task = build_video(
        seed=0, device=torch.device("cpu"), model=str(VIDEO), train_size=2, eval_size=1, shapes_types=["grounding"]
    )
    rec = task.train_data[0]
    processor, _ = _load(VIDEO)
    ours = P.encoder("grounding", processor)(rec)
    theirs = task.policy.encode(rec)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])


def test_vlm_accuracy_band_on_fixed_test_sample():
    # greedy answers to the first 48 balanced test questions (seed 0): the shipped 2026-11-27 22:53 model (60 min, with
    # where questions; 0.797 on 300) scores 0.667 here (the 14:40 model 0.83); the image-blind level is ~0.33, and a model
    # that stopped reading its image (the unbalanced-data model: 0.3125 here) fails the lower bound
    processor, model = _load(VLM)
    table = P.evaluate(model, "vqa", "test", VQA_N, processor=processor)
    assert table["all"]["format"] >= 0.9
    assert 0.6 <= table["all"]["accuracy"] <= 0.95


# greedy, first 96 balanced test questions (16 a type): each RL base reads colour and shape and answers the types it
# saw only on blank canvases near their blind levels (arithmetic 0.24, existence and position 0.50), the room its
# recipe fills from the pixels. Measured: parts colour and shape 0.94, arithmetic 0.25, existence 0.50; reading
# colour and shape 0.875, arithmetic 0.375, position 0.50; lists (2026-12-04) colour and shape 0.97, arithmetic 0.19,
# position 0.50. A base taught those types on real images fails the upper
# bound: the main shapes-vlm scores arithmetic 0.44, existence 0.75, position 0.625 here (means 0.59 and 0.53).
# shapes-vlm-flags is not here: 16 questions a type cannot tell it apart (arithmetic 0.50, position 0.69 here, mean
# 0.59; on 300 test questions 0.36 and 0.52 against blind 0.24 and 0.52, assets/README.md).
@pytest.mark.parametrize(
    "path,held_out,most",
    [
        (PARTS, ("arithmetic", "existence"), 0.55),
        (READING, ("arithmetic", "position"), 0.5),
        (LISTS, ("arithmetic", "position"), 0.5),
    ],
    ids=["vlm-parts", "vlm-reading", "vlm-lists"],
)
def test_rl_base_reads_objects_but_not_the_types_it_saw_only_on_blank_canvases(path, held_out, most):
    processor, model = _load(path)
    table = P.evaluate(model, "vqa", "test", 96, processor=processor)
    read = (table["color"]["accuracy"] + table["shape"]["accuracy"]) / 2
    left = sum(table[t]["accuracy"] for t in held_out) / len(held_out)
    assert table["all"]["format"] >= 0.9
    assert read >= 0.8 and left <= most, (read, left)


# the shipped video model's scores on fixed test samples (real vs blank frames, through the rollout policy) are
# checked in tests/test_shapes_video_model.py; it is trained by mmgrpo_shapes/programs/pretrain_video.py


def test_cli_pretrain_names_its_choices_and_dispatches_to_a_main(capsys):
    import importlib

    from mmgrpo.cli import main
    from mmgrpo_shapes.programs.cli import PRETRAIN

    assert main(["pretrain", "shapes-gan"]) == 2
    err = capsys.readouterr().err
    assert "shapes-gan" in err and "shapes-t2i, shapes-vlm, shapes-video" in err
    for module, _ in PRETRAIN.values():
        assert callable(importlib.import_module(module).main)
    args = P.parse_args(["--task", "grounding"])
    assert (args.out, args.pixels) == ("assets/shapes-video", 56 * 56)  # the shipped video model's settings


def test_train_stream_keeps_only_sft_types_and_blanks_blank_types():
    """--sft-types filters the stream; --blank-types puts those types on the background colour with no objects (so
    the dense targets match the canvas), leaving every other record's pixels as make_vqa drew them."""
    import itertools

    import numpy as np

    from mmgrpo_shapes.vqa import BACKGROUND

    stream = P.train_stream("vqa", seed=3, chunk=64, types=("color", "existence"), blank=("existence",))
    recs = list(itertools.islice(stream, 40))
    assert {r["category"] for r in recs} == {"color", "existence"}
    for r in recs:
        img = np.asarray(r["image"])
        blank = bool((img == np.asarray(BACKGROUND, dtype=img.dtype)).all())
        assert blank == (r["category"] == "existence")
        assert (r["objects"] == []) == (r["category"] == "existence")


def test_a_steps_budget_trains_that_many_steps_and_validates_on_its_interval(tmp_path):
    """--steps replaces the wall-clock budget (so a build is the same on any machine): exactly that many SFT steps,
    validation every --eval-every steps and once at the end, the best EMA saved; a negative budget is a usage error."""
    args = P.parse_args(
        ["--task", "vqa", "--out", str(tmp_path / "m"), "--steps", "3", "--eval-every", "2", "--val-n", "4",
         "--batch", "2", "--tower-steps", "0", "--hidden", "32", "--layers", "1", "--vision-dim", "32",
         "--vision-depth", "1", "--test-n", "0"]
    )  # fmt: skip
    info = P.train(args)
    assert info["steps"] == 3
    assert [e["step"] for e in info["evals"]] == [2, 3]
    assert (tmp_path / "m" / "config.json").exists()
    with pytest.raises(SystemExit) as e:
        P.parse_args(["--task", "vqa", "--steps", "-1"])
    assert e.value.code == 2
