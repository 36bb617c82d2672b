"""ShapesWorld VQA: MathVista-style questions with verifiable short answers about rendered scenes, a JSONL + PNG
writer for the VLM pipeline, and a minimal answer normaliser. The rule rewards themselves live in `rewards`.
"""

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmgrpo_shapes.scenes import (
    BACKGROUND,
    CATEGORIES,
    COLORS,
    NUMBER_WORDS,
    SHAPES,
    SIZE_RANGE,
    Scene,
    SceneObject,
    _place,
    ground_truth_scenes,
    list_prompts,
    relation_holds,
    stable_hash,
)

QUESTION_TYPES = ("count", "color", "shape", "existence", "position", "arithmetic")
FORMAT_INSTRUCTION = "Think inside <think></think>, then give only the final answer inside <answer></answer>."


def _name(obj: SceneObject) -> str:
    return f"{obj.color} {obj.shape}"


def _count_qa(objs: list[SceneObject]) -> list[tuple[str, str]]:
    out = [(f"How many {s}s are there?", str(sum(o.shape == s for o in objs))) for s in SHAPES]
    # colour counts only for colours present, or "0" would flood the answers
    out += [
        (f"How many {c} objects are there?", str(sum(o.color == c for o in objs)))
        for c in COLORS
        if any(o.color == c for o in objs)
    ]
    out.append(("How many objects are there in total?", str(len(objs))))
    return out


def _color_qa(objs: list[SceneObject]) -> list[tuple[str, str]]:
    # only ask about a shape drawn exactly once, so the answer is unique
    return [(f"What color is the {o.shape}?", o.color) for o in objs if sum(p.shape == o.shape for p in objs) == 1]


def _shape_qa(objs: list[SceneObject]) -> list[tuple[str, str]]:
    return [
        (f"What shape is the {o.color} object?", o.shape) for o in objs if sum(p.color == o.color for p in objs) == 1
    ]


def _existence_qa(objs: list[SceneObject], rng: np.random.Generator) -> list[tuple[str, str]]:
    present = sorted({_name(o) for o in objs})
    absent = [f"{c} {s}" for c in COLORS for s in SHAPES if f"{c} {s}" not in present]
    picks = [str(x) for x in rng.choice(absent, size=min(len(present), len(absent)), replace=False)]
    # as many "no" as "yes" questions, so answering "yes" always scores 50%
    return [(f"Is there a {n}?", "yes") for n in present] + [(f"Is there a {n}?", "no") for n in picks]


def _position_qa(objs: list[SceneObject]) -> list[tuple[str, str]]:
    unique = [o for o in objs if sum(_name(p) == _name(o) for p in objs) == 1]
    out = []
    for a in unique:
        for b in unique:
            if a is b:
                continue
            box_a, box_b = (2 * a.size, 2 * a.size), (2 * b.size, 2 * b.size)
            for rel, opposite in (("left of", "right of"), ("above", "below")):
                # ask only when either the relation or its opposite clearly holds: the answer is never borderline
                if relation_holds((a.cx, a.cy), box_a, (b.cx, b.cy), box_b, rel):
                    out.append((f"Is the {_name(a)} {rel} the {_name(b)}?", "yes"))
                elif relation_holds((a.cx, a.cy), box_a, (b.cx, b.cy), box_b, opposite):
                    out.append((f"Is the {_name(a)} {rel} the {_name(b)}?", "no"))
    return out


def _arithmetic_qa(objs: list[SceneObject]) -> list[tuple[str, str]]:
    n = {s: sum(o.shape == s for o in objs) for s in SHAPES}
    out = []
    for i, s1 in enumerate(SHAPES):
        for s2 in SHAPES[i + 1 :]:
            if n[s1] + n[s2] > 0:
                out.append((f"How many {s1}s and {s2}s are there altogether?", str(n[s1] + n[s2])))
        for s2 in SHAPES:
            if s1 != s2 and n[s1] >= n[s2] and n[s1] > 0:
                out.append((f"How many more {s1}s than {s2}s are there?", str(n[s1] - n[s2])))
        out.append((f"If two more {s1}s were added, how many {s1}s would there be?", str(n[s1] + 2)))
    return out


