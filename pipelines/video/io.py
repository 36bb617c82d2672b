"""Video reading for the video pipeline: decord first, PyAV as the fallback, behind `read_frames` and `video_info`;
frame-index sampling (by count, fps or token budget; uniform or segment-random) and an optional npz frame cache.

Timestamps are frame index / average fps (exact for constant-frame-rate video). No model code here.
"""

import hashlib
import logging
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmgrpo.errors import UserError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "decord", "av")
MODES = ("count", "fps", "budget")
STRATEGIES = ("uniform", "segment_random")


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about a video: frame count, average fps, duration (seconds), frame size, backend."""

    path: str
    num_frames: int
    fps: float
    duration: float
    height: int
    width: int
    backend: str


# ----------------------------------------------------------------------------- backends


def _decord_reader(path: str):
    # lazy: decord (x86_64 only) loads only when a video is read
    from decord import VideoReader, cpu

    return VideoReader(path, ctx=cpu(0), num_threads=1)


def _decord_info(path: str) -> tuple[int, float, int, int]:
    vr = _decord_reader(path)
    n = len(vr)
    if n == 0:
        return 0, 0.0, 0, 0
    h, w = vr[0].shape[:2]
    return n, float(vr.get_avg_fps()), int(h), int(w)


def _decord_read(path: str, indices: list[int]) -> np.ndarray:
    return _decord_reader(path).get_batch(indices).asnumpy()  # [T, H, W, 3]


def _av_info(path: str) -> tuple[int, float, int, int]:
    # lazy: PyAV loads only when a video is read
    import av

    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError("the file has no video stream")
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0.0)
        n = int(stream.frames)
        if n <= 0:  # some containers carry no frame count: decode to count (small clips only pay this)
            n = sum(1 for _ in container.decode(stream))
        return n, fps, int(stream.height or 0), int(stream.width or 0)


def _av_read(path: str, indices: list[int]) -> np.ndarray:
    # lazy: PyAV loads only when a video is read
    import av

    wanted = set(indices)
    got: dict[int, np.ndarray] = {}
    with av.open(path) as container:
        stream = container.streams.video[0]
        # PyAV decodes sequentially: walk once up to the last wanted frame, keep the wanted ones
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                got[i] = frame.to_ndarray(format="rgb24")
            if i >= max(indices):
                break
    missing = sorted(wanted - set(got))
    if missing:
        raise ValueError(f"PyAV decoded only {len(got)} of the requested frames (missing {missing[:3]})")
    return np.stack([got[i] for i in indices])  # [T, H, W, 3]


_INFO = {"decord": _decord_info, "av": _av_info}
_READ = {"decord": _decord_read, "av": _av_read}


def _check_file(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_dir():
        raise UserError(
            f"video {str(path)!r} is a directory, not a video file; point at the file inside it (or set "
            f"skip_bad_videos=true to skip it)"
        )
    if not p.is_file():
        raise UserError(f"video {str(path)!r} does not exist; fix the path (or set skip_bad_videos=true to skip it)")
    if p.stat().st_size == 0:
        raise UserError(f"video {str(path)!r} is empty (0 bytes); re-encode or remove it")
    return str(p)


def _order(backend: str) -> tuple[str, ...]:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return ("decord", "av") if backend == "auto" else (backend,)


def _run(what: str, path: str, backend: str, fn_table: dict, *args):
    """Call the first backend that works; decord errors fall through to PyAV under "auto"."""
    errors = []
    for name in _order(backend):
        try:
            return name, fn_table[name](path, *args)
        except ImportError as err:
            errors.append(f"{name}: not installed ({err})")
        except Exception as err:  # noqa: BLE001 - decord raises RuntimeError/DECORDError, PyAV its own error tree
            errors.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
    raise UserError(
        f"video {path!r} cannot be {what} ({'; '.join(errors)}); the file is corrupt or not a video: "
        f"re-encode it (e.g. ffmpeg -i in.mp4 -c:v libx264 out.mp4) or set skip_bad_videos=true"
    )


def video_info(path: str | os.PathLike, *, backend: str = "auto") -> VideoInfo:
    """Frame count, fps, duration and size of a video; missing, empty, corrupt or frameless files raise UserError."""
    p = _check_file(path)
    used, (n, fps, h, w) = _run("opened", p, backend, _INFO)
    if n <= 0:
        raise UserError(f"video {p!r} has no frames (zero-length); re-encode or remove it")
    if not fps or not math.isfinite(fps) or fps <= 0:
        raise UserError(f"video {p!r} reports fps={fps!r}; timestamps need a positive frame rate: re-encode it")
    return VideoInfo(p, n, fps, n / fps, h, w, used)


# ----------------------------------------------------------------------------- reading with a cache


def _cache_path(cache_dir: str | os.PathLike, path: str, indices: list[int]) -> Path:
    st = Path(path).stat()
    key = f"{Path(path).resolve()}|{st.st_mtime_ns}|{st.st_size}|{','.join(map(str, indices))}"
    return Path(cache_dir) / f"{hashlib.sha1(key.encode()).hexdigest()}.npz"


def read_frames(
    path: str | os.PathLike,
    indices,
    *,
    backend: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    info: VideoInfo | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Frames at `indices` as uint8 [T, H, W, 3] and their timestamps in seconds [T] (index / fps).

    decord is tried first and PyAV after it under backend="auto" (decord 0.6.0 fails on some frame widths, e.g. 48).
    With `cache_dir`, frames are stored as npz keyed by (path, mtime, size, indices) and read back on the next call.

    Args:
        path: video file.  indices: [T] frame indices in [0, num_frames).
        backend: "auto" | "decord" | "av".  info: a `video_info` result, to skip re-opening the header.
    Returns:
        (frames uint8 [T, H, W, 3], timestamps float64 [T]).
    """
    info = info or video_info(path, backend=backend)
    idx = [int(i) for i in np.asarray(indices).reshape(-1)]
    if not idx:
        raise ValueError(f"indices for video {info.path!r} are empty; sample at least one frame")
    bad = [i for i in idx if not 0 <= i < info.num_frames]
    if bad:
        raise ValueError(f"frame indices {bad[:3]} are outside [0, {info.num_frames}) for video {info.path!r}")
    times = np.asarray(idx, dtype=np.float64) / info.fps  # [T]
    cached = _cache_path(cache_dir, info.path, idx) if cache_dir is not None else None
    if cached is not None and cached.is_file():
        try:
            with np.load(cached) as z:
                return z["frames"], z["timestamps"]
        except (OSError, ValueError, KeyError, zlib.error):
            log.warning("frame cache %s is unreadable; decoding %s again", cached, info.path)
    _, frames = _run("decoded", info.path, backend, _READ, idx)
    frames = np.ascontiguousarray(frames[..., :3], dtype=np.uint8)  # [T, H, W, 3]
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, frames=frames, timestamps=times)
        os.replace(tmp, cached)  # atomic: a concurrent reader never sees half a file
    return frames, times


