"""Tests for ShapesWorld scenes: prompt grammar, splits, determinism, geometry of ground-truth scenes, rendering."""

import numpy as np
import pytest

from mmgrpo_shapes.scenes import (
    BACKGROUND,
    CATEGORIES,
    COLORS,
    MARGIN,
    SPLITS,
    ObjectSpec,
    PromptSpec,
    Scene,
    SceneObject,
    all_specs,
    boxes_apart,
    canonical_key,
    ground_truth_scenes,
    list_prompts,
    parse_prompt,
    prompts_by_category,
    random_scene,
    relation_holds,
    render,
    split_of,
)


def test_same_seed_same_pixels_different_seed_differs():
    a = [s.render() for s in ground_truth_scenes("a red circle left of a blue square", 4, seed=3)]
    b = [s.render() for s in ground_truth_scenes("a red circle left of a blue square", 4, seed=3)]
    c = [s.render() for s in ground_truth_scenes("a red circle left of a blue square", 4, seed=4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not any(np.array_equal(x, y) for x, y in zip(a, c))
    # the scenes of one prompt do not depend on which other prompts were rendered before
    ground_truth_scenes("three squares", 2, seed=3)
    d = [s.render() for s in ground_truth_scenes("a red circle left of a blue square", 4, seed=3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, d))


@pytest.mark.parametrize("spec", all_specs()[::7] + all_specs("single_object") + all_specs("two_objects"))
def test_prompt_text_round_trips(spec):
    assert parse_prompt(spec.prompt) == spec


def test_parse_examples_and_tolerance():
    spec = parse_prompt("A photo of a red circle left of a blue square.")
    assert spec == PromptSpec("position", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue")), "left of")
    assert parse_prompt("three triangles") == PromptSpec("counting", (ObjectSpec("triangle", None, 3),), exact=True)
    assert parse_prompt("a circle and a square").category == "two_objects"
    assert parse_prompt("a red circle and a blue square").category == "color_attr"
    assert parse_prompt("a yellow triangle").category == "colors"
    assert parse_prompt("an  square").category == "single_object"


def test_unknown_prompt_raises_with_the_prompt():
    with pytest.raises(ValueError, match="a red dog"):
        parse_prompt("a red dog")


def test_splits_are_disjoint_and_cover_every_prompt_and_category():
    sets = {s: set(list_prompts(s)) for s in SPLITS}
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not (sets[a] & sets[b]), (a, b)
    assert set().union(*sets.values()) == {s.prompt for s in all_specs()}
    for split in SPLITS:
        by_cat = prompts_by_category(split)
        assert set(by_cat) == set(CATEGORIES)
        assert all(len(v) >= 1 for v in by_cat.values()), (split, {k: len(v) for k, v in by_cat.items()})
    # the big categories are split roughly 70 / 15 / 15
    n = {s: len(list_prompts(s, "position")) for s in SPLITS}
    assert 0.6 < n["train"] / sum(n.values()) < 0.8


def test_equivalent_phrasings_share_a_split():
    assert canonical_key(parse_prompt("a blue square right of a red circle")) == "a red circle left of a blue square"
    for spec in all_specs("position"):
        a, b = spec.objects
        flipped = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[spec.relation]
        assert split_of(spec) == split_of(PromptSpec("position", (b, a), flipped))
    assert split_of("a blue square and a red circle") == split_of("a red circle and a blue square")


def test_category_counts():
    # 3 shapes, 6 colours: single 3, pairs C(3,2)=3, counting 3x{2,3,4}=9, colours 18,
    # color_attr: pairs of (colour, shape) with both differing = 6*5*3*2/2 = 90, position 18*17*4 = 1224
    got = {c: len(all_specs(c)) for c in CATEGORIES}
    assert got == dict(single_object=3, two_objects=3, counting=9, colors=18, position=1224, color_attr=90)


@pytest.mark.parametrize("category", CATEGORIES)
def test_ground_truth_scenes_match_their_spec(category):
    for prompt in list_prompts("train", category)[:6]:
        spec = parse_prompt(prompt)
        for scene in ground_truth_scenes(prompt, 3, seed=1):
            want = sorted((o.shape, o.color) for o in spec.objects for _ in range(o.count))
            got = sorted((o.shape, o.color if want[0][1] else None) for o in scene.objects)
            if all(w[1] for w in want):
                assert got == want
            else:
                assert sorted(g[0] for g in got) == sorted(w[0] for w in want)
            objs = scene.objects
            assert all(boxes_apart(a, b, MARGIN) for i, a in enumerate(objs) for b in objs[i + 1 :])
            assert all(o.size <= o.cx <= 1 - o.size and o.size <= o.cy <= 1 - o.size for o in objs)
            if spec.relation:
                a, b = objs[:2]
                box_a, box_b = (2 * a.size,) * 2, (2 * b.size,) * 2
                assert relation_holds((a.cx, a.cy), box_a, (b.cx, b.cy), box_b, spec.relation)


def test_relation_holds_golden():
    # A at (0.2, 0.5), B at (0.6, 0.6): d = (0.4, 0.1), |d| = 0.4123; "left of": along = 0.4 > 0.1 * (0.2 + 0.2)
    # = 0.04 and 0.4 >= 0.5 * 0.4123 -> True; "above": along = 0.1 > 0.04 but 0.1 < 0.206 -> False
    ext = (0.2, 0.2)
    assert relation_holds((0.2, 0.5), ext, (0.6, 0.6), ext, "left of")
    assert not relation_holds((0.2, 0.5), ext, (0.6, 0.6), ext, "above")
    assert not relation_holds((0.2, 0.5), ext, (0.6, 0.6), ext, "right of")
    assert relation_holds((0.6, 0.6), ext, (0.2, 0.5), ext, "right of")
    # too close along the axis: along = 0.03 < 0.04
    assert not relation_holds((0.5, 0.5), ext, (0.53, 0.5), ext, "left of")
    with pytest.raises(ValueError, match="relation"):
        relation_holds((0, 0), ext, (1, 1), ext, "behind")


def test_render_pixels_by_hand():
    # a red square of half-extent 0.25 centred at (0.25, 0.25) at 8 px covers pixels 0..3 x 0..3 exactly
    scene = Scene((SceneObject("square", "red", 0.25, 0.25, 0.25),), None, 8)
    img = render(scene, antialias=False)
    assert img.shape == (8, 8, 3) and img.dtype == np.uint8
    assert (img[:4, :4] == COLORS["red"]).all()
    assert (img[4:, :] == BACKGROUND).all() and (img[:, 4:] == BACKGROUND).all()
    # antialiased: this square lies on pixel edges, so supersampling gives the same image
    assert np.array_equal(render(scene, antialias=True), img)
    # an upward triangle: wide at the bottom of its box, a point at the top
    tri = render(Scene((SceneObject("triangle", "blue", 0.5, 0.5, 0.5),), None, 16), antialias=False)
    is_blue = (tri == COLORS["blue"]).all(-1)
    assert is_blue[15].sum() > 12 and is_blue[0].sum() <= 2
    with pytest.raises(ValueError, match="resolution"):
        render(scene, 4)


def test_resolution_and_random_scene():
    s = ground_truth_scenes("a red circle", 1, resolution=64)[0]
    assert s.render().shape == (64, 64, 3)
    assert s.render(32).shape == (32, 32, 3)
    r = random_scene(np.random.default_rng(0), n_objects=4)
    assert len(r.objects) == 4 and r.prompt is None


def test_unknown_split_and_category_raise():
    with pytest.raises(ValueError, match="split"):
        list_prompts("dev")
    with pytest.raises(ValueError, match="category"):
        all_specs("size")
