"""ShapesWorld video: seeded clips of shapes that appear, move and disappear, their ground-truth event timeline,
Charades-STA-style grounding queries and video QA, and mp4 writing (PyAV) / reading (PyAV or decord).
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmgrpo_shapes.scenes import COLORS, MARGIN, SHAPES, Scene, SceneObject, boxes_apart, render, stable_hash
from mmgrpo_shapes.vqa import question_template

DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "down": (0.0, 1.0), "up": (0.0, -1.0)}
VIDEO_TYPES = ("grounding", "direction", "order", "count")
SET_VERSION = 3
"""names the cached pretraining pool (`all_questions`, programs/pretrain_video.py `pool_dir`): bump it whenever clip
sampling or rendering changes"""
QUESTION_SET_VERSION = 4
"""names the cache of one-question-a-clip sets (pipelines/video/data.py): bump it whenever their choice of question
changes, and with SET_VERSION. 4: the type, template and answer are dealt from decks (`TEMPLATE_ANSWERS`; grounding-only
sets come out as before). Until then the key used SET_VERSION (3), so the pretraining pool, which 4 leaves as it was,
keeps its cache name"""
PATCH_FRAMES = 2
"""events start and end on multiples of this many frames: Qwen2-VL's temporal patch, so each temporal token group of
a fully sampled clip is either inside or outside an event"""
MOVE_GROUPS = (1, 3)
"""a move lasts 1-3 frame pairs (0.5-1.5 s at 4 fps) and starts anywhere in the clip"""
LEAD_GROUPS = (0, 1)
"""an object appears 0-1 frame pairs before its move starts and disappears 0-1 pairs after it ends (clipped)"""
N_OBJECTS_P = (1 / 3, 1 / 3, 1 / 3)
"""P(1, 2, 3 objects): uniform, so the count answer is at chance for a blind guess; 2/3 of clips have several
objects, so the query's colour and shape matter"""


@dataclass(frozen=True)
class Track:
    """One object's life in a clip: visible on frames [appear, disappear); moves `direction` on [move_start,
    move_end] frames, linearly from `start` to `end` (centres, fractions of the side)."""

    shape: str
    color: str
    size: float
    appear: int
    disappear: int
    start: tuple[float, float]
    end: tuple[float, float]
    direction: str
    move_start: int
    move_end: int

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"

    def center(self, frame: int) -> tuple[float, float]:
        u = np.clip((frame - self.move_start) / max(self.move_end - self.move_start, 1), 0.0, 1.0)
        return (
            float(self.start[0] + u * (self.end[0] - self.start[0])),
            float(self.start[1] + u * (self.end[1] - self.start[1])),
        )

    def visible(self, frame: int) -> bool:
        return self.appear <= frame < self.disappear


@dataclass(frozen=True)
class Clip:
    """A clip: tracks, `num_frames` frames at `fps` (frame i is shown over [i / fps, (i + 1) / fps) seconds)."""

    tracks: tuple[Track, ...]
    num_frames: int = 32
    fps: int = 4
    resolution: int = 64

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps

    def scene(self, frame: int) -> Scene:
        objs = [SceneObject(t.shape, t.color, *t.center(frame), t.size) for t in self.tracks if t.visible(frame)]
        return Scene(tuple(objs), None, self.resolution)

    def frames(self) -> np.ndarray:
        """uint8 [T, H, W, 3]."""
        return np.stack([render(self.scene(i)) for i in range(self.num_frames)])

    def timeline(self) -> list[dict]:
        """Ground-truth events sorted by time: dict(object, event, start, end, start_frame, end_frame), seconds.

        "appears" at frame a is at a / fps; "disappears" at the first invisible frame d is at d / fps; "moves
        <dir>" spans [move_start / fps, move_end / fps] (the object is still between those frames outside it).
        """
        ev = []
        for t in self.tracks:
            ev.append(dict(object=t.name, event="appears", start_frame=t.appear, end_frame=t.appear))
            move = f"moves {t.direction}"
            ev.append(dict(object=t.name, event=move, start_frame=t.move_start, end_frame=t.move_end))
            if t.disappear < self.num_frames:
                ev.append(dict(object=t.name, event="disappears", start_frame=t.disappear, end_frame=t.disappear))
        for e in ev:
            e["start"], e["end"] = e["start_frame"] / self.fps, e["end_frame"] / self.fps
        return sorted(ev, key=lambda e: (e["start"], e["end"], e["object"]))


