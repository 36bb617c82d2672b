"""Bad inputs through the real entry point (`mmgrpo.cli.main`) with an earlier run already in the output directory.

Each case: the exit code, one line on stderr naming the key or file, and the earlier (sentinel) run's files
byte-identical afterwards. The sentinel is a 2-step toy run built once per module and copied per case; most cases
stop in validation before any model is built.
"""

import hashlib
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest

from mmgrpo import checkpoint
from mmgrpo.cli import main
from rewards.api import REWARDS, FunctionReward

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "configs" / "toy_count.yaml")
FAST = [
    "run.progress=false",
    "run.report=false",
    "sample.batch_size=16",
    "algo.micro_batch_size=16",
    "run.steps=2",
    "run.checkpoint_every=1",
    "run.keep_last=2",
]
FLAKY = {"fail": True}


def _reward(name: str, fn) -> None:
    if name not in REWARDS:
        REWARDS.register(
            name,
            lambda: FunctionReward(fn, name=name, input="text", fields=("target",)),
            doc=f"test-only reward {name}",
        )


def _raises(samples, prompts, target=None):
    raise RuntimeError("scorer crashed")


def _flaky(samples, prompts, target=None):
    if FLAKY["fail"]:
        raise RuntimeError("scorer offline")
    return [float(s.count("a") == int(t)) for s, t in zip(samples, target)]


_reward("cli_bad_raises", _raises)
_reward("cli_bad_short", lambda samples, prompts, target=None: [0.5] * (len(samples) - 1))
_reward("cli_bad_nan", lambda samples, prompts, target=None: [float("nan")] * len(samples))
_reward("cli_bad_flaky", _flaky)


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory) -> Path:
    """An earlier run: 2 steps, checkpoints step_1 and step_2, 2 metric rows."""
    d = tmp_path_factory.mktemp("sentinel") / "run"
    assert main(["train", TOY, f"run.output_dir={d}", *FAST]) == 0
    assert [p.name for p in checkpoint.list_checkpoints(d / "checkpoints")] == ["step_00000001", "step_00000002"]
    return d


