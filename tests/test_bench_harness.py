"""Tests of the benchmark harness (bench/common.py, bench/run_all.py) and the flow bench's small formulas.

Fake clocks and fake timings only: no test measures or asserts real time.
"""

import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import common, run_all


class FakeClock:
    """A clock that only moves when a fake workload says how long it took."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def workload(clock: FakeClock, durations: list[float], log: list[str], side: str):
    it = iter(durations)

    def fn():
        log.append(side)
        clock.t += next(it)
        return f"{side}{len(log)}"

    return fn


# ---- measure_pair


def test_measure_pair_alternates_ab_then_ba():
    clock, log = FakeClock(), []
    r = common.measure_pair(
        workload(clock, [1.0] * 4, log, "a"), workload(clock, [1.0] * 4, log, "b"), repeats=3, warmup=1, clock=clock
    )
    # pair 0 (warm-up) A,B; pair 1 B,A; pair 2 A,B; pair 3 B,A
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert r["order"] == log
    assert len(r["times_a"]) == len(r["times_b"]) == 3


def test_measure_pair_ratio_median_min_max_skip_warmup():
    clock, log = FakeClock(), []
    # A always takes 2 s; B takes 50 s in the warm-up (must be ignored), then 1, 0.5, 4 s
    r = common.measure_pair(
        workload(clock, [2.0] * 4, log, "a"),
        workload(clock, [50.0, 1.0, 0.5, 4.0], log, "b"),
        repeats=3,
        warmup=1,
        clock=clock,
    )
    # a/b per pair: 2/1 = 2, 2/0.5 = 4, 2/4 = 0.5 -> median 2, min 0.5, max 4
    assert r["ratios"] == pytest.approx([2.0, 4.0, 0.5])
    assert (r["median"], r["min"], r["max"]) == pytest.approx((2.0, 0.5, 4.0))
    assert r["times_a"] == pytest.approx([2.0, 2.0, 2.0])
    assert r["times_b"] == pytest.approx([1.0, 0.5, 4.0])


def test_measure_pair_b_over_a_and_even_repeats():
    clock, log = FakeClock(), []
    r = common.measure_pair(
        workload(clock, [1.0, 2.0, 4.0, 8.0], log, "a"),
        workload(clock, [3.0, 3.0, 3.0, 3.0], log, "b"),
        repeats=4,
        warmup=0,
        ratio="b/a",
        clock=clock,
    )
    # b/a: 3/1, 3/2, 3/4, 3/8 = 3, 1.5, 0.75, 0.375; median of four = (1.5 + 0.75) / 2 = 1.125
    assert r["ratios"] == pytest.approx([3.0, 1.5, 0.75, 0.375])
    assert r["median"] == pytest.approx(1.125)
    assert r["median"] == pytest.approx(statistics.median([3.0, 1.5, 0.75, 0.375]))


def test_measure_pair_keeps_outputs_of_counted_calls():
    clock, log = FakeClock(), []
    r = common.measure_pair(
        workload(clock, [1.0] * 3, log, "a"), workload(clock, [1.0] * 3, log, "b"), repeats=2, warmup=1, clock=clock
    )
    # calls: a1 b2 | b3 a4 | a5 b6 -> counted outputs a4, a5 and b3, b6
    assert r["out_a"] == ["a4", "a5"]
    assert r["out_b"] == ["b3", "b6"]


@pytest.mark.parametrize("kw", [{"repeats": 0}, {"warmup": -1}, {"ratio": "a-b"}])
def test_measure_pair_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        common.measure_pair(lambda: None, lambda: None, **kw)


def test_fmt_ratio_and_summarise():
    s = common.summarise([3.0, 1.0, 2.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert common.fmt_ratio(s) == "2.00x (min 1.00, max 3.00, n=3)"
    with pytest.raises(ValueError):
        common.summarise([])


def test_md_table():
    assert common.md_table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


# ---- results.md assembly


def test_results_md_assembled_in_stable_order(tmp_path):
    d = tmp_path / "sections"
    for name in ("zeta", "vlm", "alpha", "flow"):
        common.write_section(name, f"## {name}\n\nbody of {name}\n", sections_dir=d)
    out = tmp_path / "results.md"
    text = common.assemble_results(header="# Header", sections_dir=d, out=out)
    assert out.read_text() == text
    assert text.startswith("# Header\n\n## flow")
    # known sections in ORDER (flow, vlm), then the others alphabetically
    pos = [text.index(f"## {n}") for n in ("flow", "vlm", "alpha", "zeta")]
    assert pos == sorted(pos)
    assert "body of zeta\n" in text


def test_summary_rows_go_first_in_results_and_into_the_readme(tmp_path):
    common.write_section("vlm_prefix", "## VLM prefix\n\nbody", sections_dir=tmp_path)
    common.write_summary("vlm_prefix", [("prefix", "3.1x", ">= 4x")], sections_dir=tmp_path)
    common.write_summary("flow", [("tree", "1.7x", ">= 3x"), ("window", "1.4x", ">= 2x")], sections_dir=tmp_path)
    table = common.summary_table(sections_dir=tmp_path)
    rows = [line for line in table.splitlines()[2:]]
    assert rows == [
        "| tree | 1.7x | >= 3x |",
        "| window | 1.4x | >= 2x |",
        "| prefix | 3.1x | >= 4x |",
    ]  # ORDER: flow first
    text = common.assemble_results(header="# H", sections_dir=tmp_path, out=tmp_path / "results.md")
    assert text.index("## Summary") < text.index("| tree |") < text.index("## VLM prefix")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{common.README_START}\nold table\n{common.README_END}\nafter\n")
    assert common.update_readme(table, readme)
    new = readme.read_text()
    assert "old table" not in new and "| window | 1.4x | >= 2x |" in new and new.endswith("after\n")
    assert common.update_readme(table, readme) and readme.read_text() == new  # idempotent
    (tmp_path / "NO.md").write_text("no markers\n")
    assert not common.update_readme(table, tmp_path / "NO.md")


def test_write_summary_rejects_rows_that_are_not_triples(tmp_path):
    with pytest.raises(ValueError, match="triples"):
        common.write_summary("flow", [("tree", "1.7x")], sections_dir=tmp_path)
    with pytest.raises(ValueError, match="triples"):
        common.write_summary("flow", [], sections_dir=tmp_path)


def test_write_section_replaces_previous_version(tmp_path):
    common.write_section("flow", "## flow\n\nold", sections_dir=tmp_path)
    common.write_section("flow", "## flow\n\nnew", sections_dir=tmp_path)
    text = common.assemble_results(header="# H", sections_dir=tmp_path, out=tmp_path / "r.md")
    assert "new" in text and "old" not in text
    assert [p.name for p in tmp_path.glob("*.md*") if p.name != "r.md"] == ["flow.md"]


@pytest.mark.parametrize("bad", ["", "a/b", ".hidden"])
def test_write_section_rejects_bad_names(tmp_path, bad):
    with pytest.raises(ValueError):
        common.write_section(bad, "x", sections_dir=tmp_path)


def test_results_header_names_machine_and_ratio_rule():
    h = common.results_header("CPU X, 2/2 cores", "2026-01-01 00:00 UTC", "abc123")
    assert "CPU X, 2/2 cores" in h and "2026-01-01 00:00 UTC" in h and "abc123" in h
    assert "ratio" in h


def test_machine_line_describes_cpu_and_torch():
    import torch

    line = common.machine()
    assert common.cpu_model() in line
    assert torch.__version__ in line and "thread" in line


# ---- run_all


def test_discover_skips_harness_and_private_files(tmp_path):
    for n in ("common", "run_all", "_helper", "flow", "vlm"):
        (tmp_path / f"{n}.py").write_text("")
    (tmp_path / "notes.md").write_text("")
    assert run_all.discover(tmp_path) == ["flow", "vlm"]


def test_failure_section_keeps_the_last_lines():
    text = run_all.failure_section("flow", "timed out after 5 s", "\n".join(f"line {i}" for i in range(40)))
    assert text.startswith("## flow: no result")
    assert "timed out after 5 s" in text and "line 39" in text and "line 24" not in text


def test_run_one_reports_a_failing_script(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    monkeypatch.setattr(run_all, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(common, "SECTIONS_DIR", tmp_path / "sections")
    ok, _ = run_all.run_one("broken", timeout=60, nice=0)
    assert not ok
    text = (tmp_path / "sections" / "broken.md").read_text()
    assert "exited with code 3" in text and "about to fail" in text


def test_run_all_rejects_unknown_names(capsys):
    assert run_all.main(["--only", "no_such_bench"]) == 2
    assert "no_such_bench" in capsys.readouterr().err


# ---- fitted slopes and the flow bench's transition count


def test_run_all_assemble_runs_no_script(monkeypatch):
    calls = []
    monkeypatch.setattr(run_all, "run_one", lambda *a, **k: calls.append(a) or (True, 0.0))
    monkeypatch.setattr(run_all, "assemble_results", lambda **k: calls.append("assembled"))
    monkeypatch.setattr(run_all, "update_readme", lambda table: False)
    assert run_all.main(["--assemble"]) == 0
    assert calls == ["assembled"]


def test_efficiency_store_keeps_the_newest_race_per_seed():
    from bench._flow_efficiency import newest

    rows = [
        {"budget": 1200, "seed": 1, "when": "a"},
        {"budget": 1200, "seed": 0, "when": "b"},
        {"budget": 600, "seed": 0, "when": "c"},
        {"budget": 1200, "seed": 0, "when": "d"},  # `--again` appended a second race of seed 0
    ]
    assert [r["when"] for r in newest(rows)] == ["c", "d", "a"]


def test_efficiency_report_names_each_race_machine():
    """Races of different seeds can run on different machines; the section names each one's."""
    from bench._flow_efficiency import races

    rows = [
        {"seed": 0, "when": "2026-11-29 10:20 UTC", "seconds": 4987.2, "machine": "Intel Xeon, 2/2 cores usable, load average 2.0/2.0/2.0 (1/5/15 min), torch 2"},
        {"seed": 2, "when": "2026-11-29 14:24 UTC", "seconds": 5139.0, "machine": "AMD EPYC, 1/2 cores usable, load average 1.0/1.0/1.3 (1/5/15 min), torch 2"},
    ]  # fmt: skip
    assert races(rows) == (
        "Seed 0: 2026-11-29 10:20 UTC, 4987 s, Intel Xeon, 2/2 cores usable, load average 2.0/2.0/2.0 (1/5/15 min), torch 2. "
        "Seed 2: 2026-11-29 14:24 UTC, 5139 s, AMD EPYC, 1/2 cores usable, load average 1.0/1.0/1.3 (1/5/15 min), torch 2."
    )