def _track(rng: np.random.Generator, shape: str, color: str, num_frames: int, size_range) -> Track | None:
    # Events are short (a move of 1-3 frame pairs, visible 0-1 pair either side of it) and drawn uniformly over the
    # clip, on frame-pair boundaries, so no constant span fits them (best ~0.2 mIoU): the span must be read from the
    # frames, and each of the model's temporal token groups (2 frames) is wholly inside or outside an event.
    size = float(rng.uniform(*size_range))
    groups = num_frames // PATCH_FRAMES
    length = int(rng.integers(MOVE_GROUPS[0], MOVE_GROUPS[1] + 1))
    first = int(rng.integers(0, groups - length + 1))  # the move covers frame pairs [first, first + length)
    move_start, move_end = PATCH_FRAMES * first, PATCH_FRAMES * (first + length)
    appear = max(0, move_start - PATCH_FRAMES * int(rng.integers(LEAD_GROUPS[0], LEAD_GROUPS[1] + 1)))
    disappear = min(num_frames, move_end + PATCH_FRAMES * int(rng.integers(LEAD_GROUPS[0], LEAD_GROUPS[1] + 1)))
    direction = list(DIRECTIONS)[int(rng.integers(4))]
    dist = float(rng.uniform(0.25, 0.45))
    lo, hi = size + 0.02, 1 - size - 0.02
    dx, dy = DIRECTIONS[direction]
    # the start is drawn so that the whole path stays inside the frame
    x0 = rng.uniform(lo - min(dx, 0) * dist, hi - max(dx, 0) * dist)
    y0 = rng.uniform(lo - min(dy, 0) * dist, hi - max(dy, 0) * dist)
    if not (lo <= x0 <= hi and lo <= y0 <= hi):
        return None
    start = (float(x0), float(y0))
    end = (float(x0 + dx * dist), float(y0 + dy * dist))
    return Track(shape, color, size, appear, disappear, start, end, direction, move_start, move_end)


def _apart(a: Track, b: Track, num_frames: int) -> bool:
    for f in range(num_frames):
        if a.visible(f) and b.visible(f):
            oa = SceneObject(a.shape, a.color, *a.center(f), a.size)
            ob = SceneObject(b.shape, b.color, *b.center(f), b.size)
            if not boxes_apart(oa, ob, MARGIN):
                return False
    return True


def sample_clip(
    rng: np.random.Generator,
    *,
    n_objects: int | None = None,
    num_frames: int = 32,
    fps: int = 4,
    resolution: int = 64,
    size_range: tuple[float, float] = (0.1, 0.15),
) -> Clip:
    """A random clip of 1-3 objects with distinct colours and shapes; each appears, moves once, maybe disappears.

    Event times are uniform over the clip, on frame-pair boundaries (see MOVE_GROUPS, LEAD_GROUPS). Objects never overlap on any frame (boxes
    stay MARGIN apart); sizes are fractions of the side.
    """
    if not 16 <= num_frames <= 64 or num_frames % PATCH_FRAMES:
        raise ValueError(
            f"num_frames={num_frames} must be even and in [16, 64]: events sit on frame pairs and clips "
            f"need room for appear/move/disappear"
        )
    n = int(rng.choice(3, p=N_OBJECTS_P)) + 1 if n_objects is None else n_objects
    if not 1 <= n <= len(SHAPES):
        raise ValueError(f"n_objects={n} must be in [1, {len(SHAPES)}]: each object has its own shape")
    for _ in range(50):
        shapes = rng.permutation(len(SHAPES))[:n]
        colors = rng.permutation(len(COLORS))[:n]
        tracks: list[Track] = []
        for s, c in zip(shapes, colors):
            for _ in range(100):  # redraw only this object's track before restarting the whole clip
                t = _track(rng, SHAPES[int(s)], list(COLORS)[int(c)], num_frames, size_range)
                if t is not None and all(_apart(t, o, num_frames) for o in tracks):
                    tracks.append(t)
                    break
            else:
                break
        if len(tracks) == n:
            return Clip(tuple(tracks), num_frames, fps, resolution)
    raise ValueError(f"could not place {n} moving objects of size_range {size_range}; use fewer or smaller ones")


