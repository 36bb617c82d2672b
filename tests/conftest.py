"""Shared pytest setup: offline hub, deterministic torch, small thread count for the 2-core CI machine."""

import os
import socket
import subprocess
import sys
from pathlib import Path

# must precede any huggingface_hub import: offline calls fail at once instead of retrying DNS for minutes
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """A tiny random SD3 pipeline saved once per test session (pipelines.flow.tiny.save_tiny)."""
    from pipelines.flow.tiny import save_tiny

    return save_tiny("sd3", tmp_path_factory.mktemp("tiny_sd3") / "sd3")


@pytest.fixture
def two_ranks():
    """Run a script on two CPU ranks with torch.distributed.run on a free port; returns the CompletedProcess."""

    def run(script, *args, timeout=None):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
        return subprocess.run(
            [*cmd, str(script), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )

    return run
