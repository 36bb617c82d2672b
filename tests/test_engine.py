"""Engine pieces around the loop: lr schedule, EMA, NaN-loss skips, faults on another rank, checkpoint contents
(export, metrics so far), resuming into a fresh directory, EMA evaluation, trackers and the self-contained report."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo import checkpoint
from mmgrpo.cli import main as cli_main
from mmgrpo.config import load_config
from mmgrpo.errors import TrainingStopped
from mmgrpo.evaluate import _load
from mmgrpo.runtime import EMA, build_scheduler, lr_factor
from mmgrpo.tracking import MetricsLog
from mmgrpo.trainer import train
from pipelines.toy import CountLM, ToyPolicy

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "toy_count.yaml")
FAST = ["run.progress=false", "run.report=false", "sample.batch_size=32", "algo.micro_batch_size=16"]


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lr_factor_warmup_then_decay():
    # warm-up 2 of 10 steps: (s+1)/2 -> 0.5, 1.0; afterwards frac = (s-2)/8
    kw = {"warmup": 2, "total": 10}
    assert [lr_factor(s, schedule="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    # linear: 1 - frac; s=6 -> frac 0.5 -> 0.5; s=10 -> 0
    assert lr_factor(6, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(10, schedule="linear", **kw) == pytest.approx(0.0)
    # cosine: (1 + cos(pi frac)) / 2; s=4 -> frac 0.25 -> (1 + 0.70710678) / 2 = 0.85355339
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(0.85355339, abs=1e-8)
    assert lr_factor(6, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)


def test_scheduler_follows_lr_factor():
    cfg = load_config(RECIPE, ["optim.lr=0.1", "optim.schedule=linear", "optim.warmup_steps=2", "run.steps=10"])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(4):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # 0.1 x [0.5, 1.0, 1 - 0/8, 1 - 1/8]
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.0875])


def test_ema_update():
    w = torch.nn.Parameter(torch.tensor([1.0]))
    ema = EMA({"w": w}, decay=0.9)
    with torch.no_grad():
        w.fill_(3.0)
    ema.update()  # 0.9 * 1 + 0.1 * 3 = 1.2
    with torch.no_grad():
        w.fill_(0.0)
    ema.update()  # 0.9 * 1.2 + 0.1 * 0 = 1.08
    assert ema.shadow["w"].item() == pytest.approx(1.08)


def test_nan_loss_skips_and_names_the_sample(tmp_path, monkeypatch, capsys):
    state = {"on": False}
    real = ToyPolicy.logp

    def logp(self, model, rollout, idx):
        out, aux = real(self, model, rollout, idx)
        if state["on"]:
            out = torch.where((idx == 5)[:, None], torch.full_like(out, float("nan")), out)  # sample 5 only
        return out, aux

    monkeypatch.setattr(ToyPolicy, "logp", logp)
    monkeypatch.setattr(ToyPolicy, "set_iteration", lambda self, step: state.update(on=step == 0), raising=False)
    train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=2"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [1.0, 0.0]
    said = capsys.readouterr().out
    want = r"step 0: skipped the update: non-finite loss on sample 5 \(prompt \"write \d a's\"\)"
    assert re.search(want, said), said


def test_reward_failure_on_another_rank_stops_here_too(tmp_path, monkeypatch):
    # this rank's rewards are fine; a peer reports a failure through the collective flag and message
    monkeypatch.setattr("mmgrpo.collect.any_rank", lambda acc, flag: True)
    monkeypatch.setattr("mmgrpo.collect.first_message", lambda acc, msg: "reward 'x' failed on sample 40 (boom)")
    with pytest.raises(TrainingStopped, match=r"stopped at step 0: reward 'x' failed on sample 40 .*checkpoint saved"):
        train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=3"]))
    (ckpt,) = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert ckpt.name == "step_00000000" and checkpoint.check(ckpt) is None


def test_signal_on_another_rank_saves_and_stops(tmp_path, monkeypatch, capsys):
    calls = []

    def any_rank(acc, flag):  # the stop flag of a peer rank turns up after the third step
        calls.append(flag)
        return len(calls) == 3

    monkeypatch.setattr("mmgrpo.trainer.any_rank", any_rank)
    out = train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=10", "run.checkpoint_every=0"]))
    assert calls == [False, False, False]  # no signal here
    assert "received a stop signal on another rank: checkpoint saved at step 3" in capsys.readouterr().out
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == ["step_00000003"]
    assert out["metrics"] and _steps(tmp_path) == [0, 1, 2]


def test_checkpoint_holds_export_and_metrics(tmp_path):
    train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=2"]))
    (ckpt,) = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {
        "weights.safetensors",
        "state.pt",
        "rng_rank0.pt",
        "config.yaml",
        "metrics.jsonl",
        "export/model.safetensors",
        "export/config.json",
    } <= set(files)
    assert [json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    # the exported model rebuilds without mmgrpo's checkpoint code and equals the trained weights
    spec = json.loads((ckpt / "export" / "config.json").read_text())
    model = CountLM(spec["max_target"], spec["max_len"], spec["hidden"])
    model.load_state_dict(load_file(str(ckpt / "export" / "model.safetensors")))
    weights = load_file(str(ckpt / "weights.safetensors"))
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    # files in export/ are checksummed like the rest
    (ckpt / "export" / "config.json").write_text("{}")
    assert "export/config.json" in checkpoint.check(ckpt)


def test_resume_into_a_fresh_directory_keeps_metrics_and_says_what_changed(tmp_path, capsys):
    first = tmp_path / "first"
    train(load_config(RECIPE, [f"run.output_dir={first}", *FAST, "run.steps=4", "run.checkpoint_every=2"]))
    capsys.readouterr()
    second = tmp_path / "second"
    ckpt = first / "checkpoints" / "step_00000002"
    train(
        load_config(
            RECIPE, [f"run.output_dir={second}", *FAST, "run.steps=5", "run.checkpoint_every=2", f"run.resume={ckpt}"]
        )
    )
    said = capsys.readouterr().out
    assert f"resumed from {ckpt} at step 2 (config changed since: run.steps: 4 -> 5)" in said
    assert _steps(second) == [0, 1, 2, 3, 4]  # rows 0-1 come from the checkpoint's copy


def test_saved_config_is_the_resolved_one(tmp_path):
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=1", "algo.kl_coef=0.02"])
    train(cfg)
    assert load_config(tmp_path / "config.yaml") == cfg


def test_eval_with_ema_weights(tmp_path, capsys):
    train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=2", "optim.ema_decay=0.5"]))
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}"])
    task, _, path = _load(cfg, "latest", ema=True)
    ema = load_file(str(path / "ema.safetensors"))
    params = dict(task.module.named_parameters())
    assert all(torch.equal(params[k].detach(), v) for k, v in ema.items())
    assert not torch.equal(ema["head.weight"], load_file(str(path / "weights.safetensors"))["head.weight"])
    assert cli_main(["eval", RECIPE, f"run.output_dir={tmp_path}", "ema=true", "group_size=2", "limit=2"]) == 0
    plain = tmp_path / "plain"
    train(load_config(RECIPE, [f"run.output_dir={plain}", *FAST, "run.steps=1"]))
    capsys.readouterr()
    assert cli_main(["eval", RECIPE, f"run.output_dir={plain}", "ema=true"]) == 2
    err = capsys.readouterr().err
    assert "holds no EMA weights" in err and "optim.ema_decay>0" in err and len(err.strip().splitlines()) == 1


def test_trackers_get_the_finite_metrics(tmp_path):
    class FakeAccelerator:
        def __init__(self):
            self.trackers, self.logged = ["fake"], []

        def log(self, values, step):
            self.logged.append((step, values))

    acc = FakeAccelerator()
    log = MetricsLog(tmp_path, acc)
    log.log(3, {"reward/total_mean": 0.5, "kl/ref": float("nan")})
    assert acc.logged == [(3, {"reward/total_mean": 0.5})]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 3,
        "reward/total_mean": 0.5,
        "kl/ref": None,
    }


def test_report_is_self_contained(tmp_path):
    train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path}",
                "run.progress=false",
                "sample.batch_size=32",
                "algo.micro_batch_size=16",
                "run.steps=3",
                "algo.kl_coef=0.01",
            ],
        )
    )
    page = (tmp_path / "report.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert len(refs) >= 3 and all(r.startswith("data:image/png;base64,") for r in refs)  # reward, KL, loss curves
    assert "<link" not in page and "<script" not in page
    for needle in ("before training", "after training", "time/rollout", "time/update", "kl_coef: 0.01", "write "):
        assert needle in page, needle


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_k_chunks_give_the_unchunked_update(tmp_path, monkeypatch, aggregation):
    """A policy that bounds memory with one backward per chunk of K (Flow-GRPO: per timestep) ends with the same
    weights as one backward over all K; per-element metrics name each decision index."""
    args = [*FAST, "run.steps=2", f"algo.aggregation={aggregation}", "algo.kl_coef=0.01"]
    train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'whole'}", *args]))
    real = ToyPolicy.logp

    def logp(self, model, rollout, idx, k_slice=None):
        out, aux = real(self, model, rollout, idx)
        return out[:, k_slice], {k: v[:, k_slice] for k, v in aux.items()}

    monkeypatch.setattr(ToyPolicy, "logp", logp)
    monkeypatch.setattr(ToyPolicy, "k_chunk", 3, raising=False)
    monkeypatch.setattr(ToyPolicy, "per_element_metrics", True, raising=False)
    out = train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'chunked'}", *args]))
    whole, chunked = (
        load_file(str(checkpoint.list_checkpoints(tmp_path / d / "checkpoints")[-1] / "weights.safetensors"))
        for d in ("whole", "chunked")
    )
    assert max(float((whole[k] - chunked[k]).abs().max()) for k in whole) < 1e-6
    assert {"ratio/k0", "ratio/k3", "ratio/k6"} <= set(out["metrics"])


def test_stop_flag_sigint_then_second_sigint_interrupts():
    import os
    import signal

    from mmgrpo.runtime import StopFlag

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started in the background (nohup)
    flag = StopFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # first Ctrl-C: finish the step, checkpoint, stop
        assert flag.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # second Ctrl-C: stop now
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_accelerate_tracker_gets_config_and_every_step(tmp_path, monkeypatch):
    """The tracker path end to end, with a custom accelerate GeneralTracker standing in for TensorBoard / W&B."""
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    import mmgrpo.setup
    import mmgrpo.validate

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.config, self.rows, self.finished = None, [], False

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, values))

        def finish(self):
            self.finished = True

    rec = Recorder()
    monkeypatch.setattr(mmgrpo.validate, "_importable", lambda module: True)
    monkeypatch.setattr(mmgrpo.setup, "make_accelerator", lambda cfg: Accelerator(cpu=True, log_with=[rec]))
    train(load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, "run.steps=3", "run.trackers=[tensorboard]"]))
    assert rec.config["algo.loss"] == "clipped" and rec.config["sample.group_size"] == 8
    assert [s for s, _ in rec.rows] == [0, 1, 2]
    assert "reward/total_mean" in rec.rows[-1][1] and "grad_norm" in rec.rows[-1][1]
    assert rec.finished


def test_stop_and_resume_is_exact_with_every_kind_of_state(tmp_path, monkeypatch):
    """Stopped (as by SIGTERM) after step 3 and resumed: the same weights and EMA as an uninterrupted run, with a
    cosine schedule, warm-up, EMA, KL reference, VADE's sampler state and two inner epochs all in play."""
    args = [
        *FAST,
        "run.steps=6",
        "run.checkpoint_every=0",
        "optim.schedule=cosine",
        "optim.warmup_steps=2",
        "optim.ema_decay=0.8",
        "algo.kl_coef=0.05",
        "sample.sampler=vade",
        "run.resume=auto",
    ]
    train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'full'}", *args]))
    calls = []
    monkeypatch.setattr("mmgrpo.trainer.any_rank", lambda acc, flag: calls.append(flag) or len(calls) == 3)
    train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'cut'}", *args]))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "cut" / "checkpoints")] == ["step_00000003"]
    monkeypatch.setattr("mmgrpo.trainer.any_rank", lambda acc, flag: False)
    train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'cut'}", *args]))
    for name in ("weights.safetensors", "ema.safetensors"):
        a, b = (
            load_file(str(checkpoint.list_checkpoints(tmp_path / d / "checkpoints")[-1] / name))
            for d in ("full", "cut")
        )
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, name
    assert _steps(tmp_path / "cut") == list(range(6))


