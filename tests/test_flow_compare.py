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


def test_eval_is_deterministic_ode_sampling():
    assert "pipeline.kwargs.noise_level=0" in EVAL_OVERRIDES and "pipeline.kwargs.plan=independent" in EVAL_OVERRIDES


def test_non_flow_recipe_is_a_one_line_error(capsys):
    assert main(["configs/toy_count.yaml"]) == 2
    assert "needs a flow recipe" in capsys.readouterr().err
