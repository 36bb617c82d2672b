"""The training loop on the toy counting policy: it learns, resumes exactly, survives faults, runs on 2 ranks."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rewards
from mmgrpo import checkpoint, sampling
from mmgrpo.cli import main as cli_main
from mmgrpo.config import load_config
from mmgrpo.errors import TrainingStopped
from mmgrpo.trainer import train
from rewards.api import REWARDS, FunctionReward

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "toy_count.yaml")
FAST = ["run.progress=false", "run.report=false", "sample.batch_size=32", "algo.micro_batch_size=16"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mmgrpo.cli", "train", RECIPE, f"run.output_dir={out}", *FAST, *extra]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint.list_checkpoints(run_dir / "checkpoints")[-1] / "weights.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_toy_policy_learns(tmp_path):
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}", "run.progress=false", "run.steps=30"])
    out = train(cfg)
    rows = _metrics(tmp_path)
    first = sum(r["reward/total_mean"] for r in rows[:3]) / 3
    last = sum(r["reward/total_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.2, (first, last)  # ~0.65 -> ~0.97 in practice
    assert out["metrics"]["ratio/mean"] == pytest.approx(1.0, abs=0.1)
    for key in (
        "reward/toy_count/std",
        "adv/zero_std_frac",
        "clip/upper_frac",
        "clip/lower_frac",
        "entropy",
        "grad_norm",
        "lr",
        "time/rollout",
        "time/reward",
        "time/advantages",
        "time/update",
        "perf/samples_per_sec",
        "kl/old_approx",
        "ratio/std",
    ):
        assert key in rows[-1], key
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in html and "toy_count" in html
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "gallery" / "step_00000000" / "items.json").is_file()


def test_kill_and_resume_is_exact(tmp_path):
    """SIGKILL mid-run, resume=auto, and end with the same weights as an uninterrupted run (within 1e-6)."""
    steps = ["run.steps=24", "run.checkpoint_every=3", "run.keep_last=2", "run.resume=auto"]
    subprocess.run(_cli(tmp_path / "full", *steps), check=True, env=_env(), capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(killed, *steps), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        ckpts = checkpoint.list_checkpoints(killed / "checkpoints")
        if ckpts and int(ckpts[-1].name[5:]) >= 9:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed; raise run.steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = int(checkpoint.list_checkpoints(killed / "checkpoints")[-1].name[5:])
    assert done < 24
    res = subprocess.run(_cli(killed, *steps), check=False, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stdout + res.stderr
    assert _max_diff(_final_weights(killed), _final_weights(tmp_path / "full")) <= 1e-6
    assert [r["step"] for r in _metrics(killed)] == list(range(24))  # no step lost or logged twice


def test_corrupt_checkpoint_is_skipped(tmp_path, capsys):
    args = [f"run.output_dir={tmp_path}", *FAST, "run.steps=4", "run.checkpoint_every=2", "run.keep_last=3"]
    train(load_config(RECIPE, args))
    ckpts = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    weights = ckpts[-1] / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # a torn write
    assert "weights.safetensors" in checkpoint.check(ckpts[-1])
    capsys.readouterr()
    out = train(load_config(RECIPE, args[:-3] + ["run.steps=5", "run.resume=auto"]))
    said = capsys.readouterr().out
    assert "skipping checkpoint" in said and "step_00000004" in said and "resumed from" in said
    assert "step_00000002" in said.split("resumed from")[1]
    assert out["metrics"]


def test_sigterm_saves_and_stops(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cli(run_dir, "run.steps=400", "run.checkpoint_every=0"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").is_file() and len(_metrics(run_dir)) >= 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out
    (ckpt,) = checkpoint.list_checkpoints(run_dir / "checkpoints")
    assert checkpoint.check(ckpt) is None and 3 <= int(ckpt.name[5:]) < 400


def _register(name: str, fn) -> None:
    if name not in REWARDS:
        REWARDS.register(
            name,
            lambda: FunctionReward(fn, name=name, input="text", fields=("target",)),
            doc=f"test-only reward {name}",
        )


def test_nan_rewards_skip_then_stop(tmp_path):
    _register("test_nan", lambda samples, prompts, target=None: [float("nan")] * len(samples))
    cfg = load_config(
        RECIPE,
        [
            f"run.output_dir={tmp_path}",
            *FAST,
            "run.steps=10",
            "run.max_bad_steps=2",
            "rewards=[{name: test_nan}]",
            "run.report=true",
        ],
    )
    with pytest.raises(TrainingStopped, match="2 consecutive steps skipped, the last for non-finite rewards"):
        train(cfg)
    rows = _metrics(tmp_path)
    assert [r["skipped"] for r in rows] == [1.0, 1.0]
    assert "2 logged steps" in (tmp_path / "report.html").read_text()  # a stopped run still gets its report
    assert checkpoint.check(checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1]) is None


def test_failing_reward_stops_with_checkpoint(tmp_path, capsys):
    def boom(samples, prompts, target=None):
        if len(samples) > 1:
            raise RuntimeError("scorer crashed")
        if samples[0].count("a") == 2:
            raise RuntimeError("cannot score this one")
        return [0.0]

    _register("test_boom", boom)
    code = cli_main(
        ["train", RECIPE, f"run.output_dir={tmp_path}", *FAST, "run.steps=3", "rewards=[{name: test_boom}]"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "reward 'test_boom' failed on sample" in err and "checkpoint saved" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "global sample" in err and 'prompt "write' in err  # where it sits in the batch and what it was
    (ckpt,) = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    # saved at the failing step with the sampler rewound, so a resume draws the same prompts again
    assert ckpt.name == "step_00000000"
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["sampler"] == sampling.make_sampler("uniform", 6, seed=0).state_dict()


@pytest.mark.parametrize(
    "extra",
    [
        [
            "algo.kl_coef=0.05",
            "algo.kl_kind=k3",
            "optim.ema_decay=0.9",
            "optim.schedule=cosine",
            "optim.warmup_steps=1",
        ],
        [
            "algo.loss=reg_grpo",
            "algo.loss_kwargs={}",
            "algo.aggregation=seq_mean_token_mean",
            "algo.micro_batch_size=8",
        ],
        [
            "algo.loss_kwargs={level: sequence, clip_low: 0.0003, clip_high: 0.0004}",
            "algo.advantage=rloo",
            "algo.advantage_kwargs={}",
        ],
    ],
)
def test_variants_run(tmp_path, extra):
    out = train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=3", *extra]))
    m = out["metrics"]
    assert m["skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss/policy"]))
    if "algo.kl_coef=0.05" in extra:
        assert m["kl/ref"] > 0
        assert (checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1] / "ema.safetensors").is_file()


def test_refill_trains_on_varied_groups_only(tmp_path):
    # targets 1-3 score a flat 0.5 for every sample, the others the completion's length / 8 (varied: seed 0 gives no
    # group of 8 equal lengths); 4 of the 6 prompts are drawn per step, so every first round holds a flat group and
    # the step must roll out again until 4 groups vary (at least one varied group per round, 5 rounds allowed)
    def half_flat(samples, prompts, target=None):
        return [0.5 if t <= 3 else len(s) / 8 for s, t in zip(samples, target)]

    _register("test_half_flat", half_flat)
    common = [*FAST, "run.steps=3", "rewards=[{name: test_half_flat}]", "sample.filter_zero_std=true"]
    train(
        load_config(
            RECIPE,
            [f"run.output_dir={tmp_path / 'refill'}", *common, "sample.refill=true", "sample.max_refill_rounds=4"],
        )
    )
    train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'filter'}", *common]))
    refill, filtered = _metrics(tmp_path / "refill"), _metrics(tmp_path / "filter")
    assert all(r["rollout/rounds"] >= 2 for r in refill), [r["rollout/rounds"] for r in refill]
    assert all(r["adv/kept_group_frac"] == 1.0 for r in refill)  # every trained group varies
    assert all(r["rollout/rounds"] == 1 and r["adv/kept_group_frac"] <= 0.75 for r in filtered)


def test_vade_posterior_counts_every_reward(tmp_path):
    # decays off (1.0): the posterior's evidence is exactly the sum of rewards (successes) and of 1 - rewards
    # (failures) over every sample rolled out, and each of the 3 steps visits 4 prompts
    train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path}",
                *FAST,
                "run.steps=3",
                "sample.sampler=vade",
                "sample.sampler_kwargs={step_decay: 1.0, visit_decay: 1.0}",
            ],
        )
    )
    rows = _metrics(tmp_path)
    state = torch.load(checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1] / "state.pt", weights_only=False)
    sampler = state["sampler"]
    successes = sum(r["reward/total_mean"] * 32 for r in rows)  # 32 samples a step
    assert sum(sampler["evidence_alpha"]) == pytest.approx(successes, rel=1e-5)
    assert sum(sampler["evidence_alpha"]) + sum(sampler["evidence_beta"]) == pytest.approx(3 * 32)
    assert sum(sampler["visits"]) == 3 * 4 and rows[-1]["sampler/seen_frac"] > 0


def test_mc_grpo_leaves_the_pivot_out_of_the_loss(tmp_path):
    # G = 7 (odd): one pivot per group is masked out of the loss, so exactly 6/7 of the samples are used
    out = train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path}",
                *FAST,
                "run.steps=2",
                "algo.advantage=mc_grpo",
                "algo.advantage_kwargs={scale: std}",
                "sample.group_size=7",
                "sample.batch_size=28",
                "algo.micro_batch_size=7",
            ],
        )
    )
    assert out["metrics"]["adv/mc_grpo/used_frac"] == pytest.approx(6 / 7)
    off = train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path / 'all'}",
                *FAST,
                "run.steps=1",
                "algo.advantage=mc_grpo",
                "algo.advantage_kwargs={exclude_pivot: false}",
                "sample.group_size=7",
                "sample.batch_size=28",
                "algo.micro_batch_size=7",
            ],
        )
    )
    assert off["metrics"]["adv/mc_grpo/used_frac"] == 1.0


def test_a_grae_suppresses_positive_advantages_through_the_trainer(tmp_path):
    # A-GRAE (arXiv:2602.05548) with pos_scale 0: every positive advantage is scaled to 0, negatives kept
    kw = "algo.advantage_kwargs={pos_scale: 0.0, accuracy_gate: 1.0, difficulty_focus: true}"
    out = train(
        load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=2", "algo.advantage=asymmetric", kw])
    )
    m = out["metrics"]
    assert m["adv/max"] == 0.0 and m["adv/min"] < 0 and m["skipped"] == 0.0
    assert 0 < m["adv/asymmetric/nonzero_frac"] < 1  # only the below-mean samples still push


def test_mmr1_diversity_reaches_the_sampler_through_the_trainer(tmp_path):
    # outcome_weight 0: a prompt's score is diversity_weight * distinct-1 of its group's completions, > 0 for any
    # group with at least one completion (a toy completion is one token, so distinct-1 = distinct completions / G)
    out = train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path}",
                *FAST,
                "run.steps=2",
                "sample.sampler=mmr1_vas",
                "sample.sampler_kwargs={diversity_weight: 1.0, outcome_weight: 0.0}",
            ],
        )
    )
    m = out["metrics"]
    assert 0 < m["sampler/score_mean"] <= 1.0 and m["sampler/seen_frac"] > 0


def test_two_ranks_match_one(tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo) == 1 process on the same global batch, within 1e-5."""
    args = ["run.steps=4", "algo.num_minibatches=2", "algo.inner_epochs=2"]
    one = subprocess.run(_cli(tmp_path / "one", *args), check=False, env=_env(), capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    with socket.socket() as sock:  # a free port: a fixed one collides with other runs on the machine
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    # every launcher option on the command line, so no accelerate config file is read or needed
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        port,
        "-m",
        "mmgrpo.cli",
        "train",
        RECIPE,
        f"run.output_dir={tmp_path / 'two'}",
        *FAST,
        *args,
    ]
    two = subprocess.run(cmd, check=False, env=_env(), capture_output=True, text=True)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("done: ") == 2, two.stdout  # both ranks ran to the end (each prints its own line)
    assert _max_diff(_final_weights(tmp_path / "one"), _final_weights(tmp_path / "two")) <= 1e-5
    r1 = [r["reward/total_mean"] for r in _metrics(tmp_path / "one")]
    r2 = [r["reward/total_mean"] for r in _metrics(tmp_path / "two")]
    assert r1 == pytest.approx(r2, abs=1e-6)