# ----------------------------------------------------------------------------- sampling


def frames_for_budget(
    token_budget: int, pixels_per_frame: int, *, temporal_patch: int = 2, pixels_per_token: int = 28 * 28
) -> int:
    """Frames that fit a visual-token budget: T = floor(budget * temporal_patch * pixels_per_token / pixels).

    Qwen2-VL / Qwen2.5-VL: one token per 28x28 pixels (14-px patches merged 2x2) per pair of frames.
    """
    if token_budget < 1 or pixels_per_frame < 1:
        raise ValueError(f"token_budget ({token_budget}) and pixels_per_frame ({pixels_per_frame}) must be >= 1")
    return int(token_budget * temporal_patch * pixels_per_token // pixels_per_frame)


def frame_indices(info: VideoInfo, frames, *, seed: int | None = None) -> np.ndarray:
    """Frame indices [T] of the video `info` (`video_info`) under a pipeline's `FrameSettings` `frames`: `sample_indices`
    with its fields, one call for the policy's encode and the data's token count."""
    return sample_indices(
        info.num_frames,
        info.fps,
        mode=frames.mode,
        num_frames=frames.num_frames,
        fps=frames.fps,
        token_budget=frames.token_budget,
        pixels_per_frame=frames.pixels_per_frame,
        min_frames=frames.min_frames,
        max_frames=frames.max_frames,
        strategy=frames.strategy,
        seed=seed,
    )


def sample_indices(
    total: int,
    video_fps: float,
    *,
    mode: str = "count",
    num_frames: int = 8,
    fps: float = 2.0,
    token_budget: int = 1024,
    pixels_per_frame: int = 128 * 28 * 28,
    min_frames: int = 2,
    max_frames: int = 64,
    multiple_of: int = 2,
    strategy: str = "uniform",
    seed: int | None = None,
) -> np.ndarray:
    """Frame indices [T] of a video with `total` frames at `video_fps`.

    T: `num_frames` ("count"), duration * `fps` ("fps"), or `frames_for_budget(token_budget, pixels_per_frame)`
    ("budget"); clipped to [min_frames, max_frames] and rounded down to a multiple of `multiple_of` (the temporal
    patch, so the processor never pads by repeating a frame). "uniform": round(linspace(0, total - 1, T)) as
    qwen-vl-utils; "segment_random": one index drawn uniformly in each of T equal segments (TSN), seeded by `seed`.
    A video shorter than T repeats frames (indices stay sorted).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if total < 1 or video_fps <= 0:
        raise ValueError(f"a video needs total >= 1 frames and fps > 0, got total={total}, fps={video_fps}")
    if multiple_of < 1 or min_frames < 1 or max_frames < min_frames:
        raise ValueError(
            f"need multiple_of >= 1 and 1 <= min_frames <= max_frames, got {multiple_of}, {min_frames}, {max_frames}"
        )
    if mode == "count":
        t = num_frames
    elif mode == "fps":
        t = math.floor(total / video_fps * fps)
    else:
        t = frames_for_budget(token_budget, pixels_per_frame, temporal_patch=multiple_of)
    t = min(max(t, min_frames), max_frames)
    t = max(multiple_of, t // multiple_of * multiple_of)
    if strategy == "uniform":
        return np.round(np.linspace(0, total - 1, t)).astype(np.int64)
    edges = np.linspace(0, total, t + 1)  # [T + 1] segment boundaries
    rng = np.random.default_rng(seed)
    picks = edges[:-1] + rng.random(t) * (edges[1:] - edges[:-1])  # [T]
    return np.minimum(np.floor(picks), total - 1).astype(np.int64)


def check_videos(
    paths: list[str], *, skip: bool = False, backend: str = "auto", where: list[str] | None = None
) -> list[int]:
    """Positions of the usable videos; a bad one raises UserError, or is skipped (with a logged count) when `skip`."""
    ok, skipped = [], []
    for i, path in enumerate(paths):
        try:
            video_info(path, backend=backend)
            ok.append(i)
        except UserError as err:
            label = where[i] if where else str(path)
            if not skip:
                raise UserError(f"{label}: {err}") from None
            skipped.append(f"{label}: {err}")
    if skipped:
        log.warning("skipped %d of %d videos that cannot be read (first: %s)", len(skipped), len(paths), skipped[0])
    return ok