def snapshot(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def files(tmp_path):
    """Input files the cases name: broken recipes, prompt files, a directory where a file belongs."""
    recipe = Path(TOY).read_text()
    (tmp_path / "dup.yaml").write_text(recipe.replace("  lr: 3.0e-3\n", "  lr: 3.0e-3\n  lr: 30.0\n"))
    (tmp_path / "latin1.yaml").write_bytes(recipe.replace("# Toy", "# Caf\xe9 toy").encode("latin-1"))
    (tmp_path / "recipe_dir.yaml").mkdir()
    (tmp_path / "list.yaml").write_text("- run\n- algo\n")
    (tmp_path / "prompts_latin1.txt").write_bytes("a red cube\nun caf\xe9\n".encode("latin-1"))
    (tmp_path / "prompts_empty.txt").write_text("\n  \n")
    (tmp_path / "prompts_dir.txt").mkdir()
    return tmp_path


# (id, argv, exit code, substrings of the one stderr line). {run}: the copy of the sentinel run, {tmp}: files.
T = ["train", TOY, "run.output_dir={run}"]
C = ["config", TOY, "run.output_dir={run}"]
AUTO = [
    "run.resume=auto",
    "run.steps=3",
    "run.progress=false",
    "run.report=false",
    "sample.batch_size=16",
    "algo.micro_batch_size=16",
]
FLOW = ["pipeline.name=flow"]
CASES = [
    # non-finite and out-of-range numbers
    ("lr_inf", [*T, "optim.lr=.inf"], 2, ["optim.lr (inf)", "finite"]),
    ("lr_nan", [*T, "optim.lr=.nan"], 2, ["optim.lr (nan)", "finite"]),
    ("lr_negative", [*T, "optim.lr=-1"], 2, ["optim.lr (-1.0)", "> 0"]),
    ("kl_coef_inf", [*T, "algo.kl_coef=.inf"], 2, ["algo.kl_coef (inf)"]),
    ("kl_coef_negative", [*T, "algo.kl_coef=-0.1"], 2, ["algo.kl_coef (-0.1)", ">= 0"]),
    ("betas_inf", [*T, "optim.betas=[0.9, .inf]"], 2, ["optim.betas.1 (inf)"]),
    ("reward_weight_nan", [*T, "rewards.0.weight=.nan"], 2, ["rewards.0.weight (nan)"]),
    ("grad_clip_negative", [*T, "optim.grad_clip=-1"], 2, ["optim.grad_clip (-1.0)"]),
    ("ema_decay_one", [*T, "optim.ema_decay=1.0"], 2, ["optim.ema_decay (1.0)", "[0, 1)"]),
    ("warmup_negative", [*T, "optim.warmup_steps=-1"], 2, ["optim.warmup_steps (-1)"]),
    ("clip_low_negative", [*T, "algo.loss_kwargs={clip_low: -0.1}"], 2, ["algo.loss_kwargs", "clip_low", "-0.1"]),
    ("dual_clip_below_one", [*T, "algo.loss_kwargs={dual_clip: 0.5}"], 2, ["algo.loss_kwargs", "dual_clip", "0.5"]),
    ("loss_level_typo", [*T, "algo.loss_kwargs={level: tok}"], 2, ["algo.loss_kwargs", "level", "'tok'"]),
    ("std_typo", [*T, "algo.advantage_kwargs={std: grp}"], 2, ["algo.advantage_kwargs", "std='grp'", "group"]),
    ("adv_eps_nan", [*T, "algo.advantage_kwargs={eps: .nan}"], 2, ["algo.advantage_kwargs.eps is nan"]),
    ("seed_2_pow_70", [*T, f"run.seed={2**70}"], 2, ["run.seed", str(2**70), "run.seed=0"]),
    ("seed_negative", [*T, "run.seed=-1"], 2, ["run.seed (-1)"]),
    ("steps_zero", [*T, "run.steps=0"], 2, ["run.steps (0)", ">= 1"]),
    ("steps_huge_float", [*T, "run.steps=1e400"], 2, ["run.steps", "expected int"]),
    ("group_size_zero", [*T, "sample.group_size=0"], 2, ["sample.group_size (0)"]),
    ("group_size_float", [*T, "sample.group_size=2.0"], 2, ["sample.group_size", "expected int"]),
    ("batch_size_zero", [*T, "sample.batch_size=0"], 2, ["sample.batch_size (0)"]),
    ("keep_last_zero", [*T, "run.keep_last=0"], 2, ["run.keep_last (0)"]),
    ("log_every_zero", [*T, "run.log_every=0"], 2, ["run.log_every (0)"]),
    ("checkpoint_every_negative", [*T, "run.checkpoint_every=-1"], 2, ["run.checkpoint_every (-1)"]),
    ("max_bad_steps_zero", [*T, "run.max_bad_steps=0"], 2, ["run.max_bad_steps (0)"]),
    ("inner_epochs_zero", [*T, "algo.inner_epochs=0"], 2, ["algo.inner_epochs (0)"]),
    ("minibatches_zero", [*T, "algo.num_minibatches=0"], 2, ["algo.num_minibatches (0)"]),
    ("micro_batch_zero", [*T, "algo.micro_batch_size=0"], 2, ["algo.micro_batch_size (0)"]),
    ("norm_len_zero", [*T, "algo.norm_len=0"], 2, ["algo.norm_len (0)"]),
    ("refill_rounds_negative", [*T, "sample.max_refill_rounds=-1"], 2, ["sample.max_refill_rounds (-1)"]),
    # empty strings and paths, files and directories
    ("output_dir_empty", [*T, "run.output_dir="], 2, ["run.output_dir is empty", "run.output_dir=runs/my_run"]),
    (
        "output_dir_is_a_file",
        [*T, "run.output_dir={run}/metrics.jsonl"],
        2,
        ["run.output_dir", "metrics.jsonl", "is a file"],
    ),
    ("resume_empty", [*T, "run.resume="], 2, ["run.resume is empty"]),
    ("resume_missing", [*T, "run.resume={tmp}/nowhere"], 2, ["run.resume", "nowhere", "auto, never"]),
    (
        "recipe_is_a_directory",
        ["train", "{tmp}/recipe_dir.yaml", "run.output_dir={run}"],
        2,
        ["recipe_dir.yaml", "is a directory"],
    ),
    ("recipe_missing", ["train", "{tmp}/nope.yaml", "run.output_dir={run}"], 2, ["nope.yaml", "does not exist"]),
    (
        "recipe_not_utf8",
        ["train", "{tmp}/latin1.yaml", "run.output_dir={run}"],
        2,
        ["latin1.yaml", "not UTF-8", "0xe9", "offset 5", "line 1"],
    ),
    (
        "recipe_duplicate_key",
        ["train", "{tmp}/dup.yaml", "run.output_dir={run}"],
        2,
        ["dup.yaml", "duplicate key 'lr' on lines 27 and 28"],
    ),
    ("recipe_a_list", ["train", "{tmp}/list.yaml", "run.output_dir={run}"], 2, ["list.yaml", "must hold a mapping"]),
    (
        "override_duplicate_key",
        [*T, "algo.loss_kwargs={clip_low: 0.1, clip_low: 0.2}"],
        2,
        ["algo.loss_kwargs", "duplicate key 'clip_low'"],
    ),
    (
        "prompt_file_not_utf8",
        [*C, *FLOW, "pipeline.kwargs={data: {tmp}/prompts_latin1.txt}"],
        2,
        ["pipeline.kwargs.data", "prompts_latin1.txt", "0xe9", "offset 17", "line 2"],
    ),
    (
        "prompt_file_empty",
        [*C, *FLOW, "pipeline.kwargs={data: {tmp}/prompts_empty.txt}"],
        2,
        ["pipeline.kwargs.data", "prompts_empty.txt", "is empty"],
    ),
    (
        "prompt_file_is_a_directory",
        [*C, *FLOW, "pipeline.kwargs={data: {tmp}/prompts_dir.txt}"],
        2,
        ["pipeline.kwargs.data", "prompts_dir.txt", "is a directory"],
    ),
    (
        "cache_dir_is_a_file",
        [*C, "pipeline.name=vlm", "pipeline.kwargs={cache_dir: {run}/config.yaml}"],
        2,
        ["pipeline.kwargs.cache_dir", "config.yaml", "is a file, but a directory is expected"],
    ),
    ("prompt_path_empty", [*C, *FLOW, "pipeline.kwargs={data: ''}"], 2, ["pipeline.kwargs.data", "empty string"]),
    # near misses, names and types
    ("key_case", [*T, "optim.LR=1e-3"], 2, ["'optim.LR'", "did you mean 'optim.lr'?"]),
    ("section_case", [*T, "Run.steps=3"], 2, ["'Run'", "did you mean 'run'?"]),
    ("advantage_case", [*T, "algo.advantage=GRPO"], 2, ["algo.advantage", "'GRPO'", "did you mean 'grpo'?"]),
    ("loss_case", [*T, "algo.loss=Clipped"], 2, ["algo.loss", "did you mean 'clipped'?"]),
    ("reward_name_case", [*T, "rewards.0.name=TOY_COUNT"], 2, ["rewards.0.name", "did you mean 'toy_count'?"]),
    ("sampler_case", [*T, "sample.sampler=VADE"], 2, ["sample.sampler", "did you mean 'vade'?"]),
    ("loss_kwarg_case", [*T, "algo.loss_kwargs={Clip_low: 0.1}"], 2, ["algo.loss_kwargs", "did you mean 'clip_low'?"]),
    ("pipeline_kwarg_case", [*T, "pipeline.kwargs.Hidden=8"], 2, ["pipeline.kwargs", "did you mean 'hidden'?"]),
    ("reward_kwarg_case", [*T, "rewards.0.kwargs={Max_len: 8}"], 2, ["rewards.0.kwargs", "did you mean 'max_len'?"]),
    (
        "pipeline_hidden_text",
        [*T, "pipeline.kwargs.hidden=big"],
        2,
        ["pipeline.kwargs.hidden", "'big'", "expected int", "pipeline.kwargs.hidden=32"],
    ),
    ("pipeline_hidden_zero", [*T, "pipeline.kwargs.hidden=0"], 2, ["pipeline.kwargs.hidden (0)", ">= 1"]),
    ("pipeline_hidden_nan", [*T, "pipeline.kwargs.hidden=.nan"], 2, ["pipeline.kwargs.hidden is nan"]),
    ("pipeline_max_len_one", [*T, "pipeline.kwargs.max_len=1"], 2, ["pipeline.kwargs.max_len (1)"]),
    (
        "pipeline_max_target_too_big",
        [*T, "pipeline.kwargs.max_target=8"],
        2,
        ["pipeline.kwargs.max_target (8)", "max_len (8)"],
    ),
    (
        "reward_kwarg_text",
        [*T, "rewards.0.kwargs={max_len: eight}"],
        2,
        ["rewards.0.kwargs.max_len", "'eight'", "expected int"],
    ),
    ("device_case", [*T, "run.device=GPU"], 2, ["run.device ('GPU')"]),
    ("mixed_precision", [*T, "run.mixed_precision=fp8"], 2, ["run.mixed_precision ('fp8')"]),
    ("overwrite_text", [*T, "run.overwrite=maybe"], 2, ["run.overwrite", "expected bool"]),
    ("override_no_equals", [*T, "optim.lr"], 2, ["'optim.lr'", "key.sub=value"]),
    ("override_bad_index", [*T, "rewards.5.weight=1"], 2, ["rewards.5.weight", "not an index"]),
    # the earlier run in the directory
    (
        "dir_holds_a_run",
        [*T, "run.resume=never"],
        2,
        ["already holds a run", "run.resume=auto", "run.output_dir=<new dir>", "run.overwrite=true"],
    ),
    (
        "resume_older_checkpoint",
        [*T, "run.resume={run}/checkpoints/step_00000001"],
        2,
        ["already holds a run", "step_00000001", "newest valid checkpoint (step_00000002)"],
    ),
    (
        "overwrite_deletes_resume",
        [*T, "run.overwrite=true", "run.resume={run}/checkpoints/step_00000002"],
        2,
        ["run.overwrite=true would delete run.resume"],
    ),
    # found when the run is set up (after the model is built, before any step)
    (
        "reward_labels_repeat",
        [*T, *AUTO, "rewards=[{name: toy_count}, {name: toy_count}]"],
        2,
        ["reward labels must be unique"],
    ),
    # found at the first step of a resumed run: stop (exit 1), name the reward and a checkpoint that exists
    (
        "reward_raises",
        [*T, *AUTO, "rewards=[{name: cli_bad_raises}]"],
        1,
        [
            "stopped at step 2",
            "reward 'cli_bad_raises'",
            "scorer crashed",
            "step_00000002",
            "resume with: mmgrpo train",
        ],
    ),
    (
        "reward_without_its_field",
        [*T, *AUTO, "rewards=[{name: accuracy}]"],
        1,
        ["stopped at step 2", "reward 'accuracy'", "needs field(s) answers", "step_00000002", "resume with:"],
    ),
    (
        "reward_wrong_count",
        [*T, *AUTO, "rewards=[{name: cli_bad_short}]"],
        1,
        ["stopped at step 2", "reward 'cli_bad_short'", "scores for", "step_00000002"],
    ),
    # the other sub-commands
    ("eval_group_size_zero", ["eval", TOY, "run.output_dir={run}", "group_size=0"], 2, ["group_size=0", ">= 1"]),
    ("eval_limit_negative", ["eval", TOY, "run.output_dir={run}", "limit=-1"], 2, ["limit=-1", ">= 0"]),
    (
        "eval_ckpt_a_file",
        ["eval", TOY, "run.output_dir={run}", "ckpt={run}/metrics.jsonl"],
        2,
        ["ckpt", "metrics.jsonl", "not a valid checkpoint"],
    ),
    ("sample_n_zero", ["sample", TOY, "run.output_dir={run}", "n=0"], 2, ["n=0", ">= 1"]),
    (
        "sample_out_existing_file",
        ["sample", TOY, "run.output_dir={run}", "out={run}/config.yaml"],
        2,
        ["out=", "config.yaml", "an existing file"],
    ),
    ("sample_ema_text", ["sample", TOY, "run.output_dir={run}", "ema=maybe"], 2, ["ema='maybe'", "true or false"]),
    ("config_bad_key", [*C, "algo.kl_cof=1"], 2, ["did you mean 'algo.kl_coef'?"]),
    ("list_unknown", ["list", "nonsense"], 2, ["'nonsense'", "choose from"]),
    ("pretrain_unknown", ["pretrain", "shapes-t3i"], 2, ["'shapes-t3i'", "shapes-t2i"]),
    ("pretrain_unknown_option", ["pretrain", "shapes-t2i", "--minuts", "3"], 2, ["unrecognized arguments: --minuts"]),
    ("rewards_unknown_subcommand", ["rewards", "bogus"], 2, ["invalid choice: 'bogus'"]),
    ("train_without_recipe", ["train"], 2, ["mmgrpo train: error", "config"]),
    ("unknown_command", ["trian", TOY], 2, ["invalid choice: 'trian'", "train"]),
    ("unknown_option", ["--verbose", "train", TOY], 2, ["unrecognized arguments: --verbose"]),
]


def _argv(argv: list[str], run: Path, tmp: Path) -> list[str]:
    return [a.replace("{run}", str(run)).replace("{tmp}", str(tmp)) for a in argv]


def test_at_least_sixty_cases():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv,code,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(sentinel, files, tmp_path, capsys, argv, code, needles):
    run = tmp_path / "run"
    shutil.copytree(sentinel, run)
    before = snapshot(run)
    capsys.readouterr()
    got = main(_argv(argv, run, files))
    err = capsys.readouterr().err
    lines = err.strip("\n").splitlines()
    assert got == code, err
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("mmgrpo"), lines[0]
    for needle in needles:
        assert needle.replace("{run}", str(run)) in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert snapshot(run) == before, "the earlier run's files changed"


def test_stop_names_a_checkpoint_and_its_command_resumes(tmp_path, capsys):
    """A reward failing at step 0 of a fresh run: the line names step_00000000, which exists and is valid, and the
    printed command (once the reward works again) resumes from it and finishes the run."""
    out = tmp_path / "fresh"
    FLAKY["fail"] = True
    code = main(["train", TOY, f"run.output_dir={out}", *FAST, "rewards=[{name: cli_bad_flaky}]"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    ckpt = out / "checkpoints" / "step_00000000"
    assert f"checkpoint saved as {ckpt}" in err and checkpoint.check(ckpt) is None
    command = shlex.split(err.split("resume with: ", 1)[1])
    assert command[:3] == ["mmgrpo", "train", TOY] and command[-1] == f"run.resume={ckpt}"
    FLAKY["fail"] = False
    try:
        assert main(command[1:]) == 0
    finally:
        FLAKY["fail"] = True
    said = capsys.readouterr().out
    assert f"resumed from {ckpt} at step 0" in said
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1]


def test_nan_stop_keeps_the_earlier_steps(sentinel, tmp_path, capsys):
    """Continuing the sentinel run into NaN rewards: the stop names the new checkpoint (it exists), the earlier
    rows and its newest checkpoint stay byte-identical, and only this run's own old checkpoints are pruned."""
    run = tmp_path / "run"
    shutil.copytree(sentinel, run)
    before = snapshot(run)
    old_rows = (run / "metrics.jsonl").read_text()
    code = main(
        [
            "train",
            TOY,
            f"run.output_dir={run}",
            *FAST,
            "run.steps=5",
            "run.resume=auto",
            "run.max_bad_steps=1",
            "rewards=[{name: cli_bad_nan}]",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    new = run / "checkpoints" / "step_00000003"
    assert f"checkpoint saved as {new}" in err and checkpoint.check(new) is None
    assert f"run.resume={new}" in err
    assert (run / "metrics.jsonl").read_text().startswith(old_rows)
    after = snapshot(run)
    kept = {k: v for k, v in before.items() if k.startswith("checkpoints/step_00000002/")}
    assert kept and all(after[k] == v for k, v in kept.items())


def test_overwrite_replaces_the_earlier_run(sentinel, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sentinel, run)
    (run / "notes.txt").write_text("mine")
    (run / "eval").mkdir()
    (run / "eval" / "step_00000002.json").write_text("{}")  # the earlier run's eval must not head the new report
    assert main(["train", TOY, f"run.output_dir={run}", *FAST, "run.steps=1", "run.overwrite=true"]) == 0
    assert (
        "deleted the earlier run's config.yaml, metrics.jsonl, gallery, checkpoints, eval" in capsys.readouterr().out
    )
    assert not (run / "eval").exists()
    assert [p.name for p in checkpoint.list_checkpoints(run / "checkpoints")] == ["step_00000001"]
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own files go


def test_keep_last_prunes_only_this_runs_checkpoints(tmp_path):
    """Even with the directory check bypassed, pruning skips checkpoints another run wrote."""
    root = tmp_path / "checkpoints"
    for step, run_id in ((1, "other"), (2, "other"), (0, "mine")):
        checkpoint.write_rank_files(root, step, 0)
        checkpoint.write_main_files(root, step, weights={}, state={"step": step}, config_yaml="")
        checkpoint.finalize(root, step, keep_last=2, run_id=run_id)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000000", "step_00000001", "step_00000002"]
    checkpoint.write_rank_files(root, 3, 0)
    checkpoint.write_main_files(root, 3, weights={}, state={"step": 3}, config_yaml="")
    checkpoint.finalize(root, 3, keep_last=1, run_id="mine")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000001", "step_00000002", "step_00000003"]


def test_restart_before_the_first_checkpoint_is_allowed(tmp_path):
    """A run killed before its first save left config.yaml and metric rows but no checkpoint: rerunning it with
    run.resume=auto and the same config starts it again; another config is refused."""
    out = tmp_path / "run"
    args = ["train", TOY, f"run.output_dir={out}", *FAST, "run.resume=auto"]
    assert main(args) == 0
    shutil.rmtree(out / "checkpoints")
    assert main(args + ["algo.kl_coef=0.1"]) == 2
    assert main(args) == 0
    assert os.path.isdir(out / "checkpoints" / "step_00000002")


OOM = "mmgrpo: error: unexpected RuntimeError: CUDA out of memory"


@pytest.mark.parametrize(
    "crash,code,head",
    [(KeyboardInterrupt(), 130, "mmgrpo: interrupted"), (RuntimeError("CUDA out of memory"), 2, OOM)],
)
def test_a_crash_names_the_newest_checkpoint(sentinel, tmp_path, capsys, monkeypatch, crash, code, head):
    """Ctrl-C twice, or a bug: one line, and for train the newest valid checkpoint and the command that resumes it."""
    run = tmp_path / "run"
    shutil.copytree(sentinel, run)
    before = snapshot(run)

    def boom(cfg):
        raise crash

    monkeypatch.setattr("mmgrpo.trainer.train", boom)
    assert main(["train", TOY, f"run.output_dir={run}", "run.resume=auto"]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(head), err
    ckpt = run / "checkpoints" / "step_00000002"
    assert f"newest checkpoint {ckpt}; resume with: mmgrpo train {TOY} run.output_dir={run} run.resume={ckpt}" in err
    assert snapshot(run) == before