def test_fit_slope_is_least_squares():
    slope = common.fit_slope
    # y = 2x + 1 exactly -> 2; points (0,0), (1,1), (2,0): mean x 1, mean y 1/3, cov 0 -> 0
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(0, 0), (1, 1), (2, 0)]) == pytest.approx(0.0)
    # (0,0), (1,1), (3,2): mean x 4/3, mean y 1; cov = (-4/3)(-1) + (-1/3)(0) + (5/3)(1) = 3;
    # var = 16/9 + 1/9 + 25/9 = 42/9 -> slope 27/42 = 9/14
    assert slope([(0, 0), (1, 1), (3, 2)]) == pytest.approx(9 / 14)
    assert slope([(1, 0), (1, 5)]) == 0.0
    with pytest.raises(ValueError):
        slope([])


def test_unique_transitions_of_a_binary_tree():
    from bench.flow import unique_transitions
    from pipelines.flow.plan import RolloutPlan, count_nfe

    plan = RolloutPlan(("flow_grpo",) * 16, roots=1, branches={0: 2, 4: 2, 8: 2, 12: 2})
    # nodes after each split: steps 0-3 -> 2, 4-7 -> 4, 8-11 -> 8, 12-15 -> 16: 4 * (2 + 4 + 8 + 16) = 120 per prompt
    assert unique_transitions(plan, list(range(16)), prompts=1) == 120
    assert unique_transitions(plan, list(range(16)), prompts=3) == 360
    # steps 0-7 only: 4 * (2 + 4) = 24
    assert unique_transitions(plan, list(range(8)), prompts=1) == 24
    # model calls are counted before each split: 1 + 3*2 + 2 + 3*4 + 4 + 3*8 + 8 + 3*16 = 105
    assert count_nfe(plan, 1) == 105


