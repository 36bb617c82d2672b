"""The video policy on tiny random Qwen2-VL / Qwen2.5-VL with real mp4 clips: processor outputs and second_per_grid_ts,
ratio == 1 before the first update (injected ground truth included), the injected sample's old log-prob, the
prefix-shared forward (vision tower once per group), T-GRPO signals, augmentation, and JSONL data errors."""

import json
import logging

import numpy as np
import pytest
import torch

import pipelines.video  # noqa: F401  registers "video"
from mmgrpo.errors import UserError
from mmgrpo_shapes.video import write_mp4
from pipelines.video.build import build_video
from pipelines.video.data import jsonl_records

SMALL = {"train_size": 3, "eval_size": 1, "num_frames": 4, "max_new_tokens": 6}
INJECT = {
    **SMALL,
    "inject_ground_truth": True,
    "gt_span_template": "<answer>{start:.1f} to {end:.1f}</answer>",
    "max_new_tokens": 12,
}
"""a ground truth of 12 byte-level tokens (<answer>, "2.5 to 3.8", </answer>), so it fits max_new_tokens=12"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("video_policy"))


@pytest.fixture(scope="module")
def task25(cache):
    return build_video(
        seed=0,
        device=torch.device("cpu"),
        model="tiny-random-qwen2.5-vl",
        cache_dir=cache,
        temporal="logp_gap",
        **INJECT,
    )


def test_processor_outputs_and_second_per_grid_ts(task25):
    rec = task25.train_data[0]
    assert rec["spans"] and rec["duration"] == 6.0 and "6.0 seconds long" in rec["prompt"]
    enc = task25.policy.encode(rec)
    assert enc["video_grid_thw"].tolist()[0][0] == 2  # 4 frames / temporal patch 2
    # 4 of 24 frames at 4 fps -> sampled fps 4 * 4 / 24 = 2/3; seconds per temporal grid = 2 / (2/3) = 3.0
    assert enc["second_per_grid_ts"].tolist() == pytest.approx([3.0])
    np.testing.assert_allclose(enc["_timestamps"], np.array([0, 8, 15, 23]) / 4.0)  # round(linspace(0, 23, 4)) / fps


def test_ratio_is_one_before_the_first_update_and_gt_old_logp(task25):
    pol, mod = task25.policy, task25.module
    r = pol.rollout(task25.train_data[:2], 4, [11, 12])
    assert r.extras["injected"].tolist() == [False, False, False, True] * 2
    assert (
        r.samples[3]
        == f"<answer>{task25.train_data[0]['spans'][0]:.1f} to {task25.train_data[0]['spans'][1]:.1f}</answer>"
    )
    for shared in (True, False):
        mod.shared = shared
        logp, _ = pol.logp(mod, r, torch.arange(8))
        torch.testing.assert_close(logp[r.mask], r.old_logp[r.mask], atol=1e-5, rtol=0)  # ratio exp(0) = 1
    mod.shared = True
    # the injected sample's old log-prob is its log-prob under the rollout policy: an independent plain forward of
    # [prompt | ground truth] alone gives the same numbers, over every ground-truth token
    i = 3
    n = int(r.extras["lengths"][i])
    alone, _ = mod(
        [r.extras["prompt_enc"][i]],
        r.extras["completion_ids"][i : i + 1, :n],
        r.extras["lengths"][i : i + 1],
        shared=False,
    )
    assert bool(r.mask[i, :n].all()) and not bool(r.mask[i, n:].any())
    torch.testing.assert_close(r.old_logp[i, :n], alone[0], atol=1e-5, rtol=0)
    assert float(r.old_logp[i, :n].sum()) < 0


def test_vision_tower_runs_once_per_group(task25):
    pol, mod = task25.policy, task25.module
    r = pol.rollout(task25.train_data[:2], 4, [1, 2])
    seen = []
    visual = mod.hf.model.visual
    handle = visual.register_forward_pre_hook(lambda m, args, kw: seen.append(args[0].shape[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            shared, _ = mod(r.extras["prompt_enc"], r.extras["completion_ids"], r.extras["lengths"], shared=True)
            plain, _ = mod(r.extras["prompt_enc"], r.extras["completion_ids"], r.extras["lengths"], shared=False)
    finally:
        handle.remove()
    per_video = r.extras["prompt_enc"][0]["pixel_values_videos"].shape[0]
    assert seen == [2 * per_video, 8 * per_video]  # shared: B = 2 videos; plain: N = 8 copies
    torch.testing.assert_close(shared[r.mask], plain[r.mask], atol=1e-4, rtol=0)


def test_temporal_generate_and_augment(cache):
    task = build_video(
        seed=0,
        device=torch.device("cpu"),
        model="tiny-random-qwen2-vl",
        cache_dir=cache,
        temporal="generate",
        temporal_samples=3,
        augment=True,
        augment_easy_min=2.0,
        augment_hard_max=1.0,
        **SMALL,
    )
    r = task.policy.rollout(task.train_data[:2], 2, [5, 6])
    shuffled = r.extras["reward_fields"]["shuffled_samples"]
    assert len(shuffled) == 4 and all(len(s) == 3 and all(isinstance(t, str) for t in s) for s in shuffled)
    assert shuffled[0] is shuffled[1]  # one list per group
    assert r.metrics["augment/hard_frac"] == 1.0  # every group counts as hard here: re-posed with a hint
    ids = r.extras["prompt_enc"][0]["input_ids"][0].tolist()
    assert "Hint: the event lasts about" in task.policy.tokenizer.decode(ids)


def test_augmentation_keeps_generate_calls_equal_across_fsdp_ranks(cache, monkeypatch):
    # under FSDP another rank re-posed 5 groups; this one re-poses 2 (both groups hard): it must add 3 dummy calls
    task = build_video(
        seed=0,
        device=torch.device("cpu"),
        model="tiny-random-qwen2-vl",
        cache_dir=cache,
        augment=True,
        augment_easy_min=2.0,
        augment_hard_max=1.0,
        **SMALL,
    )
    pol = task.policy
    seen = []
    real_match = pol._match_generate_calls
    monkeypatch.setattr(pol, "_match_generate_calls", lambda n, enc: seen.append(n) or real_match(n, enc))
    calls = []
    real = pol._sample
    monkeypatch.setattr(pol, "_sample", lambda enc, n, seed: calls.append(n) or real(enc, n, seed))
    pol.rollout(task.train_data[:2], 2, [5, 6])
    assert seen == [2] and calls == [2, 2, 2, 2]  # (first pass + re-posed) per group; one process: no padding
    calls.clear()
    pol._synced_gpus = True  # as if FSDP-sharded; generate itself is not run with synced_gpus here (no peers)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: t.fill_(5))
    monkeypatch.setattr(pol, "_sample", lambda enc, n, seed: calls.append(n))
    pol._match_generate_calls(2, {})
    assert calls == [1, 1, 1]  # 5 - 2 single-sample calls


def test_jsonl_records_charades_style_and_bad_rows(tmp_path, caplog):
    frames = np.zeros((8, 32, 32, 3), np.uint8)
    (tmp_path / "v").mkdir()
    write_mp4(tmp_path / "v" / "a.mp4", frames, 4)
    (tmp_path / "v" / "bad.mp4").write_bytes(b"garbage")
    rows = [
        {"video": "v/a.mp4", "query": "person opens a door", "timestamps": [0.5, 1.5]},
        {"video": "v/a.mp4", "question": "Which?", "answer": "B", "problem_type": "multiple choice"},
        {"video": "v/bad.mp4", "query": "x", "timestamps": [0, 1]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=r"train.jsonl:3.*bad.mp4"):
        jsonl_records(path)
    with caplog.at_level(logging.WARNING, logger="pipelines.video.io"):
        recs = jsonl_records(path, skip_bad_videos=True)
    assert "skipped 1 of 3" in caplog.text
    assert [r["category"] for r in recs] == ["grounding", "multiple_choice"]
    assert recs[0]["spans"] == [0.5, 1.5] and recs[0]["duration"] == 2.0 and recs[0]["video"].startswith(str(tmp_path))
    assert recs[1]["answers"] == "B" and "option letter" in recs[1]["prompt"]
    path.write_text(json.dumps({"video": "v/a.mp4", "query": "x", "timestamps": [3, 1]}))
    with pytest.raises(UserError, match=r"start <= end"):
        jsonl_records(path)


def test_builder_errors(cache):
    with pytest.raises(UserError, match="temporal"):
        build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, temporal="shuffle", **SMALL)
    with pytest.raises(UserError, match="frame_mode"):
        build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, frame_mode="tokens", **SMALL)


def test_injected_ground_truth_must_fit_max_new_tokens(cache):
    # the default template "<think>Find the event.</think><answer>2.50 to 3.75</answer>" is 31 byte-level tokens:
    # <think> 1 + "Find the event." 15 + </think> 1 + <answer> 1 + "2.50 to 3.75" 12 + </answer> 1 (ends at the stop
    # string, so no EOS is appended); sampled answers stop at 30 tokens, so the injected one could never be produced
    kw = {**INJECT, "gt_span_template": None}
    with pytest.raises(
        UserError,
        match=r"max_new_tokens \(30\) is shorter than the injected ground truth \(31 tokens"
        r".*raise max_new_tokens to >= 31 or shorten pipeline.kwargs.gt_span_template",
    ):
        build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, **{**kw, "max_new_tokens": 30})
    task = build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, **{**kw, "max_new_tokens": 31})
    assert [task.policy._ground_truth(r).shape[1] for r in task.train_data] == [31] * 3
    # without injection the same budget is fine (nothing is injected)
    build_video(
        seed=0,
        device=torch.device("cpu"),
        cache_dir=cache,
        **{**kw, "inject_ground_truth": False, "max_new_tokens": 6},
    )


def test_bad_ground_truth_template_is_a_user_error(cache):
    with pytest.raises(UserError, match=r"pipeline.kwargs.gt_span_template .*\{start\}, \{end\}"):
        build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, **{**INJECT, "gt_span_template": "{start}"})
    with pytest.raises(UserError, match=r"pipeline.kwargs.gt_answer_template"):
        build_video(seed=0, device=torch.device("cpu"), cache_dir=cache, **{**INJECT, "gt_answer_template": "{x}"})


def test_evaluation_rollouts_inject_no_ground_truth(cache):
    """`mmgrpo eval` calls for_evaluation(): every member is sampled (an injected answer would score as the model's)."""
    task = build_video(
        seed=0,
        device=torch.device("cpu"),
        model="tiny-random-qwen2.5-vl",
        cache_dir=cache,
        temporal="logp_gap",
        **INJECT,
    )
    pol = task.policy
    first = pol.rollout(task.train_data[:1], 3, [5])
    assert first.extras["injected"].tolist() == [False, False, True]
    assert "temporal_gap" in first.extras["reward_fields"]
    pol.for_evaluation()
    r = pol.rollout(task.train_data[:1], 3, [5])
    assert r.extras["injected"].tolist() == [False, False, False]
    assert "temporal_gap" not in r.extras.get("reward_fields", {}) and pol.m.temporal == "none"


def test_second_per_grid_ts_reaches_the_mrope_positions_and_the_logprobs(task25):
    """Qwen2.5-VL spaces the temporal grids by second_per_grid_ts * tokens_per_second M-RoPE steps: 3.0 s * 4 = 12 for
    this clip (4 of 24 frames at 4 fps, temporal patch 2); forcing 1.0 s gives 4. Both forwards must see it."""
    from pipelines.vlm.prefix import mrope_positions

    mod = task25.module
    lm = mod.hf.model
    assert lm.config.vision_config.tokens_per_second == 4
    r = task25.policy.rollout(task25.train_data[:1], 2, [7])
    enc = r.extras["prompt_enc"][0]
    video = enc["input_ids"][0] == lm.config.video_token_id  # [Lp]
    fake = {k: v for k, v in enc.items() if k != "_positions"}
    fake["second_per_grid_ts"] = torch.tensor([1.0])
    for e, step in ((enc, 12), (fake, 4)):
        t = sorted(set(mrope_positions(lm, e)[0, video].tolist()))  # temporal ids of the video tokens
        assert len(t) == 2 and t[1] - t[0] == step
    for shared in (True, False):
        mod.shared = shared
        with torch.no_grad():
            a, _ = mod([enc] * 2, r.extras["completion_ids"], r.extras["lengths"], shared=shared)
            b, _ = mod([fake] * 2, r.extras["completion_ids"], r.extras["lengths"], shared=shared)
        assert float((a - b)[r.mask].abs().max()) > 1e-6  # the model reads it (random weights: a small change)
    mod.shared = True


def test_vision_tower_once_per_group_in_the_rollout_too(cache):
    """Generating G completions encodes the video once (not G times), and so does scoring them."""
    task = build_video(seed=0, device=torch.device("cpu"), model="tiny-random-qwen2-vl", cache_dir=cache, **SMALL)
    seen = []
    visual = task.module.hf.model.visual
    handle = visual.register_forward_pre_hook(lambda m, args, kw: seen.append(args[0].shape[0]), with_kwargs=True)
    try:
        r = task.policy.rollout(task.train_data[:2], 4, [1, 2])
    finally:
        handle.remove()
    per_video = r.extras["prompt_enc"][0]["pixel_values_videos"].shape[0]
    assert seen == [per_video, per_video, 2 * per_video]  # generate group 1, group 2; one scoring forward: 2 videos


def test_frame_defaults_live_in_frame_settings():
    """VideoSettings' frame fields default to FrameSettings' (one source), and build maps them back unchanged."""
    from pipelines.video.build import _frames
    from pipelines.video.policy import FrameSettings as FromPolicy
    from pipelines.video.settings import FrameSettings, VideoSettings

    assert FromPolicy is FrameSettings  # the name mmgrpo_shapes and older code import still works
    assert _frames(VideoSettings()) == FrameSettings()
    assert _frames(VideoSettings(num_frames=3, frame_cache="/c")) == FrameSettings(num_frames=3, cache_dir="/c")


def test_method_defaults_live_in_method_settings():
    """VideoSettings' method fields default to MethodSettings' (one source), and build maps them back unchanged; the
    templates' null means MethodSettings' templates."""
    from pipelines.video.build import _methods
    from pipelines.video.policy import MethodSettings as FromPolicy
    from pipelines.video.settings import MethodSettings, VideoSettings

    assert FromPolicy is MethodSettings  # the name older code imports still works
    assert _methods(VideoSettings()) == MethodSettings()
    changed = VideoSettings(temporal="logp_gap", augment=True, augment_noise=5.0, gt_answer_template="A: {answer}")
    assert _methods(changed) == MethodSettings(
        temporal="logp_gap", augment=True, augment_noise=5.0, answer_template="A: {answer}"
    )
