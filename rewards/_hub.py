"""Loading helpers for model rewards: device/dtype parsing, autocast policy, and the one-line offline error.

Every from_pretrained / hub download of a reward goes through `loading(...)` so a missing model fails in one line.
"""

import contextlib
import os
from collections.abc import Iterator

import torch

from mmgrpo.errors import UserError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a torch device (use 'cpu', 'cuda', 'cuda:1'): {err}") from None


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA only; a no-op context on the CPU (CPU bf16 autocast is slow and changes scores)."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _is_offline_error(err: BaseException) -> bool:
    names = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "EntryNotFoundError", "RepositoryNotFoundError"}
    seen: BaseException | None = err
    while seen is not None:
        if type(seen).__name__ in names:
            return True
        text = str(seen)
        if any(
            s in text
            for s in (
                "couldn't connect",
                "not fully cached",
                "Failed to download",
                "outgoing traffic",
                "offline mode",
                "is not a local folder and is not a valid model identifier",
            )
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off")


def missing_model_message(model_id: str, reward: str, kwarg: str = "model", *, file: bool = False) -> str:
    why = "the Hub is unreachable (HF_HUB_OFFLINE=1)" if _hub_offline() else "it could not be downloaded"
    what, example = (
        ("the downloaded file", "/path/to/" + model_id.rsplit("/", 1)[-1])
        if file
        else ("a local directory", "/path/to/dir")
    )
    return (
        f"model {model_id!r} is not in the local Hugging Face cache and {why}; download it elsewhere and pass "
        f'{what}: rewards.load({reward!r}, {kwarg}="{example}") (CLI: --kw {kwarg}={example}; '
        f"config: kwargs: {{{kwarg}: {example}}})"
    )


@contextlib.contextmanager
def loading(model_id: str, reward: str, kwarg: str = "model", *, file: bool = False) -> Iterator[None]:
    """Turn a hub miss inside the block into a one-line UserError naming the id and the local-path keyword."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as err:
        if isinstance(err, UserError) or os.path.exists(str(model_id)):
            raise
        # some loaders (AutoImageProcessor) drop the hub error and raise a generic OSError when offline
        if not (_is_offline_error(err) or (_hub_offline() and isinstance(err, OSError))):
            raise
        raise UserError(missing_model_message(model_id, reward, kwarg, file=file)) from None


def hub_file(repo_or_path: str, filename: str, reward: str, kwarg: str) -> str:
    """A local file: `repo_or_path` if it is a file, `<dir>/<filename>` for a directory, else a hub download."""
    if os.path.isfile(repo_or_path):
        return repo_or_path
    if os.path.isdir(repo_or_path):
        path = os.path.join(repo_or_path, filename)
        if not os.path.isfile(path):
            raise UserError(f"{kwarg}={repo_or_path!r} is a directory without {filename!r}; pass the file path")
        return path
    # lazy: huggingface_hub adds ~0.25 s to `mmgrpo --help` (rewards load there); only downloads need it
    from huggingface_hub import hf_hub_download

    with loading(f"{repo_or_path}/{filename}", reward, kwarg, file=True):
        return hf_hub_download(repo_or_path, filename)