def scene_questions(scene: Scene, rng: np.random.Generator) -> dict[str, list[tuple[str, str]]]:
    """Every (question, answer) the scene supports, by question type; answers are short lower-case strings."""
    objs = list(scene.objects)
    return {
        "count": _count_qa(objs),
        "color": _color_qa(objs),
        "shape": _shape_qa(objs),
        "existence": _existence_qa(objs, rng),
        "position": _position_qa(objs),
        "arithmetic": _arithmetic_qa(objs),
    }


def question_template(question: str) -> str:
    """The question with its colour and shape words masked ("How many _ are there?"): what an image-blind model can
    condition on, and the unit within which `make_vqa` balances answers."""
    words = "|".join(list(COLORS) + [f"{s}s?" for s in SHAPES])
    return re.sub(rf"\b({words})\b", "_", question.split("\n")[0])


_COUNTS4 = ("1", "2", "3", "4")
TEMPLATE_ANSWERS: dict[str, dict[str, tuple[str, ...]]] = {
    "count": {
        "How many _ are there?": ("0",) + _COUNTS4,
        "How many _ objects are there?": _COUNTS4,
        "How many objects are there in total?": _COUNTS4,
    },
    "color": {"What color is the _?": tuple(COLORS)},
    "shape": {"What shape is the _ object?": SHAPES},
    "existence": {"Is there a _ _?": ("yes", "no")},
    "position": {"Is the _ _ left of the _ _?": ("yes", "no"), "Is the _ _ above the _ _?": ("yes", "no")},
    "arithmetic": {
        "How many _ and _ are there altogether?": _COUNTS4,
        "How many more _ than _ are there?": ("0", "1", "2", "3"),
        "If two more _ were added, how many _ would there be?": ("2", "3", "4", "5", "6"),
    },
}
"""every question template per type with its possible answers (scenes hold 1-4 objects): `make_vqa` draws the type,
then the template, then the answer uniformly, so every image-blind predictor sits at 1 / len(answers)"""


def _biased_scene(rng: np.random.Generator, resolution: int) -> Scene:
    """A random scene of 1-4 objects whose shapes and colours repeat often (each object takes the scene's dominant
    shape / colour with probability 0.6), so that rare answers (four circles, four red objects) are cheap to find."""
    n = int(rng.integers(1, 5))
    colors = list(COLORS)
    main_s, main_c = SHAPES[int(rng.integers(3))], colors[int(rng.integers(len(colors)))]
    kinds = [
        (
            main_s if rng.random() < 0.6 else SHAPES[int(rng.integers(3))],
            main_c if rng.random() < 0.6 else colors[int(rng.integers(len(colors)))],
        )
        for _ in range(n)
    ]
    objs = _place(rng, kinds, SIZE_RANGE, None)
    return Scene(objs, None, resolution) if objs is not None else _biased_scene(rng, resolution)


def _scene_source(pools: dict[str, list[str]], rng: np.random.Generator, resolution: int) -> Scene:
    """Half the scenes are ground truths of the split's T2I prompts (`pools` by category), half biased random
    scenes (the generator is seeded per split)."""
    if rng.random() < 0.5:
        return _biased_scene(rng, resolution)
    cat = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
    pool = pools[cat]
    prompt = pool[int(rng.integers(len(pool)))]
    return ground_truth_scenes(prompt, 1, seed=int(rng.integers(2**31)), resolution=resolution)[0]