def test_flow_bench_nft_arm_builds_a_diffusionnft_run_with_its_target(tmp_path):
    """Part (b)'s DiffusionNFT arm reaches the run as objective nft + loss nft on the recipe's model (make_run's algo
    overrides), and the report names issue 15's 5x target for it, issue 9's 2x for the window."""
    import yaml

    from bench._flow_arms import NFT, NFT_ARM, WINDOW_ARMS, make_run
    from bench._flow_report import _target
    from bench.flow import RECIPE

    assert WINDOW_ARMS[NFT] == NFT_ARM
    plan, plan_kwargs, extra, algo = NFT_ARM
    base = yaml.safe_load(RECIPE.read_text())
    run = make_run(
        tmp_path / "nft",
        base,
        plan=plan,
        plan_kwargs=plan_kwargs,
        setting={"prompts_per_iter": 2, "k_chunk": 1},
        seed=0,
        pipeline_kwargs=extra,
        algo=algo,
    )
    written = yaml.safe_load((tmp_path / "nft" / "bench.yaml").read_text())
    assert written["algo"]["loss"] == "nft" and written["pipeline"]["kwargs"]["objective"] == "nft"
    assert written["algo"]["advantage"] == base["algo"]["advantage"]  # the rest of the recipe's algo is kept
    assert type(run.policy.objective).__name__ == "NFT"
    assert (_target(NFT), _target("window (MixGRPO)"), _target("tree")) == (">= 5x", ">= 2x", "(variant)")