def test_eval_and_sample_cli(tmp_path, capsys):
    train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=2"]))
    assert cli_main(["eval", RECIPE, f"run.output_dir={tmp_path}", "ckpt=latest", "group_size=2"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["category", "toy_count", "total", "n"]
    assert "all" in table
    assert cli_main(["sample", RECIPE, f"run.output_dir={tmp_path}", "ckpt=latest", f"out={tmp_path / 's'}"]) == 0
    items = json.loads((tmp_path / "s" / "items.json").read_text())
    assert len(items) == 16 and {"prompt", "text", "reward"} <= set(items[0])
    assert rewards.load("toy_count")(["aa"], target=[2]).item() == 1.0


@pytest.mark.parametrize("name,kind", [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("zero2", "DEEPSPEED")])
def test_accelerate_configs_parse(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "configs" / "accelerate" / f"{name}.yaml"))
    assert cfg.distributed_type.name == kind and cfg.num_processes >= 2


def test_missing_tracker_is_a_user_error(monkeypatch, capsys):
    from mmgrpo import validate

    monkeypatch.setattr(validate, "_importable", lambda module: False)
    assert cli_main(["train", RECIPE, "run.trackers=[wandb]"]) == 2
    assert "'wandb' is not installed; `pip install wandb`" in capsys.readouterr().err


def test_kl_in_the_reward_per_token(tmp_path):
    # step 0 rolls out with the reference weights, so every token's KL(old || ref) is exactly 0; after an update
    # the rollout policy differs and the k3 penalty (>= 0 per token) is positive. The logged reward stays raw.
    train(
        load_config(
            RECIPE,
            [f"run.output_dir={tmp_path}", *FAST, "run.steps=3", "algo.kl_reward_coef=0.5", "algo.kl_reward_kind=k3"],
        )
    )
    rows = _metrics(tmp_path)
    assert rows[0]["kl/reward_penalty"] == 0.0 and rows[-1]["kl/reward_penalty"] > 0
    assert all(r["kl/reward_coef"] == 0.5 and 0 <= r["reward/total_mean"] <= 1 for r in rows)
