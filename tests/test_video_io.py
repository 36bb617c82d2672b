"""pipelines/video/io.py: decord and PyAV agree, timestamps, the three sampling modes, the frame cache, and the
one-line errors for missing, corrupt, empty and frameless videos (or a logged skip)."""

import logging

import numpy as np
import pytest

from mmgrpo.errors import UserError
from mmgrpo_shapes.video import write_mp4
from pipelines.video import io


def _clip(path, *, n=12, fps=4, h=32, w=64):
    """n frames whose red channel encodes the frame index (20 * i), the rest grey: a decode of frame i is ~20 i."""
    frames = np.full((n, h, w, 3), 128, np.uint8)
    for i in range(n):
        frames[i, ..., 0] = 20 * i
    write_mp4(path, frames, fps)
    return frames


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("io") / "clip.mp4"
    return str(path), _clip(path)


def test_info(clip):
    path, _frames = clip
    info = io.video_info(path)
    assert (info.num_frames, info.fps, info.height, info.width) == (12, 4.0, 32, 64)
    assert info.duration == pytest.approx(3.0)  # 12 frames / 4 fps
    assert io.video_info(path, backend="av").num_frames == 12


def test_decord_and_av_agree_within_codec_tolerance(clip):
    path, _frames = clip
    idx = [0, 3, 7, 11]
    a, ta = io.read_frames(path, idx, backend="decord")
    b, tb = io.read_frames(path, idx, backend="av")
    assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape == (4, 32, 64, 3)
    # both decode the same H.264 stream; only the YUV->RGB conversion may differ by a rounding step or two
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 2.0
    # and each is the frame it was asked for: red ~ 20 * index (crf 10 keeps flat colours within a few levels)
    assert np.abs(a[..., 0].mean(axis=(1, 2)) - 20 * np.array(idx)).max() < 4
    # timestamps = index / fps: 0/4, 3/4, 7/4, 11/4 seconds
    np.testing.assert_allclose(ta, [0.0, 0.75, 1.75, 2.75])
    np.testing.assert_allclose(tb, ta)


def test_auto_falls_back_to_av_where_decord_fails(tmp_path):
    # decord 0.6.0 cannot copy frames 48 px wide (row padding: 6144 vs 4608 bytes); "auto" must still read them
    path = tmp_path / "w48.mp4"
    _clip(path, n=4, w=48)
    with pytest.raises(UserError, match="w48.mp4"):
        io.read_frames(path, [0, 1], backend="decord")
    frames, _ = io.read_frames(path, [0, 1], backend="auto")
    assert frames.shape == (2, 32, 48, 3)


def test_sampling_modes_and_strategies():
    # uniform count: round(linspace(0, 23, 8)) = round([0, 3.286, 6.571, 9.857, 13.14, 16.43, 19.71, 23])
    np.testing.assert_array_equal(io.sample_indices(24, 4.0, num_frames=8), [0, 3, 7, 10, 13, 16, 20, 23])
    # fps: 24 frames at 4 fps = 6 s; 1 fps -> 6 frames; 0.5 fps -> 3 -> rounded down to the temporal patch, 2
    assert len(io.sample_indices(24, 4.0, mode="fps", fps=1.0)) == 6
    assert len(io.sample_indices(24, 4.0, mode="fps", fps=0.5)) == 2
    # budget: 64 tokens, 56x56 = 3136 px per frame -> 64 * 2 * 784 / 3136 = 32 frames, capped by max_frames=16
    assert io.frames_for_budget(64, 56 * 56) == 32
    assert (
        len(io.sample_indices(100, 4.0, mode="budget", token_budget=64, pixels_per_frame=56 * 56, max_frames=16)) == 16
    )
    # segment-random: one index in each of 4 segments [0,6) [6,12) [12,18) [18,24); seeded, so reproducible
    a = io.sample_indices(24, 4.0, num_frames=4, strategy="segment_random", seed=3)
    b = io.sample_indices(24, 4.0, num_frames=4, strategy="segment_random", seed=3)
    np.testing.assert_array_equal(a, b)
    assert all(6 * s <= i < 6 * (s + 1) for s, i in enumerate(a))
    draws = {tuple(io.sample_indices(24, 4.0, num_frames=4, strategy="segment_random", seed=s)) for s in range(20)}
    assert len(draws) > 1
    # a 3-frame video asked for 4 frames repeats frames, sorted
    np.testing.assert_array_equal(io.sample_indices(3, 4.0, num_frames=4), [0, 1, 1, 2])
    with pytest.raises(ValueError, match="strategy"):
        io.sample_indices(24, 4.0, strategy="random")