def _curve(points):
    """An efficiency-race curve from (seconds, change, se) per mark; accuracy = 0.5 + change / 100."""
    return [
        {
            "seconds": s,
            "iterations": i,
            **{m: {"acc": 0.5 + c / 100, "change": c, "se": e} for m in ("partial", "strict")},
        }
        for i, (s, c, e) in enumerate(points)
    ]


def test_flow_efficiency_time_to_gain_and_ratios():
    """Time to +5 is the first mark with change >= 5 and >= 2 s.e.; the gain ratio exists only once all-step
    clearly learned; a time ratio against an all-step that never got there is a lower bound at its budget."""
    from bench import _flow_efficiency as fe

    slow = _curve([(0, 0, 0), (300, 2, 2), (600, 6, 2), (900, 8, 2), (1200, 10, 2)])
    fast = _curve([(0, 0, 0), (300, 6, 4), (600, 12, 2), (900, 14, 2), (1200, 16, 2)])  # +6 at 300 s is < 2 s.e.
    flat = _curve([(0, 0, 0), (300, 1, 2), (600, 3, 2), (900, 4, 2), (1200, 4, 2)])
    assert (
        fe.time_to(slow, "strict") == 600 and fe.time_to(fast, "strict") == 600 and fe.time_to(flat, "strict") is None
    )
    # least-squares slope of change on seconds, per minute: slow 10 points over 1200 s -> sum(dx dy)/sum(dx^2)
    # x = 0..1200 by 300 (mean 600), y = 0,2,6,8,10 (mean 5.2): sum dx dy = 600*5.2+300*3.2+0+300*2.8+600*4.8 = 7800,
    # sum dx^2 = 2*(360000+90000) = 900000 -> 0.008667 per s = 0.52 per minute
    assert abs(fe.slope(slow, "strict") - 0.52) < 1e-9
    # the whole budget is clearly learned when the longest clear prefix is every mark
    assert fe.learned_marks(slow, "strict") == len(slow) and fe.learned_marks(flat, "strict") != len(flat)
    gain, t5 = fe.ratios({fe.BASE: {"curve": slow}, "x": {"curve": fast}}, "x", "strict")
    assert gain == f"{fe.slope(fast, 'strict') / fe.slope(slow, 'strict'):.2f}x" and t5 == "1.00x"
    gain, t5 = fe.ratios({fe.BASE: {"curve": flat}, "x": {"curve": fast}}, "x", "strict")
    assert gain == "n/a (all-step never clearly +5)" and t5 == ">= 2.00x (all-step never +5)"
    assert fe.ratios({fe.BASE: {"curve": slow}, "x": {"curve": flat}}, "x", "strict")[1] == "n/a (never +5)"


