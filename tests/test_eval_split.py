"""`pipeline.kwargs.eval_split` picks the held-out split `mmgrpo eval` scores (issue 14 reports test, tuning uses val)."""

import pytest

from mmgrpo.errors import UserError
from pipelines.vlm.data import check_eval_split, load_records


def _ids(split: str) -> list[str]:
    recs = load_records(
        "shapes_vqa",
        split=split,
        size=6,
        seed=0,
        resolution=32,
        question_types=None,
        skip_bad_images=False,
        field="pipeline.kwargs.eval_data",
    )
    return [r["id"] for r in recs]


def test_test_split_differs_from_val():
    val, test = _ids("val"), _ids("test")
    assert val != test and not set(val) & set(test)


@pytest.mark.parametrize("bad", ["Test", "validation", ""])
def test_unknown_split_names_field_and_choices(bad):
    with pytest.raises(UserError) as err:
        check_eval_split(bad)
    msg = str(err.value)
    assert "pipeline.kwargs.eval_split" in msg and "val, test, train" in msg and repr(bad) in msg
