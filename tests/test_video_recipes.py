"""Every configs/video recipe validates; two `mmgrpo.trainer.train` steps of each, and of each method switch (T-GRPO
both ways, Reg-GRPO with augmentation, GRPO-CARE, TempSamp on Qwen2.5-VL), on tiny random models with real mp4 input
keep the loss finite, start at ratio 1 and change the trainable weights (the TRL "params changed" pattern)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines.video  # noqa: F401  registers "video" until pipelines/__init__ imports it
from mmgrpo import checkpoint
from mmgrpo.config import load_config
from mmgrpo.trainer import train
from rewards.api import REWARDS, FunctionReward

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "video").glob("*.yaml"))
LETTERS = "{name: video_test_letters, weight: 1.0}"
IOU = "{name: temporal_iou, weight: 1.0}"
R05 = "{name: temporal_iou, label: r@0.5, weight: 0.0, kwargs: {recall_at: 0.5}}"
SHORT_GT = "<answer>{start:.0f} to {end:.0f}</answer>"
"""8 byte-level tokens (<answer>, "2 to 4", </answer>): TempSamp's injected answer fits max_new_tokens=8"""


def _letters(samples, prompts=None):
    """Share of ASCII letters in the text: varies between random completions, so advantages are non-zero."""
    return [sum(c.isascii() and c.isalpha() for c in s) / max(len(s), 1) for s in samples]


if "video_test_letters" not in REWARDS:
    REWARDS.register(
        "video_test_letters",
        lambda: FunctionReward(_letters, name="video_test_letters", preprocess="counts ASCII letters"),
        doc="test-only reward: share of ASCII letters",
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("video_cache"))


def _tiny(cache: str, out: Path, model: str = "tiny-random-qwen2-vl") -> list[str]:
    """Overrides that shrink any video recipe to a CPU smoke run: tiny random model, 4 ShapesWorld clips, 4 frames."""
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
        "pipeline.kwargs.data=shapes_video",
        "pipeline.kwargs.eval_data=null",
        "pipeline.kwargs.train_size=4",
        "pipeline.kwargs.eval_size=1",
        "pipeline.kwargs.model_dtype=null",
        "pipeline.kwargs.min_pixels=null",
        "pipeline.kwargs.max_pixels=null",
        "pipeline.kwargs.frame_mode=count",
        "pipeline.kwargs.num_frames=4",
        f"pipeline.kwargs.frame_cache={out}/fc",
        "pipeline.kwargs.max_new_tokens=8",
        f"pipeline.kwargs.gt_span_template='{SHORT_GT}'",
        "sample.batch_size=8",
        "sample.group_size=4",
        "algo.micro_batch_size=4",
        "algo.num_minibatches=1",
        "optim.warmup_steps=0",
        f"rewards=[{LETTERS}, {IOU}]",
    ]


TEMPSAMP = [
    "pipeline.kwargs.inject_ground_truth=true",
    "algo.advantage=tempsamp",
    "algo.advantage_kwargs={column: 1, threshold: 0.8, alpha: 1.0, baseline: group}",
]
METHODS = {
    "tempsamp": TEMPSAMP,
    "grpo": ["pipeline.kwargs.inject_ground_truth=false", "algo.advantage=grpo", "algo.advantage_kwargs={}"],
    "tgrpo_generate": [
        "pipeline.kwargs.inject_ground_truth=false",
        "pipeline.kwargs.temporal=generate",
        f"rewards=[{LETTERS}, {IOU}, {{name: temporal_contrast, weight: 1.0}}]",
        "algo.advantage=grpo_bonus",
        "algo.advantage_kwargs={bonus_columns: [2]}",
    ],
    "tgrpo_logp_gap": [
        "pipeline.kwargs.inject_ground_truth=false",
        "pipeline.kwargs.temporal=logp_gap",
        f"rewards=[{LETTERS}, {IOU}, {{name: temporal_contrast, weight: 1.0}}]",
        "algo.advantage=grpo_bonus",
        "algo.advantage_kwargs={bonus_columns: [2]}",
    ],
    "reg_grpo_augment": [
        "pipeline.kwargs.inject_ground_truth=false",
        "algo.advantage=grpo",
        "algo.advantage_kwargs={}",
        "algo.loss=reg_grpo",
        "algo.loss_kwargs={}",
        "algo.aggregation=seq_mean_token_mean",
        "pipeline.kwargs.augment=true",
        "pipeline.kwargs.augment_hard_max=0.5",
    ],
    "grpo_care": [
        "pipeline.kwargs.inject_ground_truth=false",
        "algo.advantage=grpo",
        "algo.advantage_kwargs={}",
        "pipeline.kwargs.care_likelihood=true",
        f"rewards=[{LETTERS}, {{name: grpo_care, kwargs: {{accuracy: video_task}}}}]",
    ],
}


