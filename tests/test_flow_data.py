"""Prompt sources of the flow pipeline: ShapesWorld splits by category, and the errors for bad specs."""

import pytest

from mmgrpo.errors import UserError
from mmgrpo_shapes.scenes import list_prompts
from pipelines.flow.build import read_prompts


def test_shapes_prompts_follow_the_split_and_category():
    recs = read_prompts("shapes:test:single_object,counting")
    assert {r["category"] for r in recs} == {"single_object", "counting"}
    assert [r["prompt"] for r in recs] == list_prompts("test", "single_object") + list_prompts("test", "counting")
    train = {r["prompt"] for r in read_prompts("shapes:train")}
    assert not train & {r["prompt"] for r in read_prompts("shapes:test")}  # splits never share a prompt


@pytest.mark.parametrize("spec", ["shapes:dev", "shapes:train:stars"])
def test_bad_shapes_spec_names_the_choices(spec):
    with pytest.raises(UserError, match="shapes:<split>"):
        read_prompts(spec)