def clip_questions(clip: Clip) -> dict[str, list[tuple[str, object]]]:
    """Every (question, answer) a clip supports, by type; grounding answers are [start, end] in seconds."""
    tl = clip.timeline()
    qa: dict[str, list[tuple[str, object]]] = {k: [] for k in VIDEO_TYPES}
    for e in tl:
        if e["event"].startswith("moves"):
            qa["grounding"].append((f"When does the {e['object']} move {e['event'][6:]}?", [e["start"], e["end"]]))
    for t in clip.tracks:
        qa["grounding"].append((f"When is the {t.name} visible?", [t.appear / clip.fps, t.disappear / clip.fps]))
        qa["direction"].append((f"In which direction does the {t.name} move?", t.direction))
    for a in clip.tracks:
        for b in clip.tracks:
            # "which first" only when the two events are at least two frames apart
            if a is not b and b.appear - a.appear >= 2:
                qa["order"].append((f"Which appears first, the {a.name} or the {b.name}?", a.name))
                qa["order"].append((f"Which appears first, the {b.name} or the {a.name}?", a.name))
            if a is not b and b.move_start - a.move_start >= 2:  # both name orders, so neither position is a prior
                qa["order"].append((f"Which starts moving first, the {a.name} or the {b.name}?", a.name))
                qa["order"].append((f"Which starts moving first, the {b.name} or the {a.name}?", a.name))
    qa["count"].append(("How many different objects appear in the video?", str(len(clip.tracks))))
    return qa


_NAMES = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)
TEMPLATE_ANSWERS: dict[str, dict[str, tuple[str, ...]]] = {
    "direction": {"In which direction does the _ _ move?": tuple(DIRECTIONS)},
    "order": {
        "Which appears first, the _ _ or the _ _?": _NAMES,
        "Which starts moving first, the _ _ or the _ _?": _NAMES,
    },
    "count": {"How many different objects appear in the video?": tuple(str(k + 1) for k in range(len(N_OBJECTS_P)))},
}
"""every categorical question template (`vqa.question_template`: colour and shape words masked) of `clip_questions`
with its possible answers: any of the 4 directions; any of the 6 x 3 object names for either order question (each name
wins once in 14-21 clips, so all are cheap to find); 1-3 objects. One-question sets deal the answer uniformly
from these. Grounding answers are spans, not categories, and are not balanced."""


def _decks(rng: np.random.Generator) -> Callable[[str, tuple], object]:
    """deal(key, cards): draw without replacement from a shuffled deck per key, refilled when empty, so in any prefix
    each card has been dealt as often as the others, within one (as `vqa.make_vqa`)."""
    decks: dict[str, list] = {}

    def deal(key: str, cards: tuple) -> object:
        if not decks.get(key):
            decks[key] = [cards[i] for i in rng.permutation(len(cards))]
        return decks[key].pop()

    return deal


def _balanced_questions(
    rng: np.random.Generator, n: int, types: tuple[str, ...], **clip_kw
) -> Iterator[tuple[Clip, str, str, object]]:
    """`n` (clip, type, question, answer), one question a clip, with answers balanced per template as in
    `vqa.make_vqa`: the type dealt from a deck of `types`, the template from a deck of its TEMPLATE_ANSWERS, the answer
    from a deck of the template's answers (and for order questions whether the answer is named first or second);
    clips are drawn until one asks that template with that answer, and the questions of clips not yet used wait in
    buckets. A grounding question is any of a fresh clip's grounding queries, as before: spans are not balanced."""
    deal = _decks(rng)
    buckets: dict[tuple[str, object], list[tuple[int, str]]] = {}
    clips: list[Clip] = []
    used: set[int] = set()
    for _ in range(n):
        kind = str(deal("", types))
        if kind == "grounding":
            clip = sample_clip(rng, **clip_kw)
            pairs = clip_questions(clip)["grounding"]
            yield clip, kind, *pairs[int(rng.integers(len(pairs)))]
            continue
        template = str(deal(kind, tuple(sorted(TEMPLATE_ANSWERS[kind]))))
        answer = str(deal(template, TEMPLATE_ANSWERS[kind][template]))
        # a clip serves one question: the questions of used clips are dropped from the bucket when it is read
        while not (found := [e for e in buckets.get((template, answer), ()) if e[0] not in used]):
            clips.append(sample_clip(rng, **clip_kw))
            for k, pairs in clip_questions(clips[-1]).items():
                for q, a in pairs if k != "grounding" else ():
                    buckets.setdefault((question_template(q), a), []).append((len(clips) - 1, q))
        buckets[(template, answer)] = found
        i, question = found[int(rng.integers(len(found)))]
        if kind == "order":  # both name orders of each pair are in the bucket: the answer is named first half the time
            first = deal(template + " first", (True, False))
            question = next(q for j, q in found if j == i and (q.index(answer) < q.index(" or ")) == first)
        used.add(i)
        yield clips[i], kind, question, answer