def test_pieces_are_padded_to_the_busiest_rank(monkeypatch):
    from types import SimpleNamespace

    import mmgrpo.trainer as tr

    cfg = load_config(RECIPE, ["algo.micro_batch_size=16"])
    run = SimpleNamespace(cfg=cfg, policy=SimpleNamespace(), accelerator=None, micro_batch_size=16)
    mbs = [torch.arange(24), torch.arange(8)]  # 3 groups of 8 -> micro-batches of 16 and 8; then one group
    # a peer runs 4 pieces in the first mini-batch and 1 in the second (one gather for both)
    monkeypatch.setattr(tr, "all_gather", lambda acc, t: torch.cat([t, torch.tensor([[4, 1]])]))
    first, second = tr._pieces(run, mbs, k=8)
    assert [len(idx) for idx, _, _ in first] == [16, 8, 8, 8]
    assert [scale for _, _, scale in first] == [1.0, 1.0, 0.0, 0.0]
    assert [(len(idx), scale) for idx, _, scale in second] == [(8, 1.0)]
    run.policy.k_chunk = 3  # chunked policies pad with their first chunk
    monkeypatch.setattr(tr, "all_gather", lambda acc, t: torch.cat([t, torch.tensor([[7]])]))
    (pieces,) = tr._pieces(run, [torch.arange(0)], k=8)  # no group of this mini-batch on this rank
    assert len(pieces) == 7 and all(scale == 0.0 and ks == slice(0, 3) for _, ks, scale in pieces)


