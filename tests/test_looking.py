""" "Is it looking?": record ablations (pipelines/visual_ablation.py), per-category tables and paired tests
(mmgrpo/looking.py), and `mmgrpo eval` end to end on the shipped ShapesWorld VLM and video models."""

import json
from pathlib import Path

import numpy as np
import pytest

from mmgrpo.looking import category_table, format_looking, paired_tests, parse_ablate
from pipelines.visual_ablation import ablate_records, background, derangement, preview

ROOT = Path(__file__).resolve().parents[1]


def test_derangement_moves_everyone_and_is_seeded():
    for n in (2, 3, 7, 50):
        p = derangement(n, seed=3)
        assert sorted(p) == list(range(n)) and all(p[i] != i for i in range(n))
    assert derangement(20, 1) == derangement(20, 1) != derangement(20, 2)
    with pytest.raises(ValueError, match="at least 2 records"):
        derangement(1, 0)


def _scene(colour: tuple[int, int, int]) -> np.ndarray:
    img = np.full((8, 10, 3), 242, dtype=np.uint8)  # ShapesWorld's background (242, 242, 242)
    img[3:5, 4:6] = colour  # one object inside the border
    return img


def test_blank_and_shuffle_change_only_the_pixels():
    recs = [
        {"prompt": f"q{i}", "image": _scene((200, 30 * i, 0)), "answers": str(i), "category": "c"} for i in range(4)
    ]
    blank = ablate_records(recs, "blank")
    for r, b in zip(recs, blank):
        assert b["image"].shape == r["image"].shape and (b["image"] == 242).all()  # same size, background only
        assert (b["prompt"], b["answers"], b["category"]) == (r["prompt"], r["answers"], r["category"])
    shuffled = ablate_records(recs, "shuffle", seed=5)
    perm = derangement(4, 5)
    for i, s in enumerate(shuffled):
        assert s["image"] is recs[perm[i]]["image"] and s["answers"] == str(i)
    assert recs[0]["image"][3, 4, 0] == 200  # the input records are untouched
    lists = ablate_records([{"prompt": "q", "image": [_scene((9, 9, 9)), _scene((1, 2, 3))]}], "blank")
    assert len(lists[0]["image"]) == 2 and all((x == 242).all() for x in lists[0]["image"])
    with pytest.raises(ValueError, match="has no image or video"):
        ablate_records([{"prompt": "q"}], "blank")


def test_paths_and_hugging_face_bytes_are_ablated_too(tmp_path):
    import io

    from PIL import Image

    Image.fromarray(_scene((10, 200, 10))).save(tmp_path / "a.png")
    buf = io.BytesIO()
    Image.fromarray(_scene((10, 10, 200))).save(buf, format="PNG")
    recs = [{"prompt": "q0", "image": str(tmp_path / "a.png")}, {"prompt": "q1", "image": {"bytes": buf.getvalue()}}]
    blank = ablate_records(recs, "blank")
    assert all(b["image"].shape == (8, 10, 3) and (b["image"] == 242).all() for b in blank)
    shuffled = ablate_records(recs, "shuffle")  # two records: the only derangement swaps them
    assert shuffled[0]["image"] is recs[1]["image"] and shuffled[1]["image"] == str(tmp_path / "a.png")


def test_background_is_the_border_median():
    img = _scene((255, 0, 0))
    img[0, :3] = (0, 0, 0)  # a few dark border pixels do not move the median
    assert background(img).tolist() == [242, 242, 242]


def test_blank_video_keeps_frames_fps_and_size(tmp_path):
    pytest.importorskip("av")
    from mmgrpo_shapes.video import write_mp4
    from pipelines.video.io import read_frames, video_info

    clip = np.full((6, 16, 16, 3), 242, dtype=np.uint8)  # [T, H, W, 3]
    clip[:, 6:10, 6:10] = (220, 40, 40)
    src = tmp_path / "a.mp4"
    write_mp4(src, clip, 4)
    out = ablate_records([{"prompt": "q", "video": str(src)}] * 2, "blank", workdir=tmp_path / "w")
    assert out[0]["video"] == out[1]["video"] != str(src)  # one blank clip per (frames, fps, size, colour)
    a, b = video_info(src), video_info(out[0]["video"])
    assert (b.num_frames, b.fps, b.height, b.width) == (a.num_frames, a.fps, a.height, a.width)
    frames, _ = read_frames(b.path, list(range(b.num_frames)))
    assert np.abs(frames.astype(int) - 242).max() <= 3  # codec rounding only; the square is gone
    strip = preview({"prompt": "q", "video": str(src)}, frames=3)["frames"]  # report preview: 3 of 6 frames
    assert len(strip) == 3 and strip[0].shape == (16, 18, 3) and (strip[0][:, -2:] == 96).all()  # + 2 px gap


def test_parse_ablate():
    assert parse_ablate("auto", True) == ("blank", "shuffle") and parse_ablate("auto", False) == ()
    assert parse_ablate("none", True) == () and parse_ablate("shuffle,blank", True) == ("shuffle", "blank")
    with pytest.raises(ValueError, match="unknown ablation 'noise'"):
        parse_ablate("blank,noise", True)