def _pool_questions(
    rng: np.random.Generator, n: int, types: tuple[str, ...], **clip_kw
) -> Iterator[tuple[Clip, list[tuple[str, str, object]]]]:
    """`n` clips, each with every (type, question, answer) of `types` it supports: the pretraining pool."""
    for _ in range(n):
        clip = sample_clip(rng, **clip_kw)
        qas = {t: q for t, q in clip_questions(clip).items() if t in types and q}
        # the one-question pick of SET_VERSION 3's sets, unused here but still drawn so the pool stays byte-identical
        kind = sorted(qas)[int(rng.integers(len(qas)))]
        rng.integers(len(qas[kind]))
        yield clip, [(k, q, a) for k in sorted(qas) for q, a in qas[k]]


def write_mp4(path: str | Path, frames: np.ndarray, fps: int, *, codec: str = "libx264", crf: int = 10) -> str:
    """Write uint8 [T, H, W, 3] frames as an mp4 (yuv420p) with PyAV; falls back to mpeg4 without libx264.

    Returns the codec used. H and W must be even (yuv420p).
    """
    import av  # lazy: PyAV takes ~0.1 s to import; only writing a clip needs it (as pipelines/video/io.py)

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"frame size {frames.shape[1:3]} must be even for yuv420p; use 32 or 64 px")
    try:
        av.codec.Codec(codec, "w")
    except Exception:  # noqa: BLE001 - PyAV raises several types for a missing encoder
        codec = "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)} if codec == "libx264" else {"qscale": "2"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return codec


def read_mp4(path: str | Path, *, backend: str = "av") -> tuple[np.ndarray, float]:
    """Decode all frames of an mp4 to uint8 [T, H, W, 3] and its fps, with PyAV ("av") or decord ("decord")."""
    if backend == "decord":
        from decord import VideoReader, cpu  # lazy: decord is optional (installed on x86_64 only)

        vr = VideoReader(str(path), ctx=cpu(0))
        return vr.get_batch(list(range(len(vr)))).asnumpy(), float(vr.get_avg_fps())
    if backend != "av":
        raise ValueError(f"backend {backend!r} is unknown; choose 'av' or 'decord'")
    import av  # lazy: PyAV takes ~0.1 s to import; only reading a clip needs it (as pipelines/video/io.py)

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def make_video_set(
    split: str,
    n: int,
    out_dir: str | Path,
    *,
    seed: int = 0,
    num_frames: int = 32,
    fps: int = 4,
    resolution: int = 64,
    types: tuple[str, ...] = VIDEO_TYPES,
    all_questions: bool = False,
) -> Path:
    """Write `n` clips as `<out_dir>/videos/<id>.mp4` and one question per clip to `<out_dir>/<split>.jsonl`, answers
    balanced per template (`_balanced_questions`), or, with `all_questions`, a row for every question of `types` the
    clip supports (pretraining data).

    Rows: video (relative path), question, answer ([start, end] seconds for grounding, else a string), type,
    split, id, duration, fps, num_frames, timeline. Splits use disjoint seeds (hash of the split name).
    Returns the JSONL path.
    """
    bad = [t for t in types if t not in VIDEO_TYPES]
    if bad or not types:
        raise ValueError(f"types {types!r} must be a non-empty subset of {VIDEO_TYPES}")
    rng = np.random.default_rng([seed, stable_hash("video/" + split)])
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    kw = dict(num_frames=num_frames, fps=fps, resolution=resolution)
    if all_questions:
        items = _pool_questions(rng, n, types, **kw)
    else:
        items = ((clip, [(k, q, a)]) for clip, k, q, a in _balanced_questions(rng, n, tuple(types), **kw))
    with open(path, "w") as f:
        for i, (clip, rows) in enumerate(items):
            rid = f"{split}-{i:05d}"
            write_mp4(out / "videos" / f"{rid}.mp4", clip.frames(), fps)  # only the clips that are asked about
            for j, (k, question, answer) in enumerate(rows):
                row = dict(
                    video=f"videos/{rid}.mp4",
                    question=question,
                    answer=answer,
                    type=k,
                    split=split,
                    id=f"{rid}-{j}" if all_questions else rid,
                )
                row.update(duration=clip.duration, fps=fps, num_frames=num_frames, timeline=clip.timeline())
                f.write(json.dumps(row) + "\n")
    return path