def test_every_recipe_validates():
    assert {p.name for p in RECIPES} >= {"shapes_grounding.yaml", "qwen25vl_7b_charades.yaml"}
    for path in RECIPES:
        cfg = load_config(path)
        assert cfg.pipeline.name == "video"
        text = path.read_text()
        assert text.startswith("#") and "Run:" in text and "Expected:" in text


def test_video_qa_count_recipe_starts_from_the_parts_base_with_t_grpo_on():
    cfg = load_config(ROOT / "configs" / "video" / "shapes_videoqa_count.yaml")
    kw = cfg.pipeline.kwargs
    assert kw["model"] == "assets/shapes-video-parts" and (ROOT / kw["model"] / "model.safetensors").is_file()
    assert kw["temporal"] == "generate" and cfg.algo.advantage == "grpo_bonus"  # T-GRPO's temporal contrast on
    assert "temporal_contrast" in [r.name for r in cfg.rewards]


def test_grounding_recipe_starts_from_the_shipped_model_and_its_tempsamp_variant_fits(cache):
    """The CPU recipe trains assets/shapes-video-early (the early stop that leaves grounding room for RL); its
    documented TempSamp variant builds as written: the default injected answer (31 tokens) fits the recipe's
    max_new_tokens (a longer one is a start-up error)."""
    from pipelines.video.build import build_video

    path = ROOT / "configs" / "video" / "shapes_grounding.yaml"
    assert load_config(path).pipeline.kwargs["model"] == "assets/shapes-video-early"
    cfg = load_config(
        path,
        TEMPSAMP
        + [
            f"pipeline.kwargs.model={ROOT / 'assets' / 'shapes-video'}",
            f"pipeline.kwargs.cache_dir={cache}",
            "pipeline.kwargs.train_size=4",
            "pipeline.kwargs.eval_size=1",
        ],
    )
    task = build_video(seed=0, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    r = task.policy.rollout(task.train_data[:1], 2, [3])
    assert r.extras["injected"].tolist() == [False, True] and r.samples[1].startswith("<think>Find the event.</think>")
    assert int(r.extras["lengths"][1]) == 31 <= cfg.pipeline.kwargs["max_new_tokens"]


def _initial_weights(cfg) -> dict[str, torch.Tensor]:
    from pipelines.video.build import build_video

    task = build_video(seed=cfg.run.seed, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    return task.policy.state_dict()


def _two_steps(cfg, out: Path) -> list[dict]:
    before = _initial_weights(cfg)
    result = train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["skipped"] == 0.0 and torch.isfinite(torch.tensor(r["loss/policy"]))
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)  # first step is on-policy, injected GT included
    assert result["metrics"]["rollout/length_mean"] > 0
    after = load_file(str(checkpoint.list_checkpoints(out / "checkpoints")[-1] / "weights.safetensors"))
    assert after.keys() == before.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no trainable weight changed in two steps"
    return rows


TASK = "{name: video_task, weight: 1.0}"
"""grounding or QA by record: the reward column every recipe's data can give"""


@pytest.mark.parametrize("recipe", [r.name for r in RECIPES])
def test_recipe_two_training_steps(cache, tmp_path, recipe):
    cfg = load_config(ROOT / "configs" / "video" / recipe)
    extra = []
    if cfg.algo.advantage == "grpo_bonus":  # T-GRPO recipes: the bonus column stays where the advantage reads it
        extra = [f"rewards=[{LETTERS}, {TASK}, {{name: temporal_contrast, weight: 1.0}}]"]
    elif cfg.pipeline.kwargs.get("shapes_types") not in (None, ["grounding"]):  # QA records have no spans
        extra = [f"rewards=[{LETTERS}, {TASK}]"]
    cfg = load_config(ROOT / "configs" / "video" / recipe, _tiny(cache, tmp_path) + extra)
    rows = _two_steps(cfg, tmp_path)
    if cfg.pipeline.kwargs.get("inject_ground_truth"):
        assert rows[0]["gt/logp_mean"] < 0  # the injected ground truth was scored by the rollout policy
    if cfg.pipeline.kwargs.get("temporal") == "generate":
        assert "temporal_contrast" in json.dumps(rows[0])  # the T-GRPO bonus column was scored


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_two_training_steps(cache, tmp_path, method):
    cfg = load_config(ROOT / "configs" / "video" / "shapes_grounding.yaml", _tiny(cache, tmp_path) + METHODS[method])
    rows = _two_steps(cfg, tmp_path)
    if method == "tgrpo_logp_gap":
        assert all(abs(r["temporal/gap_mean"]) < 50 for r in rows)
    if method == "tempsamp":
        assert rows[0]["gt/logp_mean"] < 0  # the injected ground truth was scored by the rollout policy
    if method == "reg_grpo_augment":
        assert "reg/sq_err" in rows[0] and "augment/hard_frac" in rows[0]


def test_tempsamp_on_qwen25(cache, tmp_path):
    cfg = load_config(
        ROOT / "configs" / "video" / "shapes_grounding.yaml",
        _tiny(cache, tmp_path, model="tiny-random-qwen2.5-vl") + TEMPSAMP,
    )
    _two_steps(cfg, tmp_path)


def test_demo_prints_before_and_after(cache, tmp_path, capsys):
    from pipelines.video import demo

    demo.main(
        [
            str(ROOT / "configs" / "video" / "shapes_grounding.yaml"),
            *_tiny(cache, tmp_path),
            "pipeline.kwargs.eval_size=2",
            f"rewards=[{IOU}, {R05}]",
        ]
    )
    out = capsys.readouterr().out
    assert "before (ckpt=none)" in out and "mIoU" in out and "R@0.5" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("eval mIoU ") and " -> " in last and "in 2 steps" in last


def _header_variants(path: Path) -> dict[str, list[str]]:
    """The `Variants:` block of a recipe header as {name: [override, ...]}: a variant starts where a name sits in
    column 12, and an override is `section.key=value` with a brace-balanced value (notes in parentheses are skipped)."""
    import re

    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# Variants:"))
    out: dict[str, list[str]] = {}
    name = ""
    for ln in lines[start:]:
        if ln is not lines[start] and re.match(r"# [A-Z][a-z]+:", ln):  # the next header field
            break
        body = ln.replace("# Variants:", "#" + " " * 10, 1)
        if len(body) > 12 and body[12] != " ":
            name = re.match(r"\S+(?: \S+)?(?=\s{2,}|$)", body[12:]).group(0)
            out[name] = []
        text = body[12 + len(name) :] if out[name] == [] else body
        for m in re.finditer(r"(?<![\w.(])((?:pipeline|algo|rewards|sample|optim|run)[\w.]*)=", text):
            i, depth = m.end(), 0
            while i < len(text) and (depth or not text[i].isspace()):
                depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(text[i], 0)
                i += 1
            out[name].append(text[m.start() : i])
    return out


@pytest.mark.parametrize("recipe", [r.name for r in RECIPES])
def test_header_variants_load_and_point_at_the_right_columns(recipe):
    """Every variant the header documents is a valid override set, and its advantage reads the reward it means:
    grpo_bonus's bonus column is temporal_contrast, tempsamp's IoU column is temporal_iou."""
    path = ROOT / "configs" / "video" / recipe
    variants = _header_variants(path)
    assert {"T-GRPO", "Reg-GRPO"} <= set(variants) and all(variants.values())
    for name, overrides in variants.items():
        cfg = load_config(path, overrides)
        names = [r.name for r in cfg.rewards]
        kw = cfg.algo.advantage_kwargs
        if cfg.algo.advantage == "grpo_bonus":
            assert [names[c] for c in kw["bonus_columns"]] == ["temporal_contrast"], (name, names)
            assert cfg.pipeline.kwargs["temporal"] in ("generate", "logp_gap"), name
        if cfg.algo.advantage == "tempsamp":
            assert names[kw.get("column", 0)] == "temporal_iou", (name, names)
            assert cfg.pipeline.kwargs["inject_ground_truth"], name
        if name in ("T-GRPO", "Reg-GRPO"):  # the paper methods on their own: no injected ground truth
            assert not cfg.pipeline.kwargs["inject_ground_truth"], name
        if cfg.algo.loss == "reg_grpo":
            assert cfg.pipeline.kwargs["augment"], name


def test_gpu_recipe_two_steps_on_charades_style_jsonl(cache, tmp_path):
    """The GPU recipe's own data path: a Charades-STA-style JSONL ({video, query, timestamps}, paths relative to the
    file) of real mp4 clips, a bad video skipped (skip_bad_videos: true), TempSamp as configured, two steps."""
    import numpy as np

    from mmgrpo_shapes.video import write_mp4

    (tmp_path / "videos").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        write_mp4(tmp_path / "videos" / f"c{i}.mp4", rng.integers(0, 256, (16, 64, 64, 3), dtype=np.uint8), 4)
        rows.append({"video": f"videos/c{i}.mp4", "query": f"event {i}", "timestamps": [0.5 * i, 0.5 * i + 1.5]})
    (tmp_path / "videos" / "broken.mp4").write_bytes(b"not an mp4")
    rows.append({"video": "videos/broken.mp4", "query": "x", "timestamps": [0, 1]})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    # the recipe's own frame sampling (2 fps: 4 s -> 8 frames) and pixel bounds, not the smoke-run overrides
    keep = ("pipeline.kwargs.frame_mode", "pipeline.kwargs.min_pixels", "pipeline.kwargs.max_pixels")
    cfg = load_config(
        ROOT / "configs" / "video" / "qwen25vl_7b_charades.yaml",
        [o for o in _tiny(cache, out, model="tiny-random-qwen2.5-vl") if not o.startswith(keep)]
        + [f"pipeline.kwargs.data={data}", "pipeline.kwargs.train_size=null"],
    )
    kw = cfg.pipeline.kwargs
    assert kw["skip_bad_videos"] and kw["inject_ground_truth"] and kw["frame_mode"] == "fps"
    rows = _two_steps(cfg, out)
    assert rows[0]["gt/logp_mean"] < 0 and rows[0]["video/frames_mean"] == 8


def test_video_r1_recipe_two_steps_on_video_r1_json(cache, tmp_path):
    """The Video-R1 recipe's own data path: Video-R1-format JSON (multiple choice with options, numerical, an image
    row) converted by pipelines.video.video_r1, then two T-GRPO steps (shuffled-frame rollouts) on a tiny
    Qwen2.5-VL with the recipe's 2 fps sampling and pixel bounds."""
    import numpy as np

    from mmgrpo_shapes.video import write_mp4
    from pipelines.video.video_r1 import convert
    from pipelines.video.video_r1 import main as convert_main

    (tmp_path / "v").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        write_mp4(tmp_path / "v" / f"c{i}.mp4", rng.integers(0, 256, (16, 64, 64, 3), dtype=np.uint8), 4)
        mc = {
            "problem": f"What happens {i}?",
            "problem_type": "multiple choice",
            "options": ["A. x", "B. y"],
            "solution": "<answer>B</answer>",
        }
        num = {
            "problem": f"How many {i}?",
            "problem_type": "numerical",
            "options": [],
            "solution": "<answer>3</answer>",
        }
        rows.append({"problem_id": i, "data_type": "video", "path": f"./v/c{i}.mp4", **(mc if i % 2 else num)})
    rows.append(
        {
            "problem_id": 9,
            "data_type": "image",
            "path": "./img.png",
            "problem": "?",
            "problem_type": "multiple choice",
            "options": ["A. x"],
            "solution": "<answer>A</answer>",
        }
    )
    src = tmp_path / "Video-R1-260k.json"
    src.write_text(json.dumps(rows))
    data = tmp_path / "out" / "train.jsonl"
    assert convert(src, data) == (4, 1)
    first, second = (json.loads(x) for x in data.read_text().splitlines()[:2])
    assert first["type"] == "numeric" and first["answer"] == "3"
    assert second["question"] == "What happens 1?\nOptions:\nA. x\nB. y" and second["answer"] == "B"
    src.write_text(json.dumps([{"problem": "?", "problem_type": "essay", "solution": "x", "path": "a.mp4"}]))
    assert convert_main([str(src), str(tmp_path / "bad.jsonl")]) == 2  # one line naming the row and the field
    out = tmp_path / "run"
    keep = (
        "pipeline.kwargs.frame_mode",
        "pipeline.kwargs.min_pixels",
        "pipeline.kwargs.max_pixels",
        "pipeline.kwargs.max_new_tokens",
    )
    cfg = load_config(
        ROOT / "configs" / "video" / "qwen25vl_7b_video_r1.yaml",
        [o for o in _tiny(cache, out, model="tiny-random-qwen2.5-vl") if not o.startswith(keep)]
        + [
            f"pipeline.kwargs.data={data}",
            "pipeline.kwargs.train_size=null",
            "pipeline.kwargs.max_new_tokens=8",
            f"rewards=[{LETTERS}, {TASK}, {{name: temporal_contrast, weight: 1.0}}]",
        ],
    )
    kw = cfg.pipeline.kwargs
    assert kw["temporal"] == "generate" and cfg.algo.advantage == "grpo_bonus" and kw["frame_mode"] == "fps"
    rows = _two_steps(cfg, out)
    assert rows[0]["video/frames_mean"] == 8  # 4 s at 2 fps
