"""Bad input through `mmgrpo.cli.main`: exit code 2 and one stderr line naming the field, the value and the fix.

No traceback unless --debug. Validation errors fire before any model is built, so these run in milliseconds.
"""

import os
from pathlib import Path

import pytest

from mmgrpo.cli import main
from mmgrpo.plugins import PIPELINES
from pipelines.toy import build_toy_count

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "configs" / "toy_count.yaml")
# a train run that gets past validation cheaply: one step, one tiny batch, no bar, no report
TINY = [
    "run.steps=1",
    "sample.batch_size=8",
    "algo.micro_batch_size=8",
    "algo.num_minibatches=1",
    "run.progress=false",
    "run.report=false",
]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.yaml").write_text("- run\n- algo\n")
    (tmp_path / "broken.yaml").write_text("run:\n  steps: [1, 2\nalgo: {}\n")
    (tmp_path / "top.yaml").write_text("run: {steps: 3}\ntrainer: {lr: 1}\n")
    (tmp_path / "a_file").write_text("not a directory\n")


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main([a.replace("{tmp}", os.getcwd()) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("mmgrpo: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


# (id, argv, substrings the one-line message must contain: field, value, reason or fix)
CASES = [
    (
        "unknown_top_level_key",
        ["config", "{tmp}/top.yaml"],
        ["unknown config key 'trainer'", "valid keys here: run, pipeline, sample, algo, optim, rewards"],
    ),
    (
        "unknown_nested_key_suggests",
        ["config", TOY, "algo.kl_cof=0.01"],
        ["'algo.kl_cof'", "did you mean 'algo.kl_coef'?"],
    ),
    (
        "unknown_list_item_key_suggests",
        ["config", TOY, "rewards.0.wieght=2"],
        ["'rewards.0.wieght'", "did you mean 'rewards.0.weight'?"],
    ),
    (
        "int_given_text",
        ["config", TOY, "sample.group_size=abc"],
        ["sample.group_size", "expected int", "'abc'", "sample.group_size=<int>"],
    ),
    ("int_given_float", ["config", TOY, "run.steps=1.5"], ["run.steps", "expected int", "1.5"]),
    ("bool_given_text", ["config", TOY, "run.progress=maybe"], ["run.progress", "expected bool", "'maybe'"]),
    (
        "float_in_list_item",
        ["config", TOY, "rewards.0.weight=heavy"],
        ["rewards.0.weight", "expected float", "'heavy'", "rewards.0.weight=<float>"],
    ),
    ("list_given_scalar", ["config", TOY, "optim.betas=0.9"], ["optim.betas", "expected a list", "0.9", "[a, b]"]),
    (
        "mapping_given_scalar",
        ["config", TOY, "algo.advantage_kwargs=3"],
        ["algo.advantage_kwargs", "expected a mapping", "{key: value}"],
    ),
    ("negative_group_size", ["config", TOY, "sample.group_size=-4"], ["sample.group_size (-4)", "must be >= 1"]),
    ("zero_group_size", ["config", TOY, "sample.group_size=0"], ["sample.group_size (0)", "must be >= 1"]),
    ("zero_steps", ["config", TOY, "run.steps=0"], ["run.steps (0)", "must be >= 1"]),
    ("missing_config_file", ["config", "{tmp}/nope.yaml"], ["nope.yaml", "does not exist", "configs/toy_count.yaml"]),
    ("config_not_a_mapping", ["config", "{tmp}/list.yaml"], ["list.yaml", "must hold a mapping", "not a list"]),
    ("invalid_yaml", ["config", "{tmp}/broken.yaml"], ["broken.yaml", "not valid YAML", "line 3"]),
    (
        "unknown_advantage",
        ["config", TOY, "algo.advantage=grpoo"],
        ["algo.advantage", "'grpoo'", "did you mean 'grpo'?", "choose from:", "rloo"],
    ),
    ("unknown_loss", ["config", TOY, "algo.loss=ppo"], ["algo.loss", "'ppo'", "choose from:", "clipped"]),
    (
        "unknown_aggregation",
        ["config", TOY, "algo.aggregation=sum"],
        ["algo.aggregation", "'sum'", "choose from:", "token_mean", "seq_mean_token_sum_norm"],
    ),
    ("unknown_kl_kind", ["config", TOY, "algo.kl_kind=k4"], ["algo.kl_kind", "'k4'", "choose from: k1, k2, k3"]),
    (
        "unknown_sampler",
        ["config", TOY, "sample.sampler=random"],
        ["sample.sampler", "'random'", "choose from:", "uniform", "vade"],
    ),
    (
        "unknown_pipeline",
        ["config", TOY, "pipeline.name=toy_cont"],
        ["pipeline.name", "'toy_cont'", "did you mean 'toy_count'?", "choose from:"],
    ),
    (
        "unknown_reward",
        ["config", TOY, "rewards.0.name=toy_cnt"],
        ["rewards.0.name", "'toy_cnt'", "did you mean 'toy_count'?", "choose from:", "format"],
    ),
    (
        "advantage_kwargs_typo",
        ["config", TOY, "algo.advantage_kwargs={stdd: group}"],
        ["algo.advantage_kwargs", "'stdd'", "did you mean 'std'?", "it accepts:"],
    ),
    (
        "loss_kwargs_typo",
        ["config", TOY, "algo.loss_kwargs={clip_lo: 0.2}"],
        ["algo.loss_kwargs", "'clip_lo'", "did you mean 'clip_low'?"],
    ),
    (
        "pipeline_kwargs_typo",
        ["config", TOY, "pipeline.kwargs.hiden=8"],
        ["pipeline.kwargs", "'hiden'", "did you mean 'hidden'?"],
    ),
    (
        "reward_kwargs_typo",
        ["config", TOY, "rewards.0.kwargs={max_lenn: 8}"],
        ["rewards.0.kwargs", "'max_lenn'", "did you mean 'max_len'?"],
    ),
    (
        "sampler_kwargs_typo",
        ["config", TOY, "sample.sampler=vade", "sample.sampler_kwargs={prior_alfa: 1}"],
        ["sample.sampler_kwargs", "'prior_alfa'", "did you mean 'prior_alpha'?"],
    ),
    (
        "batch_not_divisible",
        ["config", TOY, "sample.batch_size=30"],
        ["sample.batch_size (30)", "divisible by sample.group_size (8)", "batch_size=24 or 32"],
    ),
    (
        "group_of_one_with_std",
        ["config", TOY, "sample.group_size=1", "sample.batch_size=8"],
        ["sample.group_size=1", "every advantage is 0", "sample.group_size>=2"],
    ),
    (
        "output_dir_is_a_file",
        ["config", TOY, "run.output_dir={tmp}/a_file"],
        ["run.output_dir", "a_file", "is a file, not a directory", "choose another path"],
    ),
    (
        "output_dir_under_a_file",
        ["config", TOY, "run.output_dir={tmp}/a_file/run1"],
        ["run.output_dir", "a_file/run1", "is a file, not a directory"],
    ),
    (
        "resume_path_missing",
        ["config", TOY, "run.resume={tmp}/runs/old/checkpoints/step_9"],
        ["run.resume", "step_9", "auto, never", "existing checkpoint directory"],
    ),
    (
        "override_without_equals",
        ["config", TOY, "algo.kl_coef"],
        ["'algo.kl_coef'", "key.sub=value", "algo.kl_coef=0.01"],
    ),
    (
        "override_index_out_of_range",
        ["config", TOY, "rewards.3.weight=2"],
        ["rewards.3.weight", "'3' is not an index of rewards", "rewards=[...]"],
    ),
    (
        "override_into_a_scalar",
        ["config", TOY, "run.steps.max=3"],
        ["run.steps.max", "run.steps is the value 60", "run.steps=<value>"],
    ),
    (
        "refill_without_filter",
        ["config", TOY, "sample.refill=true"],
        ["sample.refill=true", "sample.filter_zero_std=true"],
    ),
    ("zero_lr", ["config", TOY, "optim.lr=0"], ["optim.lr (0.0)", "must be > 0", "optim.lr=1e-4"]),
    (
        "betas_out_of_range",
        ["config", TOY, "optim.betas=[0.9, 1.5]"],
        ["optim.betas ([0.9, 1.5])", "[0, 1)", "[0.9, 0.999]"],
    ),
    ("unknown_device", ["config", TOY, "run.device=gpu"], ["run.device ('gpu')", "auto, cpu or cuda"]),
    ("unknown_tracker", ["config", TOY, "run.trackers=[mlflow]"], ["run.trackers", "'mlflow'", "tensorboard, wandb"]),
    (
        "micro_batch_text",
        ["config", TOY, "algo.micro_batch_size=big"],
        ["algo.micro_batch_size ('big')", "whole number of samples >= 1 or auto"],
    ),
    (
        "micro_batch_float",
        ["config", TOY, "algo.micro_batch_size=2.5"],
        ["algo.micro_batch_size", "expected int or str", "2.5"],
    ),
    ("micro_batch_zero", ["config", TOY, "algo.micro_batch_size=0"], ["algo.micro_batch_size (0)", "(or auto)"]),
    (
        "memory_budget_negative",
        ["config", TOY, "algo.micro_batch_size=auto", "algo.memory_budget_gb=-1"],
        ["algo.memory_budget_gb (-1.0)", "must be > 0 GB", "null"],
    ),
    (
        "memory_budget_text",
        ["config", TOY, "algo.memory_budget_gb=lots"],
        ["algo.memory_budget_gb", "expected float", "'lots'"],
    ),
    (
        "memory_budget_below_one_sample",
        ["train", TOY, *TINY, "run.output_dir={tmp}/run", "algo.micro_batch_size=auto", "algo.memory_budget_gb=1e-9"],
        ["algo.memory_budget_gb (1e-09 GB)", "too small for one micro-batch of 1 sample(s)", "raise it"],
    ),
    ("compile_bad_value", ["config", TOY, "run.compile=yes"], ["run.compile ('yes')", "true", "force", "false"]),
    (
        "compile_kwargs_typo",
        ["config", TOY, "run.compile_kwargs={mod: max-autotune}"],
        ["run.compile_kwargs", "['mod']", "mode"],
    ),
    (
        "flow_attention_unknown",
        ["config", TOY, "pipeline.name=flow", "pipeline.kwargs={attention: flash}"],
        ["pipeline.kwargs.attention ('flash')", "sdpa, xformers"],
    ),
    (
        "vlm_attention_unknown",
        ["config", TOY, "pipeline.name=vlm", "pipeline.kwargs={attn_implementation: flash}"],
        ["pipeline.kwargs.attn_implementation ('flash')", "sdpa", "flash_attention_2"],
    ),
    (
        "video_attention_unknown",
        ["config", TOY, "pipeline.name=video", "pipeline.kwargs={attn_implementation: fast}"],
        ["pipeline.kwargs.attn_implementation ('fast')", "eager"],
    ),
    ("list_unknown_kind", ["list", "nonsense"], ["'nonsense'", "choose from:", "advantages", "pipelines"]),
    ("train_validates_first", ["train", TOY, "algo.kl_cof=0.01"], ["did you mean 'algo.kl_coef'?"]),
    (
        "eval_missing_checkpoint",
        ["eval", TOY, "ckpt=/nonexistent"],
        ["ckpt ('/nonexistent')", "not a valid checkpoint", "ckpt=latest"],
    ),
    ("eval_bad_number", ["eval", TOY, "limit=some"], ["limit='some'", "whole number"]),
    ("sample_bad_bool", ["sample", TOY, "ema=maybe"], ["ema='maybe'", "true or false", "ema=true"]),
]


@pytest.mark.parametrize("argv,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capsys, argv, needles):
    code, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, *needles)


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_debug_shows_the_traceback(capsys):
    code, err = run_cli(capsys, ["--debug", "config", TOY, "algo.kl_cof=0.01"])
    assert code == 2
    assert "Traceback (most recent call last)" in err and "UserError" in err
    # the one-line summary still comes last
    assert err.strip().splitlines()[-1].startswith("mmgrpo: error: unknown config key 'algo.kl_cof'")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_output_dir(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        code, err = run_cli(capsys, ["config", TOY, f"run.output_dir={locked}/run1"])
    finally:
        locked.chmod(0o700)
    assert_one_line_error(code, err, "run.output_dir", "not writable", "run.output_dir=runs/my_run")


def test_unwritable_output_dir_at_mkdir_time(capsys, tmp_path, monkeypatch):
    # the trainer re-checks when it creates the directory (the path can change between validation and start)
    monkeypatch.setattr("mmgrpo.validate._check_output_dir", lambda path: None)
    code, err = run_cli(capsys, ["train", TOY, *TINY, f"run.output_dir={tmp_path}/a_file/run1"])
    assert_one_line_error(code, err, "run.output_dir", "a_file/run1", "cannot be written", "run.output_dir=")


def test_empty_dataset(capsys, tmp_path, monkeypatch):
    name = "test_cli_errors_empty"

    def build_empty(**kwargs):
        task = build_toy_count(**kwargs)
        task.train_data = []
        return task

    # register on copies of the tables so the test pipeline is gone again after this test
    monkeypatch.setattr(PIPELINES, "_items", dict(PIPELINES._items))
    monkeypatch.setattr(PIPELINES, "_meta", dict(PIPELINES._meta))
    PIPELINES.register(name, build_empty)
    code, err = run_cli(capsys, ["train", TOY, *TINY, f"pipeline.name={name}", f"run.output_dir={tmp_path}/out"])
    assert_one_line_error(code, err, f"pipeline {name!r}", "empty training set", "pipeline.kwargs")


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: mmgrpo" in capsys.readouterr().out


def test_valid_config_command_succeeds(capsys):
    # the control case: the same entry point with good input prints the resolved YAML and exits 0
    assert main(["config", TOY, "algo.kl_coef=0.01"]) == 0
    captured = capsys.readouterr()
    assert "kl_coef: 0.01" in captured.out and captured.err == ""
