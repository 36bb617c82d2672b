"""Tests for the ShapesWorld verifier: accuracy on ground truth (clean, noisy, blurred), near chance on shuffled
prompts, hand-worked partial credit, input types, connected components and touching objects."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo_shapes.scenes import CATEGORIES, COLORS, Scene, SceneObject, ground_truth_scenes, list_prompts
from mmgrpo_shapes.verifier import category_report, connected_components, detect, score, verify


def _gt_items(resolution=32, per_category=50):
    items = []
    for cat in CATEGORIES:
        prompts = [p for split in ("train", "val", "test") for p in list_prompts(split, cat)]
        for i in range(per_category):
            prompt = prompts[(i * 7919) % len(prompts)]
            scene = ground_truth_scenes(prompt, 1, seed=i, resolution=resolution)[0]
            items.append((cat, prompt, scene.render()))
    return items


def _blur(img, sigma=0.8):
    # separable Gaussian, radius 2, edge padding
    k = np.exp(-0.5 * (np.arange(-2, 3) / sigma) ** 2)
    k /= k.sum()
    x = np.pad(img.astype(np.float32), ((2, 2), (2, 2), (0, 0)), mode="edge")
    x = sum(k[i] * x[i : i + img.shape[0]] for i in range(5))
    x = sum(k[i] * x[:, i : i + img.shape[1]] for i in range(5))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def items32():
    return _gt_items(32)


def _accuracy(images, prompts):
    return float(score(images, prompts, mode="strict").mean())


def test_ground_truth_accuracy_per_category(items32):
    for cat in CATEGORIES:
        sub = [(p, im) for c, p, im in items32 if c == cat]
        acc = _accuracy([im for _, im in sub], [p for p, _ in sub])
        assert acc >= 0.99, (cat, acc)
    assert len(items32) == 300


def test_ground_truth_accuracy_64px():
    items = _gt_items(64, per_category=10)
    assert _accuracy([im for *_, im in items], [p for _, p, _ in items]) >= 0.99


def test_accuracy_with_noise_and_blur(items32):
    rng = np.random.default_rng(0)
    prompts = [p for _, p, _ in items32]
    noisy = [np.clip(im + rng.normal(0, 8, im.shape), 0, 255).astype(np.uint8) for *_, im in items32]
    blurred = [_blur(im) for *_, im in items32]
    assert _accuracy(noisy, prompts) >= 0.95
    assert _accuracy(blurred, prompts) >= 0.95


def test_shuffled_prompts_near_chance(items32):
    rng = np.random.default_rng(0)
    prompts = [p for _, p, _ in items32]
    perm = rng.permutation(len(items32))
    # lenient categories ("a circle") are often true of other scenes too, as in GenEval; still far below 1
    assert _accuracy([im for *_, im in items32], [prompts[i] for i in perm]) < 0.25
    hard = [(p, im) for c, p, im in items32 if c in ("colors", "position", "color_attr")]
    perm = rng.permutation(len(hard))
    assert _accuracy([im for _, im in hard], [hard[i][0] for i in perm]) < 0.15


def _draw(*objs, res=32):
    return Scene(tuple(SceneObject(*o) for o in objs), None, res).render()


def test_partial_credit_hand_worked_colors():
    # "a red circle": per object 0.5 shape + 0.5 colour
    prompt = "a red circle"
    ok = verify(_draw(("circle", "red", 0.5, 0.5, 0.2)), prompt)
    wrong_shape = verify(_draw(("square", "red", 0.5, 0.5, 0.2)), prompt)
    wrong_color = verify(_draw(("circle", "blue", 0.5, 0.5, 0.2)), prompt)
    both_wrong = verify(_draw(("square", "blue", 0.5, 0.5, 0.2)), prompt)
    empty = verify(_draw(), prompt)
    assert (ok["strict"], ok["partial"]) == (True, 1.0)
    assert (wrong_shape["strict"], wrong_shape["partial"]) == (False, 0.5)
    assert (wrong_color["strict"], wrong_color["partial"]) == (False, 0.5)
    assert both_wrong["partial"] == 0.0 and empty["partial"] == 0.0 and empty["objects"] == []


def test_partial_credit_position_and_attribute_binding():
    prompt = "a red circle left of a blue square"
    good = _draw(("circle", "red", 0.25, 0.5, 0.15), ("square", "blue", 0.75, 0.5, 0.15))
    swapped = _draw(("circle", "red", 0.75, 0.5, 0.15), ("square", "blue", 0.25, 0.5, 0.15))
    res = verify(swapped, prompt)
    # both objects right (1 + 1), relation wrong (0): (1 + 1 + 0) / 3
    assert res["strict"] is False and res["partial"] == pytest.approx(2 / 3) and res["relation_ok"] is False
    assert verify(good, prompt)["strict"] is True
    # colours swapped between shapes: each object earns shape 0.5 only -> (0.5 + 0.5) / 2
    bound = _draw(("square", "red", 0.25, 0.5, 0.15), ("circle", "blue", 0.75, 0.5, 0.15))
    res = verify(bound, "a red circle and a blue square")
    assert res["strict"] is False and res["partial"] == pytest.approx(0.5)


def test_counting_is_exact_and_partial_is_found_over_max():
    three = "three circles"
    pos = [(0.2, 0.2), (0.8, 0.2), (0.2, 0.8), (0.8, 0.8)]
    draws = {n: _draw(*[("circle", "green", x, y, 0.14) for x, y in pos[:n]]) for n in (2, 3, 4)}
    assert verify(draws[3], three)["strict"] is True
    # 2 found: 2 / 3; 4 found: min(4, 3) / max(4, 3) = 3 / 4
    assert verify(draws[2], three)["partial"] == pytest.approx(2 / 3)
    four = verify(draws[4], three)
    assert four["strict"] is False and four["partial"] == pytest.approx(0.75)
    # other shapes do not count against "three circles"
    extra = _draw(*[("circle", "green", x, y, 0.14) for x, y in pos[:3]], ("square", "red", 0.5, 0.5, 0.12))
    assert verify(extra, three)["strict"] is True


def test_extra_objects_allowed_outside_counting():
    img = _draw(("circle", "red", 0.25, 0.5, 0.15), ("square", "blue", 0.75, 0.5, 0.15))
    assert verify(img, "a circle")["strict"] is True
    assert verify(img, "a triangle")["strict"] is False


def test_input_types_agree():
    scenes = ground_truth_scenes("a red circle above a green triangle", 3, seed=5)
    arrays = [s.render() for s in scenes]
    prompts = [scenes[0].prompt] * 3
    ref = score(arrays, prompts)
    pil = score([Image.fromarray(a) for a in arrays], prompts)
    float_t = score([torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in arrays], prompts)
    uint8_t = score([torch.from_numpy(a).permute(2, 0, 1) for a in arrays], prompts)
    batch = score(torch.stack([torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in arrays]), prompts)
    assert ref.dtype == np.float32 and ref.shape == (3,)
    for other in (pil, float_t, uint8_t, batch):
        np.testing.assert_array_equal(other, ref)
    assert (ref == 1.0).all()


def test_score_errors():
    img = _draw(("circle", "red", 0.5, 0.5, 0.2))
    with pytest.raises(ValueError, match="mode"):
        score([img], ["a red circle"], mode="soft")
    with pytest.raises(ValueError, match="1 images but 2 prompts"):
        score([img], ["a red circle", "a circle"])
    with pytest.raises(ValueError, match="grammar"):
        score([img], ["a cat"])
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        score([torch.zeros(32, 32, 3)], ["a circle"])


def test_connected_components_by_hand():
    c = -np.ones((5, 6), int)
    c[0, 0:2] = 0  # blob A
    c[1, 1] = 0  # joined to A from below
    c[0, 3] = 0  # separated from A by one background pixel
    c[2, 2] = 0  # touches A only diagonally: a separate component under 4-connectivity
    c[4, 0:6] = 1  # a long run of another class
    c[3, 5] = 2  # touches the run but has another class
    lab = connected_components(c)
    assert lab[0, 0] == lab[0, 1] == lab[1, 1] == 0
    assert len({lab[0, 0], lab[0, 3], lab[2, 2], lab[4, 0], lab[3, 5]}) == 5
    assert (lab[4] == lab[4, 0]).all() and (lab[c < 0] == -1).all()


def test_touching_objects_of_one_colour_merge():
    # defined behaviour: generated scenes keep boxes MARGIN apart; touching same-coloured objects are one blob
    touching = _draw(("square", "red", 0.3, 0.5, 0.2), ("square", "red", 0.7, 0.5, 0.2))
    dets = detect(touching)
    assert len(dets) == 1
    assert verify(touching, "two squares")["strict"] is False
    # touching objects of different colours are still two objects
    two = _draw(("square", "red", 0.3, 0.5, 0.2), ("square", "blue", 0.7, 0.5, 0.2))
    assert sorted(d["color"] for d in detect(two)) == ["blue", "red"]


def test_detect_reports_geometry():
    dets = detect(_draw(("circle", "yellow", 0.3, 0.6, 0.2), res=64))
    (d,) = dets
    assert d["shape"] == "circle" and d["color"] == "yellow"
    assert d["cx"] == pytest.approx(0.3, abs=1 / 32) and d["cy"] == pytest.approx(0.6, abs=1 / 32)
    assert d["w"] == pytest.approx(0.4, abs=1 / 32)
    assert set(COLORS) >= {d["color"]}


def test_category_report(items32):
    sub = items32[::25]  # 2 per category
    prompts = [p for _, p, _ in sub]
    images = [im for *_, im in sub]
    # break the first image: an empty canvas scores 0 strict and 0 partial
    images[0] = np.full_like(images[0], 242)
    table = category_report(images, prompts)
    first = sub[0][0]
    assert table[first] == {"strict": 0.5, "partial": 0.5, "n": 2}
    assert set(table) == set(CATEGORIES) | {"overall"}
    # overall = mean over the 6 categories: (5 * 1 + 0.5) / 6
    assert table["overall"]["strict"] == pytest.approx(5.5 / 6) and table["overall"]["n"] == 12


def test_float_inputs_are_read_as_unit_range():
    img = _draw(("triangle", "cyan", 0.5, 0.5, 0.25))
    as_float = img.astype(np.float64) / 255.0
    assert score([as_float], ["a cyan triangle"])[0] == 1.0
    # a dark float image stays dark: [0, 1] is never re-guessed from the values
    dark = torch.full((3, 8, 8), 0.5 / 255)
    from mmgrpo_shapes.verifier import to_uint8

    assert to_uint8(dark).max() <= 1
    with pytest.raises(ValueError, match="dtype"):
        to_uint8(img.astype(np.int64))


def test_extra_penalty_hand_worked():
    # "a red circle" with a red circle and a blue square: partial 1.0, one unrequested object.
    # extra_penalty 0.25: max(0, 1.0 - 0.25 * 1) = 0.75; strict 1 - 0.25 = 0.75; default 0 leaves 1.0.
    img = _draw(("circle", "red", 0.25, 0.5, 0.15), ("square", "blue", 0.75, 0.5, 0.15))
    assert score([img], ["a red circle"])[0] == 1.0
    assert score([img], ["a red circle"], extra_penalty=0.25)[0] == pytest.approx(0.75)
    assert score([img], ["a red circle"], mode="strict", extra_penalty=0.25)[0] == pytest.approx(0.75)
    # floored at 0: wrong colour (0.5) minus 0.6 per extra -> max(0, 0.5 - 0.6) = 0
    assert score([img], ["a green circle"], extra_penalty=0.6)[0] == 0.0
    # counting is not penalised again: 3 circles + a square for "three circles" stays strict 1 and partial 1
    pos = [(0.2, 0.2), (0.8, 0.2), (0.2, 0.8)]
    four = _draw(*[("circle", "green", x, y, 0.14) for x, y in pos], ("square", "red", 0.5, 0.5, 0.12))
    assert score([four], ["three circles"], extra_penalty=0.5)[0] == 1.0
    with pytest.raises(ValueError, match="extra_penalty"):
        score([img], ["a red circle"], extra_penalty=2.0)


def test_shapes_objects_counts_detections_by_hand():
    import rewards

    # two drawn shapes -> 2, an empty canvas -> 0, whatever the prompt (none is needed)
    img = _draw(("circle", "red", 0.25, 0.5, 0.15), ("square", "blue", 0.75, 0.5, 0.15))
    empty = np.full_like(img, 242)
    monitor = rewards.load("shapes_objects")
    assert np.asarray(monitor([img, empty], prompts=None), dtype=float).tolist() == [2.0, 0.0]
