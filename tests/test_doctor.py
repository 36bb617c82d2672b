"""`mmgrpo doctor`: its one line on a CPU machine, which paths it skips and why (capabilities faked, never the runs'
results), and that every path's command line is a valid recipe."""

import argparse
from pathlib import Path

import pytest

from mmgrpo import doctor
from mmgrpo.doctor import CHECKS, Caps, command, plan

ALL = frozenset({"xformers", "flash_attn", "vllm"})


def _reasons(caps: Caps) -> dict[str, str | None]:
    return {c.name: why for c, why in plan(caps)}


def test_cpu_machine_is_one_line_and_exit_0(monkeypatch, capsys):
    from mmgrpo.cli import main

    monkeypatch.setattr(doctor, "probe", lambda: Caps(cuda=False))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out


def test_probe_agrees_with_torch():
    import torch

    caps = doctor.probe()
    assert caps.cuda == torch.cuda.is_available() and caps.gpus == torch.cuda.device_count()
    assert caps.packages <= ALL


def test_every_path_is_skipped_without_cuda():
    assert set(_reasons(Caps(cuda=False, packages=ALL)).values()) == {"no CUDA device"}


def test_one_gpu_without_optional_packages():
    why = _reasons(Caps(cuda=True, gpus=1, bf16=True, nccl=True))
    assert why["flow bf16 autocast"] is None and why["vlm bf16 autocast"] is None
    assert "xformers package is not installed" in why["flow xformers attention"]
    assert "flash_attn package is not installed (pip install flash-attn)" in why["vlm flash attention 2"]
    assert "vllm package is not installed" in why["vlm vLLM rollout"]
    assert why["flow DDP over NCCL (2 GPUs)"] == "needs 2 CUDA devices, this machine has 1"
    assert why["vlm FSDP2 over NCCL (2 GPUs)"] == "needs 2 CUDA devices, this machine has 1"


def test_two_gpus_with_everything_runs_everything():
    assert set(_reasons(Caps(cuda=True, gpus=2, bf16=True, nccl=True, packages=ALL)).values()) == {None}


def test_two_old_gpus_without_nccl():
    why = _reasons(Caps(cuda=True, gpus=2, bf16=False, nccl=False, packages=ALL))
    assert "no bf16 support" in why["flow bf16 autocast"] and "no bf16 support" in why["vlm flash attention 2"]
    assert why["flow xformers attention"] is None and why["vlm vLLM rollout"] is None
    assert why["flow DDP over NCCL (2 GPUs)"] == "torch was built without NCCL"


def test_table_lists_the_skipped_paths_without_running_anything(monkeypatch, capsys):
    # a CUDA machine where every path is skipped: the table is printed, nothing is launched, exit 0
    monkeypatch.setattr(doctor, "run_check", lambda *a, **k: pytest.fail("a skipped path was run"))
    args = argparse.Namespace(only=None, steps=2, timeout=60, keep=False)
    assert doctor.cmd_doctor(args, Caps(cuda=True, gpus=1, bf16=False, nccl=True, device="Fake GPU")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mmgrpo doctor: 1 x Fake GPU; optional packages: none")
    assert len(lines) == 2 + len(CHECKS) and all(" skipped " in ln for ln in lines[2:])


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_each_path_is_a_valid_recipe(check, tmp_path):
    from mmgrpo.config import load_config

    cmd = command(check, tmp_path / "run", steps=2)
    train = cmd.index("train")
    cfg = load_config(str(Path(doctor.ROOT) / cmd[train + 1]), cmd[train + 2 :])
    assert cfg.run.steps == 2 and cfg.run.output_dir == str(tmp_path / "run")
    if check.accelerate:
        assert (Path(doctor.ROOT) / check.accelerate).is_file()
        assert cmd[cmd.index("--num_processes") + 1] == "2"
