"""Speed and memory switches (issue 9 item 3): no host reads per micro-batch in the update, micro-batch sizing from
a memory budget (algo.micro_batch_size=auto), opt-in torch.compile (skipped on the CPU unless forced), the flow
attention backend. All on the toy pipeline or without a model, in a few seconds each."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo import checkpoint
from mmgrpo.collect import collect
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.runtime import fit_micro_batch, peak_bytes
from mmgrpo.setup import compile_module, setup
from mmgrpo.trainer import _k_slices, _optimizer_step, _probe, compute_advantages, train, update

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "toy_count.yaml")
FAST = ["run.progress=false", "run.report=false", "sample.batch_size=32", "run.steps=2"]
ENGINE = str(ROOT / "mmgrpo")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint.list_checkpoints(run_dir / "checkpoints")[-1] / "weights.safetensors"))


# ---- 1. host-device synchronisation in the update


def _count_host_reads(monkeypatch, calls: list[str]) -> None:
    """Wrap every Tensor method that hands a value to the host; record the calling file of each call."""
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, _real=real, **kw):
            calls.append(sys._getframe(1).f_code.co_filename)
            return _real(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapper)


def _update_host_reads(tmp_path: Path, monkeypatch, micro: int) -> tuple[int, int, int]:
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path / str(micro)}", *FAST, f"algo.micro_batch_size={micro}"])
    run = setup(cfg)
    try:
        batch = collect(run, 0)
        adv, use, _ = compute_advantages(run, batch, 0.0)
        calls: list[str] = []
        with monkeypatch.context() as m:
            _count_host_reads(m, calls)
            update(run, batch, adv, use, 0)
    finally:
        run.close()
    engine = sum(f.startswith(ENGINE) for f in calls)
    return engine, len(calls), cfg.algo.inner_epochs


def test_update_reads_the_device_once_per_optimizer_step(tmp_path, monkeypatch):
    """The engine reads a device value once per optimizer step (the all-rank finiteness flag that decides the NaN
    skip), once per inner epoch (the pieces every rank runs) and once at the end (the metric means), however many
    micro-batches a mini-batch holds: 16 samples per micro-batch (1 piece per mini-batch here) and 2 (8 pieces) read
    equally often. A CPU run cannot see blocking copies to a GPU; the loss moves host tensors non_blocking."""
    few = _update_host_reads(tmp_path, monkeypatch, 16)
    many = _update_host_reads(tmp_path, monkeypatch, 2)
    epochs, steps = 2, 4  # toy recipe: 2 inner epochs x 2 mini-batches
    assert few[2] == epochs
    assert few[0] == many[0] == steps + epochs + 1, (few, many)
    assert few[1] == many[1]  # torch's own reads (AdamW's step counters) do not grow with micro-batches either


def _stub_run(finite_grad: bool = True):
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    if not finite_grad:
        model.weight.grad[0, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = SimpleNamespace(num_processes=1, clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    cfg = SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0))
    return SimpleNamespace(accelerator=acc, cfg=cfg, model=model, optimizer=opt, ema=None)


@pytest.mark.parametrize(
    "loss_finite,grad_finite,steps", [(True, True, True), (False, True, False), (True, False, False)]
)
def test_optimizer_step_skips_on_a_device_flag(loss_finite, grad_finite, steps):
    from mmgrpo.trainer import _Acc

    run = _stub_run(grad_finite)
    before = run.model.weight.detach().clone()
    acc = _Acc()
    ok = _optimizer_step(run, torch.tensor(loss_finite), acc)
    assert ok is steps
    assert (not torch.equal(before, run.model.weight.detach())) is steps
    assert all(p.grad is None for p in run.model.parameters())  # cleared either way
    assert ("grad_norm" in acc.means()) is steps


def test_running_means_weigh_by_elements_and_ignore_weight_zero():
    from mmgrpo.trainer import _Acc

    acc = _Acc()
    acc.add({"a": torch.tensor(1.0), "b": (torch.tensor(4.0), torch.tensor(False))}, torch.tensor(3))
    acc.add({"a": torch.tensor(2.0), "b": (torch.tensor(6.0), torch.tensor(True))}, torch.tensor(1))
    acc.add({"a": torch.tensor(float("nan")), "b": torch.tensor(float("nan"))}, 0.0)  # padding piece
    # a: (1 * 3 + 2 * 1) / 4 = 1.25; b: only the present piece counts -> 6
    assert acc.means() == {"a": 1.25, "b": 6.0}


# ---- 2. micro-batch sizing from a memory budget


def test_fit_micro_batch_worked_values():
    # per = peak_2 - peak_1 = 0.5e9, fixed = peak_1 - per = 2.5e9; m = floor((budget - fixed) / per)
    assert fit_micro_batch(3.0e9, 3.5e9, 10e9, most=64) == 15  # (10 - 2.5) / 0.5 = 15 exactly
    assert fit_micro_batch(3.0e9, 3.5e9, 100e9, most=64) == 64  # 195 capped by the rollout size
    assert fit_micro_batch(3.0e9, 3.5e9, 3.0e9, most=64) == 1  # fixed + per = budget: one fits, just
    # per 300, fixed 700: 700 + 4 * 300 = 1900 <= 2000 < 2200 = 700 + 5 * 300
    assert fit_micro_batch(1000.0, 1300.0, 2000.0, most=64) == 4
    assert fit_micro_batch(1e6, 1e6, 2e6, most=48) == 48  # no growth measured: the largest
    with pytest.raises(ValueError, match="one unit needs about 3 GB"):
        fit_micro_batch(3.0e9, 3.5e9, 2.9e9, most=64)


def test_peak_bytes_on_the_cpu_is_exact():
    def fn():
        a = torch.empty(1_000_000)  # 4e6 bytes
        b = torch.empty(500_000)  # 2e6 bytes, both live: the peak
        del a
        c = torch.empty(250_000)  # 1e6 bytes
        return b, c

    assert peak_bytes(fn, torch.device("cpu")) == 6_000_000


def test_auto_micro_batch_fits_the_budget_and_trains_like_the_number_it_picks(tmp_path, capsys):
    """The probe's 2- and 1-sample peaks set a budget of fixed + 5.5 per-sample units: auto must pick 5, log it once,
    the measured peak of 5 samples must fit, and training must equal micro_batch_size=5 exactly (the probe leaves
    no gradient and draws no random number)."""
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path / 'probe'}", *FAST])
    run = setup(cfg)
    try:
        batch = collect(run, 0)
        adv, use, _ = compute_advantages(run, batch, 0.0)
        mask = batch.rollout.mask & use[:, None]
        live = mask.any(1).nonzero().flatten()
        ks = _k_slices(run, mask.shape[1])[0]
        p2, p1 = (_probe(run, batch, live[:n], ks, adv, mask) for n in (2, 1))
        p5 = _probe(run, batch, live[:5], ks, adv, mask)
    finally:
        run.close()
    per, fixed = p2 - p1, 2 * p1 - p2
    assert per > 0
    budget = fixed + 5.5 * per
    assert p5 <= budget  # the linear prediction holds on this model
    auto = train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path / 'auto'}",
                *FAST,
                "algo.micro_batch_size=auto",
                f"algo.memory_budget_gb={budget / 1e9!r}",
            ],
        )
    )
    said = capsys.readouterr().out
    assert len(re.findall(r"algo.micro_batch_size=auto: 5 samples per forward/backward", said)) == 1, said
    fixed5 = train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'five'}", *FAST, "algo.micro_batch_size=5"]))
    assert auto["metrics"]["loss/policy"] == fixed5["metrics"]["loss/policy"]
    a, b = _weights(tmp_path / "auto"), _weights(tmp_path / "five")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_budget_below_one_sample_is_one_line(tmp_path):
    cfg = load_config(
        RECIPE, [f"run.output_dir={tmp_path}", *FAST, "algo.micro_batch_size=auto", "algo.memory_budget_gb=1e-9"]
    )
    with pytest.raises(
        UserError,
        match=r"algo.memory_budget_gb \(1e-09 GB\) is too small for one micro-batch of 1 "
        r"sample\(s\) on some rank \(forward\+backward peaks .* MB at 2 samples "
        r"and .* MB at 1, budget 1e-09 GB\); raise it",
    ):
        train(cfg)


# ---- 3. torch.compile


def test_compile_is_skipped_on_the_cpu_with_one_line(capsys):
    cfg = load_config(RECIPE, ["run.compile=true"])
    module = torch.nn.Linear(2, 2)
    acc = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    assert compile_module(cfg, module, acc) is False
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        (
            "run.compile=true: skipped on the CPU (compiling needs a C++ toolchain there and warms up "
            "slowly); set run.compile=force to compile anyway"
        )
    ]
    assert module._compiled_call_impl is None
    assert compile_module(load_config(RECIPE), module, acc) is False and capsys.readouterr().out == ""


def test_bad_compile_kwargs_are_one_line():
    cfg = load_config(RECIPE, ["run.compile=force", "run.compile_kwargs={backend: nonsense}"])
    acc = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    with pytest.raises(UserError, match=r"run.compile_kwargs \(\{'backend': 'nonsense'\}\): Invalid backend"):
        compile_module(cfg, torch.nn.Linear(2, 2), acc)


def test_forced_compile_trains_like_eager(tmp_path):
    """run.compile=force compiles the toy's module in place on the CPU (aot_eager: dynamo + AOTAutograd, no C++
    toolchain) and two steps give the eager run's loss and weights."""
    eager = train(load_config(RECIPE, [f"run.output_dir={tmp_path / 'eager'}", *FAST]))
    compiled = train(
        load_config(
            RECIPE,
            [
                f"run.output_dir={tmp_path / 'compiled'}",
                *FAST,
                "run.compile=force",
                "run.compile_kwargs={backend: aot_eager}",
            ],
        )
    )
    assert compiled["metrics"]["loss/policy"] == pytest.approx(eager["metrics"]["loss/policy"], abs=1e-6)
    a, b = _weights(tmp_path / "eager"), _weights(tmp_path / "compiled")
    assert set(a) == set(b)  # in-place compile keeps the parameter names
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


# ---- 4. flow attention backend


def test_flow_attention_choices_and_xformers_needs_cuda():
    from pipelines.flow.build import build_flow, check_flow_kwargs

    check_flow_kwargs(attention="sdpa")
    with pytest.raises(UserError, match=r"pipeline.kwargs.attention \('flash'\) must be one of sdpa, xformers"):
        check_flow_kwargs(attention="flash")
    # refused before any weight loads: the model path does not exist
    with pytest.raises(
        UserError,
        match=r"attention=xformers needs CUDA and xformers \(no CUDA device\); install "
        r"the cuda extra",
    ):
        build_flow(seed=0, device=torch.device("cpu"), model="/nonexistent", prompts=["a cat"], attention="xformers")