def test_flow_efficiency_gain_over_the_longest_budget_where_all_step_clearly_learned():
    """All-step clear at 600 s (+8, s.e. 3) and not after (+6 and +4 < 2 s.e. or < 5): the ratio is over 0-600 s."""
    from bench import _flow_efficiency as fe

    fading = _curve([(0, 0, 0), (300, 4, 2), (600, 8, 3), (900, 6, 4), (1200, 4, 2)])
    rising = _curve([(0, 0, 0), (300, 10, 2), (600, 20, 2), (900, 30, 2), (1200, 40, 2)])
    assert fe.learned_marks(fading, "strict") == 3 != len(fading)
    # over x = 0, 300, 600 (mean 300): all-step y = 0, 4, 8 -> slope 8/600 per s; the arm y = 0, 10, 20 -> 20/600;
    # ratio 20/8 = 2.5. Over the whole budget all-step's y = 0, 4, 8, 6, 4 (mean 4.4): sum dx dy = 600*4.4 + 300*0.4
    # + 0 + 300*1.6 - 600*0.4 = 3000, / 900000 -> 4 points per 1200 s against the arm's 40: 10x, a fade read as a gain.
    assert abs(fe.slope(rising, "strict") / fe.slope(fading, "strict") - 10.0) < 1e-9
    gain, _ = fe.ratios({fe.BASE: {"curve": fading}, "x": {"curve": rising}}, "x", "strict")
    assert gain == "2.50x to 600 s"
    never = _curve([(0, 0, 0), (300, 6, 4), (600, 4, 1)])  # +6 is < 2 s.e., +4 < 5: never clear
    assert fe.learned_marks(never, "strict") == 0


class _FakeArm:
    """An Arm's interface for `interleave`: each iteration costs `cost` seconds; evaluate records when it was scored."""

    def __init__(self, cost):
        self.cost, self.spent, self.step, self.scored = cost, 0.0, 0, []

    def iterate(self):
        self.spent += self.cost
        self.step += 1
        return {"seconds": self.cost}

    def evaluate(self, evaluator):
        self.scored.append(self.spent)


def test_interleave_spends_the_same_budget_on_every_arm_and_scores_at_each_mark(capsys):
    """Least-spent arm next: a 3 s arm and a 5 s arm both run until >= 30 s (10 and 6 iterations) and are scored
    the first time they pass 10, 20 and 30 s (marks 3): at 12/21/30 s and 10/20/30 s."""
    from bench._flow_arms import interleave

    arms = {"a": _FakeArm(3.0), "b": _FakeArm(5.0)}
    outs = interleave(arms, 30.0, 3, evaluator=None, tag="t")
    assert [len(outs[n]) for n in "ab"] == [10, 6] and [a.step for a in arms.values()] == [10, 6]
    assert arms["a"].scored == [12.0, 21.0, 30.0] and arms["b"].scored == [10.0, 20.0, 30.0]
    assert "t b: 6 iterations, 30 s" in capsys.readouterr().out


def test_flow_efficiency_arms_change_only_plan_and_objective(tmp_path):
    """Every raced arm is the demo recipe; the GRPO arms swap in Flow-GRPO's clipped loss and one step per batch."""
    import yaml

    from bench import _flow_efficiency as fe
    from bench._flow_arms import make_run

    base = yaml.safe_load(fe.RECIPE.read_text())
    assert base["algo"]["loss"] == "nft" and fe.ARMS[fe.RECIPE_ARM] is None
    plan, kw, extra, algo = fe.ARMS[fe.BASE]
    make_run(tmp_path / "a", base, plan=plan, plan_kwargs=kw, setting={"prompts_per_iter": 2, "k_chunk": 1}, seed=0,
             pipeline_kwargs=extra, algo=algo)  # fmt: skip
    written = yaml.safe_load((tmp_path / "a" / "bench.yaml").read_text())
    assert written["algo"]["loss"] == "clipped" and written["algo"]["num_minibatches"] == 1
    assert written["pipeline"]["kwargs"]["objective"] == "grpo"
    assert written["rewards"] == base["rewards"] and written["optim"] == base["optim"]  # same reward and rate