def test_category_table_and_paired_tests_by_hand():
    # [records 3, G 2, metrics (acc, iou)]; categories a, b, a
    real = np.array([[[1, 0.5], [0, 0.5]], [[1, 1.0], [1, 0.0]], [[0, 0.25], [0, 0.75]]])
    cats, names = ["a", "b", "a"], ["acc", "iou"]
    t = category_table(real, cats, names)
    # all: acc (1+0+1+1+0+0)/6 = 0.5, iou (0.5+0.5+1+0+0.25+0.75)/6 = 0.5; a: acc 1/4, iou 2/4; b: acc 1, iou 0.5
    assert t == {
        "all": {"acc": 0.5, "iou": 0.5, "n": 6},
        "a": {"acc": 0.25, "iou": 0.5, "n": 4},
        "b": {"acc": 1.0, "iou": 0.5, "n": 2},
    }
    tests = paired_tests({"real": real, "blank": np.zeros_like(real)}, cats, names)
    # per-record means real acc [0.5, 1, 0] -> blank 0: differences -0.5, -1, 0 (zero dropped), W+ = 0 of n = 2,
    # P(W+ <= 0) = 1/4 -> p = 0.5; iou [0.5, 0.5, 0.5]: three tied -0.5, W+ = 0, P = 1/8 -> p = 0.25
    acc, iou = tests["blank"]["all"]["acc"], tests["blank"]["all"]["iou"]
    assert (acc["test"], acc["p"], acc["diff"]) == ("wilcoxon", 0.5, -0.5)
    assert (iou["test"], iou["p"], iou["diff"]) == ("wilcoxon", 0.25, -0.5)
    # G = 1 on 0/1 answers: McNemar; category b has one record, right with real and wrong blank: p = 2/2 = 1
    one = paired_tests({"real": real[:, :1], "blank": np.zeros_like(real[:, :1])}, cats, names)
    assert one["blank"]["b"]["acc"] | {} == {"test": "mcnemar", "n": 1, "diff": -1.0, "p": 1.0, "n10": 1, "n01": 0}


def _check_result(res: dict, path: Path, metrics: list[str]) -> None:
    assert list(res["conditions"]) == ["real", "blank", "shuffled"]
    saved = json.loads(path.read_text())
    assert saved["conditions"] == res["conditions"] and saved["tests"] == json.loads(json.dumps(res["tests"]))
    for cond, table in res["conditions"].items():
        assert table["all"]["n"] == res["records"] * res["group_size"]
        assert all(0.0 <= table["all"][m] <= 1.0 for m in metrics)
    for cond in ("blank", "shuffled"):
        for cat, row in res["tests"][cond].items():
            for m in metrics:
                t = row[m]
                assert t["n"] == res["conditions"]["real"][cat]["n"] and 0.0 < t["p"] <= 1.0
                assert t["diff"] == pytest.approx(res["conditions"][cond][cat][m] - res["conditions"]["real"][cat][m])
                assert t["test"] == "mcnemar" or t["test"] == "wilcoxon"
    text = format_looking(res)
    assert text.splitlines()[0].split()[:6] == ["category", "metric", "n", "real", "blank", "shuffled"]


def test_eval_ablation_end_to_end_shapes_vlm(tmp_path):
    from mmgrpo.config import load_config
    from mmgrpo.evaluate import evaluate_run
    from mmgrpo.report import write_report

    cfg = load_config(
        ROOT / "configs" / "vlm" / "shapes_vqa.yaml",
        [f"run.output_dir={tmp_path}", "pipeline.kwargs.eval_size=4", "pipeline.kwargs.train_size=4"],
    )
    res, path = evaluate_run(cfg, "none", group_size=1, ablate="auto", samples=1)
    assert path == tmp_path / "eval" / "base.json" and res["records"] == 4
    _check_result(res, path, ["format", "accuracy"])
    assert res["tests"]["blank"]["all"]["accuracy"]["test"] == "mcnemar"  # one 0/1 answer per question
    items = json.loads((tmp_path / "eval" / "base_samples" / "items.json").read_text())
    assert items[0]["image"].endswith(".png") and "text" in items[0]  # the question's image and the answer
    page = write_report(tmp_path).read_text()
    assert "Is it looking?" in page and "<table class='looking'>" in page


def test_eval_ablation_end_to_end_shapes_video(tmp_path):
    pytest.importorskip("av")
    from mmgrpo.cli import main

    args = [
        "eval",
        str(ROOT / "configs" / "video" / "shapes_grounding.yaml"),
        f"run.output_dir={tmp_path}",
        f"pipeline.kwargs.cache_dir={tmp_path / 'clips'}",
        f"pipeline.kwargs.frame_cache={tmp_path / 'fc'}",
        "pipeline.kwargs.eval_size=3",
        "pipeline.kwargs.train_size=2",
        "ckpt=none",
        "group_size=1",
        "samples=0",
    ]
    assert main(args) == 0  # ablate=auto: a video recipe gets blank and shuffled frames
    path = tmp_path / "eval" / "base.json"
    _check_result(json.loads(path.read_text()), path, ["format", "temporal_iou", "r@0.5"])


def test_ablation_of_a_text_only_pipeline_is_a_one_line_error(tmp_path, capsys):
    from mmgrpo.cli import main

    assert (
        main(
            [
                "eval",
                str(ROOT / "configs" / "toy_count.yaml"),
                f"run.output_dir={tmp_path}",
                "ckpt=none",
                "ablate=blank",
                "limit=2",
                "group_size=1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ablate=blank" in err and "no images or videos" in err