def test_fully_masked_rows_get_no_forward(tmp_path, monkeypatch):
    """Rows with no unmasked element (groups the zero-variance filter drops, BranchGRPO's width-pruned leaves, empty
    completions) add nothing to the loss: the update skips their forward/backward instead of computing zeros."""
    real_logp, real_rollout, rows = ToyPolicy.logp, ToyPolicy.rollout, []

    def logp(self, model, rollout, idx, **kw):
        rows.append(len(idx))
        return real_logp(self, model, rollout, idx, **kw)

    def rollout(self, prompts, group_size, seeds):
        out = real_rollout(self, prompts, group_size, seeds)
        out.mask[::3] = False  # every third sample: an all-masked row
        return out

    monkeypatch.setattr(ToyPolicy, "logp", logp)
    monkeypatch.setattr(ToyPolicy, "rollout", rollout)
    n, steps = 32, 3
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST, f"run.steps={steps}", f"sample.batch_size={n}"])
    train(cfg)
    live = n - len(range(0, n, 3))  # 32 - 11 = 21 rows with an unmasked element
    assert sum(rows) == live * cfg.algo.inner_epochs * steps


def test_eval_counts_uncategorised_records_once(tmp_path):
    from mmgrpo.evaluate import evaluate

    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}", *FAST])
    table = evaluate(cfg, "none", group_size=2, limit=5)
    # toy prompts carry no category: "all" is the only row, 5 prompts x 2 samples, each counted once
    assert list(table) == ["all"] and table["all"]["n"] == 10


def test_progress_bar_shows_kl_only_when_logged():
    # DiffusionNFT logs no KL (likelihood-free): its bar showed "kl=nan" before; now it shows the reward alone
    from types import SimpleNamespace

    from mmgrpo.setup import Run

    class Bar:
        def update(self, n):
            pass

        def set_postfix(self, **kw):
            self.shown = kw

    run = SimpleNamespace(bar=Bar())
    Run.progress(run, {"reward/total_mean": 0.5})
    assert run.bar.shown == {"reward": "0.500"}
    Run.progress(run, {"reward/total_mean": 0.5, "kl/old_approx": 0.25, "kl/ref": 0.125})
    assert run.bar.shown == {"reward": "0.500", "kl": "0.1250"}  # the reference's KL when there is one