def make_vqa(
    split: str,
    n: int,
    *,
    seed: int = 0,
    resolution: int = 32,
    types: tuple[str, ...] = QUESTION_TYPES,
) -> list[dict]:
    """`n` VQA records of `split` with balanced answers: the question types dealt in turn from a shuffled deck of
    `types`, each type's templates from a deck of its `TEMPLATE_ANSWERS`, each template's answers from a deck of its
    answers, so in every prefix each count differs from the others' by at most one.

    Scenes are drawn (half from `split`'s T2I prompts, half random, see `_scene_source`) until one asks the chosen
    template with the chosen answer; unused questions wait in buckets for later records. Each record: dict(id,
    image: uint8 [H, W, 3], question, answer, type, split, prompt: the scene's T2I prompt or None, objects: the
    scene's objects as dicts of shape, color, cx, cy, size).
    """
    bad = [t for t in types if t not in QUESTION_TYPES]
    if bad or not types:
        raise ValueError(f"types {types!r} must be a non-empty subset of {QUESTION_TYPES}")
    rng = np.random.default_rng([seed, stable_hash("vqa/" + split)])
    pools = {c: list_prompts(split, c) for c in CATEGORIES}
    buckets: dict[tuple[str, str], list[tuple[Scene, str]]] = {}
    decks: dict[str, list] = {}

    def deal(key: str, cards) -> str:  # draw without replacement from a shuffled deck, refilled when empty
        if not decks.get(key):
            decks[key] = [cards[i] for i in rng.permutation(len(cards))]
        return decks[key].pop()

    records = []
    while len(records) < n:
        kind = deal("", types)
        template = deal(kind, sorted(TEMPLATE_ANSWERS[kind]))
        answer = deal(template, TEMPLATE_ANSWERS[kind][template])
        while not buckets.get((template, answer)):
            scene = _scene_source(pools, rng, resolution)
            for pairs in scene_questions(scene, rng).values():
                for q, a in pairs:
                    buckets.setdefault((question_template(q), a), []).append((scene, q))
        found = buckets[(template, answer)]
        scene, question = found.pop(int(rng.integers(len(found))))
        records.append(
            dict(
                id=f"{split}-{len(records):05d}",
                image=scene.render(),
                question=question,
                answer=answer,
                type=kind,
                split=split,
                prompt=scene.prompt,
                objects=[
                    {"shape": o.shape, "color": o.color, "cx": o.cx, "cy": o.cy, "size": o.size} for o in scene.objects
                ],
            )
        )
    return records


def write_vqa_jsonl(records: list[dict], out_dir: str | Path, *, name: str = "vqa") -> Path:
    """Write records as `<out_dir>/<name>.jsonl` + `<out_dir>/images/<id>.png`; `image` holds the relative path.

    Returns the JSONL path. Other record fields (type, split, prompt) are kept.
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.jsonl"
    with open(path, "w") as f:
        for rec in records:
            rel = f"images/{rec['id']}.png"
            Image.fromarray(np.asarray(rec["image"], np.uint8)).save(out / rel)
            row = {k: v for k, v in rec.items() if k != "image"}
            f.write(json.dumps({"image": rel, **row}) + "\n")
    return path


def read_vqa_jsonl(path: str | Path) -> list[dict]:
    """Read a file written by `write_vqa_jsonl`, loading each image back to uint8 [H, W, 3]."""
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["image"] = np.asarray(Image.open(path.parent / row["image"]).convert("RGB"))
    return rows


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBERS = {w: str(n) for n, w in NUMBER_WORDS.items()} | {"zero": "0", "five": "5", "six": "6", "seven": "7"}


def extract_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` block, or None when there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, number words to digits, plural shapes to singular."""
    text = re.sub(r"[^a-z0-9.\- ]", " ", text.lower())
    words = re.sub(r"(?<!\d)\.|\.(?!\d)", " ", text).split()  # keep decimal points, drop full stops
    words = [w for w in words if w not in ("a", "an", "the")]
    words = [_NUMBERS.get(w, w) for w in words]
    words = [w[:-1] if w.endswith("s") and w[:-1] in SHAPES else w for w in words]
    return " ".join(words)


def check_answer(pred_answer: str, answer: str) -> bool:
    """Whether a predicted answer matches the reference after `normalize_answer` (tags are stripped first).

    "<think>..</think><answer>Two</answer>" matches "2"; "2.0" matches "2"; "Red." matches "red".
    """
    inner = extract_answer(pred_answer)
    pred = normalize_answer(inner if inner is not None else pred_answer)
    ref = normalize_answer(answer)
    try:
        return float(pred) == float(ref)
    except ValueError:
        return pred == ref


def swap_images(recs: list[dict[str, Any]], images: str) -> list[dict[str, Any]]:
    """The image records with their pixels replaced: "real" (unchanged), "blank" (the background colour everywhere)
    or "shuffled" (record i gets record i+1's image): the conditions of an is-it-looking check."""
    if images == "real":
        return recs
    if "image" not in recs[0]:
        raise ValueError(f"images={images!r} needs image records (VQA); these have {sorted(recs[0])}")
    if images == "blank":
        return [dict(r, image=np.full_like(np.asarray(r["image"]), BACKGROUND)) for r in recs]
    if images == "shuffled":
        return [dict(r, image=recs[(i + 1) % len(recs)]["image"]) for i, r in enumerate(recs)]
    raise ValueError(f"images {images!r} must be one of real, blank, shuffled")
