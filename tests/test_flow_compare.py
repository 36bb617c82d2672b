"""pipelines.flow.compare: the before/after table (changes in points); the report it rewrites is tests/test_report.py's."""

from pipelines.flow.compare import EVAL_OVERRIDES, compare_table, main


def test_compare_table_rows_and_changes_in_points():
    before = {
        "all": {"strict": 0.25, "partial": 0.5, "total": 0.5, "n": 8},
        "colors": {"strict": 0.5, "partial": 0.75, "total": 0.75, "n": 4},
    }
    after = {
        "all": {"strict": 0.625, "partial": 0.5, "total": 0.5, "n": 8},
        "colors": {"strict": 0.25, "partial": 1.0, "total": 1.0, "n": 4},
    }
    lines = compare_table(before, after, ["strict", "partial"]).splitlines()
    assert lines[0].split()[:2] == ["category", "n"]
    # all: strict 0.25 -> 0.625 is +37.5 points, partial unchanged; colors: strict -25.0, partial +25.0
    assert lines[2].split() == ["all", "8", "0.250", "0.625", "+37.5", "0.500", "0.500", "+0.0"]
    assert lines[3].split() == ["colors", "4", "0.500", "0.250", "-25.0", "0.750", "1.000", "+25.0"]


def test_compare_table_monitor_changes_as_a_plain_difference():
    # objects per image 2.128 -> 2.897 is +0.769 objects, not "+76.9" points (the 2026-11-28 demo printed that)
    before = {"all": {"strict": 0.291, "objects": 2.128, "n": 320}}
    after = {"all": {"strict": 0.487, "objects": 2.897, "n": 320}}
    line = compare_table(before, after, ["strict", "objects"], points={"strict"}).splitlines()[2].split()
    assert line == ["all", "320", "0.291", "0.487", "+19.6", "2.128", "2.897", "+0.769"]


def test_eval_is_deterministic_ode_sampling():
    assert "pipeline.kwargs.noise_level=0" in EVAL_OVERRIDES and "pipeline.kwargs.plan=independent" in EVAL_OVERRIDES


def test_non_flow_recipe_is_a_one_line_error(capsys):
    assert main(["configs/toy_count.yaml"]) == 2
    assert "needs a flow recipe" in capsys.readouterr().err
