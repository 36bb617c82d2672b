"""Shared pytest setup: offline hub, deterministic torch, small thread count for the 2-core CI machine."""

import os

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