def test_cache_roundtrip_and_invalidation(clip, tmp_path, monkeypatch):
    path, _ = clip
    cache = tmp_path / "cache"
    a, ta = io.read_frames(path, [1, 2], cache_dir=cache)
    assert len(list(cache.glob("*.npz"))) == 1
    calls = []
    monkeypatch.setitem(io._READ, "decord", lambda *a: calls.append(1) or np.zeros((2, 1, 1, 3), np.uint8))
    b, tb = io.read_frames(path, [1, 2], cache_dir=cache)  # served from the cache, no decode
    assert not calls
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ta, tb)
    io.read_frames(path, [1, 3], cache_dir=cache)  # other indices: a new entry, decoded
    assert calls and len(list(cache.glob("*.npz"))) == 2


def test_bad_videos_give_one_line_errors_naming_the_file(tmp_path):
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00not a video" * 64)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    for path, why in ((tmp_path / "missing.mp4", "does not exist"), (garbage, "cannot be opened"), (empty, "empty")):
        with pytest.raises(UserError, match=why) as err:
            io.read_frames(path, [0])
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_frameless_video_is_an_error(clip, monkeypatch):
    path, _ = clip
    monkeypatch.setitem(io._INFO, "decord", lambda p: (0, 0.0, 0, 0))  # a container with a stream but no frames
    with pytest.raises(UserError, match="no frames"):
        io.video_info(path, backend="decord")


def test_out_of_range_indices(clip):
    with pytest.raises(ValueError, match=r"outside \[0, 12\)"):
        io.read_frames(clip[0], [0, 12])


def test_check_videos_skips_with_a_logged_count(clip, tmp_path, caplog):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"junk")
    paths = [clip[0], str(bad), str(tmp_path / "nope.mp4")]
    with pytest.raises(UserError, match="bad.mp4"):
        io.check_videos(paths)
    with caplog.at_level(logging.WARNING, logger="pipelines.video.io"):
        assert io.check_videos(paths, skip=True) == [0]
    assert "skipped 2 of 3 videos" in caplog.text


def test_fps_and_budget_indices_and_timestamps(clip):
    # fps: 24 frames at 4 fps = 6 s at 1 fps -> T = 6: round(linspace(0, 23, 6)) = round([0, 4.6, 9.2, 13.8, 18.4, 23])
    idx = io.sample_indices(24, 4.0, mode="fps", fps=1.0)
    np.testing.assert_array_equal(idx, [0, 5, 9, 14, 18, 23])
    # budget: T = 16 of 100 frames: round(6.6 k), k = 0..15
    np.testing.assert_array_equal(
        io.sample_indices(100, 4.0, mode="budget", token_budget=64, pixels_per_frame=56 * 56, max_frames=16),
        [0, 7, 13, 20, 26, 33, 40, 46, 53, 59, 66, 73, 79, 86, 92, 99],
    )
    # segment-random on the 12-frame clip: the frames read are the ones drawn (red ~ 20 * index), at index / 4 s
    path, _ = clip
    idx = io.sample_indices(12, 4.0, num_frames=4, strategy="segment_random", seed=1)
    assert all(3 * s <= i < 3 * (s + 1) for s, i in enumerate(idx))  # one per segment [0,3) [3,6) [6,9) [9,12)
    frames, times = io.read_frames(path, idx)
    assert np.abs(frames[..., 0].mean(axis=(1, 2)) - 20 * idx).max() < 4
    np.testing.assert_allclose(times, idx / 4.0)


def test_cache_is_invalidated_when_the_file_changes(tmp_path):
    import os

    path = tmp_path / "v.mp4"
    _clip(path, n=6)
    cache = tmp_path / "cache"
    old, _ = io.read_frames(path, [5], cache_dir=cache)
    assert abs(float(old[..., 0].mean()) - 100) < 4  # red = 20 * 5
    frames = np.full((6, 32, 64, 3), 128, np.uint8)
    frames[..., 0] = 10  # same size and length, other content
    from mmgrpo_shapes.video import write_mp4

    write_mp4(path, frames, 4)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse fs clocks: make sure mtime moved
    new, _ = io.read_frames(path, [5], cache_dir=cache)
    assert abs(float(new[..., 0].mean()) - 10) < 4  # decoded again, not the stale entry
    assert len(list(cache.glob("*.npz"))) == 2


def test_real_zero_frame_mp4_is_named_or_skipped(tmp_path, caplog):
    """A header-only mp4 (a stream declared, no frame ever encoded) is an error naming it, not a crash."""
    import av

    path = tmp_path / "zero.mp4"
    container = av.open(str(path), mode="w", format="mp4")
    stream = container.add_stream("libx264", rate=4)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()  # writes the header although no frame follows
    for packet in stream.encode(None):  # flush only: nothing was encoded
        container.mux(packet)
    container.close()
    assert path.stat().st_size > 0
    with pytest.raises(UserError, match="zero.mp4") as err:
        io.read_frames(path, [0])
    assert "\n" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="pipelines.video.io"):
        assert io.check_videos([str(path)], skip=True) == []
    assert "skipped 1 of 1 videos" in caplog.text
