"""ShapesWorld scenes: GenEval-style prompt specs, their text, prompt splits, and seeded scenes rendered to RGB.

Pure numpy; no torch and no detector here (the verifier lives in verifier.py and only reads the constants below).
"""

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass, field

import numpy as np

SHAPES = ("circle", "square", "triangle")
# hues ~0/50/120/185/235/290 degrees: the verifier classifies colour by hue, so blur into the grey background
# (which keeps the hue) cannot turn one colour into another
COLORS = {
    "red": (225, 35, 35),
    "yellow": (225, 195, 25),
    "green": (35, 170, 45),
    "cyan": (30, 190, 215),
    "blue": (40, 60, 220),
    "purple": (175, 45, 215),
}
BACKGROUND = (242, 242, 242)
CATEGORIES = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.7, 0.15, 0.15)
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
COUNTS = (2, 3, 4)
SIZE_RANGE = (0.14, 0.22)  # half-extent of an object, as a fraction of the image side (>= 4.5 px at 32 px)
MARGIN = 0.06  # minimum gap between two objects' boxes (fraction of the side): objects never touch
POSITION_THRESHOLD = 0.1  # GenEval-style slack: the offset must exceed 0.1 x the two boxes' extents


@dataclass(frozen=True)
class ObjectSpec:
    """What the prompt asks for one kind of object: a shape, an optional colour, how many."""

    shape: str
    color: str | None = None
    count: int = 1


@dataclass(frozen=True)
class PromptSpec:
    """A parsed prompt: the category, the requested objects and, for `position`, `objects[0] relation objects[1]`.

    `exact` (counting) means no more than `count` matching objects may appear, as GenEval's "exclude" rule.
    """

    category: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    exact: bool = False

    @property
    def prompt(self) -> str:
        return spec_to_prompt(self)


@dataclass(frozen=True)
class SceneObject:
    """One drawn object; `cx, cy, size` are fractions of the image side (`size` = half-extent, y points down)."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float


@dataclass(frozen=True)
class Scene:
    """One rendering that satisfies `spec` (a ground-truth image for the prompt `spec.prompt`)."""

    objects: tuple[SceneObject, ...]
    spec: PromptSpec | None = None
    resolution: int = 32
    seed: int = field(default=0, compare=False)

    @property
    def prompt(self) -> str | None:
        return None if self.spec is None else self.spec.prompt

    @property
    def category(self) -> str | None:
        return None if self.spec is None else self.spec.category

    def render(self, resolution: int | None = None, *, antialias: bool = True) -> np.ndarray:
        return render(self, resolution, antialias=antialias)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _object_phrase(obj: ObjectSpec) -> str:
    noun = obj.shape if obj.count == 1 else obj.shape + "s"
    words = f"{obj.color} {noun}" if obj.color else noun
    det = _article(words) if obj.count == 1 else NUMBER_WORDS[obj.count]
    return f"{det} {words}"


def spec_to_prompt(spec: PromptSpec) -> str:
    """The canonical text of a spec: "a red circle left of a blue square", "three triangles", ..."""
    phrases = [_object_phrase(o) for o in spec.objects]
    if spec.relation is not None:
        return f"{phrases[0]} {spec.relation} {phrases[1]}"
    return " and ".join(phrases)


_WORD = {w: n for n, w in NUMBER_WORDS.items()}
_OBJ_RE = r"(?P<det{i}>a|an|one|two|three|four|\d+)\s+(?:(?P<color{i}>{colors})\s+)?(?P<shape{i}>{shapes})s?"


@functools.lru_cache(maxsize=4096)
def _prompt_regex() -> tuple[re.Pattern, re.Pattern]:
    fill = {"colors": "|".join(COLORS), "shapes": "|".join(SHAPES)}
    obj = [_OBJ_RE.replace("{i}", str(i)).format(**fill) for i in range(3)]
    rel = "|".join(RELATIONS)
    pos = re.compile(rf"{obj[0]}\s+(?P<rel>{rel})\s+(?:the\s+)?{obj[1]}")
    conj = re.compile(rf"{obj[0]}(?:\s*,?\s+and\s+{obj[1]})?(?:\s*,?\s+and\s+{obj[2]})?")
    return pos, conj


def _category(objects: tuple[ObjectSpec, ...], relation: str | None) -> str:
    if relation is not None:
        return "position"
    if len(objects) >= 2:
        return "color_attr" if all(o.color for o in objects) else "two_objects"
    if objects[0].count > 1:
        return "counting"
    return "colors" if objects[0].color else "single_object"


@functools.lru_cache(maxsize=65536)
def parse_prompt(prompt: str) -> PromptSpec:
    """Parse a ShapesWorld prompt back into its spec (inverse of `spec_to_prompt`; tolerant of case, "a photo of").

    Raises ValueError naming the prompt when it is not in the ShapesWorld grammar.
    """
    text = re.sub(r"\s+", " ", prompt.strip().lower()).rstrip(".")
    text = re.sub(r"^(a photo of|an image of|a picture of)\s+", "", text)
    pos, conj = _prompt_regex()
    m = pos.fullmatch(text) or conj.fullmatch(text)
    if m is None:
        raise ValueError(
            f"prompt {prompt!r} is not in the ShapesWorld grammar; write e.g. 'a red circle left of a blue square', "
            f"'three triangles' or 'a circle and a square' with shapes {SHAPES} and colours {tuple(COLORS)}"
        )
    objects = []
    for i in range(3):
        if m.groupdict().get(f"shape{i}") is None:
            continue
        det = m.group(f"det{i}")
        count = 1 if det in ("a", "an") else int(det) if det.isdigit() else _WORD[det]
        objects.append(ObjectSpec(m.group(f"shape{i}"), m.group(f"color{i}"), count))
    relation = m.groupdict().get("rel")
    objects = tuple(objects)
    category = _category(objects, relation)
    return PromptSpec(category, objects, relation, exact=category == "counting")


def canonical_key(spec: PromptSpec) -> str:
    """A key shared by prompts that ask for the same thing ("B right of A" == "A left of B"); splits hash it."""
    if spec.relation in ("right of", "below"):
        flip = {"right of": "left of", "below": "above"}[spec.relation]
        spec = PromptSpec(spec.category, spec.objects[::-1], flip, spec.exact)
    elif spec.relation is None and len(spec.objects) > 1:
        spec = PromptSpec(spec.category, tuple(sorted(spec.objects, key=_object_phrase)), None, spec.exact)
    return spec_to_prompt(spec)


def all_specs(category: str | None = None) -> list[PromptSpec]:
    """Every prompt of ShapesWorld (or of one category), in a fixed order."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category {category!r} is unknown; choose from {CATEGORIES}")
    pairs = list(itertools.product(COLORS, SHAPES))
    out: dict[str, list[PromptSpec]] = {
        "single_object": [PromptSpec("single_object", (ObjectSpec(s),)) for s in SHAPES],
        "two_objects": [
            PromptSpec("two_objects", (ObjectSpec(a), ObjectSpec(b))) for a, b in itertools.combinations(SHAPES, 2)
        ],
        "counting": [PromptSpec("counting", (ObjectSpec(s, None, n),), exact=True) for s in SHAPES for n in COUNTS],
        "colors": [PromptSpec("colors", (ObjectSpec(s, c),)) for c, s in pairs],
        # as GenEval: two different objects (shape) in two different colours, so the test is attribute binding
        "color_attr": [
            PromptSpec("color_attr", (ObjectSpec(s1, c1), ObjectSpec(s2, c2)))
            for (c1, s1), (c2, s2) in itertools.combinations(pairs, 2)
            if c1 != c2 and s1 != s2
        ],
        "position": [
            PromptSpec("position", (ObjectSpec(s1, c1), ObjectSpec(s2, c2)), rel)
            for (c1, s1), (c2, s2) in itertools.permutations(pairs, 2)
            for rel in RELATIONS
        ],
    }
    return out[category] if category else [s for c in CATEGORIES for s in out[c]]


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=1)
def _split_table() -> dict[str, str]:
    # rank the canonical keys of each category by hash and cut by SPLIT_FRACTIONS: deterministic, disjoint, and
    # every split gets at least one prompt of every category (single_object has only 3 prompts)
    table = {}
    for cat in CATEGORIES:
        keys = sorted({canonical_key(s) for s in all_specs(cat)}, key=lambda k: (stable_hash(k), k))
        n = len(keys)
        n_val = max(1, round(SPLIT_FRACTIONS[1] * n))
        n_test = max(1, round(SPLIT_FRACTIONS[2] * n))
        for i, key in enumerate(keys):
            table[key] = "test" if i < n_test else "val" if i < n_test + n_val else "train"
    return table


def split_of(prompt: str | PromptSpec) -> str:
    """The split ("train" / "val" / "test") a prompt belongs to; equivalent phrasings share a split."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    key = canonical_key(spec)
    table = _split_table()
    if key in table:
        return table[key]
    u = (stable_hash(key) % 10_000) / 10_000  # prompts outside the built-in grammar: plain hash threshold
    return "train" if u < SPLIT_FRACTIONS[0] else "val" if u < SPLIT_FRACTIONS[0] + SPLIT_FRACTIONS[1] else "test"


def list_prompts(split: str, category: str | None = None) -> list[str]:
    """The prompts of one split (optionally one category), sorted; the three splits never share a prompt."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown; choose from {SPLITS}")
    return sorted(s.prompt for s in all_specs(category) if split_of(s) == split)


def prompts_by_category(split: str) -> dict[str, list[str]]:
    """`{category: prompts}` for one split."""
    return {c: list_prompts(split, c) for c in CATEGORIES}


def boxes_apart(a: SceneObject, b: SceneObject, margin: float = MARGIN) -> bool:
    """True when the two objects' boxes are separated by at least `margin` along x or y."""
    gap = a.size + b.size + margin
    return abs(a.cx - b.cx) >= gap or abs(a.cy - b.cy) >= gap


def relation_holds(a_xy, a_ext, b_xy, b_ext, relation: str, *, threshold: float = POSITION_THRESHOLD) -> bool:
    """Whether object A is `relation` object B (GenEval-style, image y points down).

    Rule: d = c_B - c_A; along = component of d on the relation's axis (left of: +x, above: +y); it holds iff
    along > threshold * (ext_A + ext_B) on that axis and along >= 0.5 |d| (B lies within 60 degrees of the axis).
    Args: a_xy, b_xy centres (x, y); a_ext, b_ext full box extents (w, h), all in the same units.
    """
    axis = {"left of": (1, 0), "right of": (-1, 0), "above": (0, 1), "below": (0, -1)}.get(relation)
    if axis is None:
        raise ValueError(f"relation {relation!r} is unknown; choose from {RELATIONS}")
    dx, dy = b_xy[0] - a_xy[0], b_xy[1] - a_xy[1]
    along = dx * axis[0] + dy * axis[1]
    k = 0 if axis[0] else 1
    return bool(along > threshold * (a_ext[k] + b_ext[k]) and along >= 0.5 * float(np.hypot(dx, dy)))


def _place(rng: np.random.Generator, kinds: list[tuple[str, str]], size_range, relation: str | None):
    """Sizes and centres for `kinds` with no two boxes closer than MARGIN; None if rejection sampling fails."""
    lo, hi = size_range
    for attempt in range(200):
        # crowded scenes (four objects) lower the largest size, never the smallest: tiny shapes are ambiguous
        top = max(lo, hi * 0.93 ** (attempt // 20))
        objs: list[SceneObject] = []
        for shape, color in kinds:
            for _ in range(50):  # redraw only this object before restarting the whole scene
                r = float(rng.uniform(lo, top))
                cx, cy = rng.uniform(r + 0.02, 1 - r - 0.02, size=2)
                obj = SceneObject(shape, color, float(cx), float(cy), r)
                if all(boxes_apart(obj, o) for o in objs):
                    objs.append(obj)
                    break
            else:
                break
        if len(objs) < len(kinds):
            continue
        if relation is not None and not _clear_relation(objs[0], objs[1], relation):
            continue
        return tuple(objs)
    return None


def _clear_relation(a: SceneObject, b: SceneObject, relation: str) -> bool:
    # generation is stricter than the verifier: boxes separated along the axis and within ~27 degrees of it
    d = np.array([b.cx - a.cx, b.cy - a.cy])
    axis = {"left of": (1, 0), "right of": (-1, 0), "above": (0, 1), "below": (0, -1)}[relation]
    along = float(d @ np.array(axis))
    across = float(abs(d @ np.array(axis[::-1])))
    return along >= a.size + b.size + MARGIN and across <= 0.5 * along


def sample_scene(
    spec: PromptSpec | str,
    rng: np.random.Generator,
    *,
    resolution: int = 32,
    size_range: tuple[float, float] = SIZE_RANGE,
) -> Scene:
    """One scene satisfying `spec`: exactly the requested objects; unrequested colours are drawn at random."""
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    colors = list(COLORS)
    kinds = []
    for obj in spec.objects:
        for _ in range(obj.count):
            kinds.append((obj.shape, obj.color or colors[int(rng.integers(len(colors)))]))
    objs = _place(rng, kinds, size_range, spec.relation)
    if objs is None:
        raise ValueError(f"could not place {len(kinds)} objects of size_range {size_range}; use smaller sizes")
    return Scene(objs, spec, resolution)


def ground_truth_scenes(
    prompt: str | PromptSpec,
    n: int,
    *,
    seed: int = 0,
    resolution: int = 32,
    size_range: tuple[float, float] = SIZE_RANGE,
) -> list[Scene]:
    """`n` ground-truth scenes for a prompt; the same (prompt, seed) always gives the same scenes, in any order."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    rng = np.random.default_rng([seed, stable_hash(spec.prompt)])
    return [
        Scene(sample_scene(spec, rng, resolution=resolution, size_range=size_range).objects, spec, resolution, seed)
        for _ in range(n)
    ]


def random_scene(
    rng: np.random.Generator, *, n_objects: int | None = None, resolution: int = 32, size_range=SIZE_RANGE
) -> Scene:
    """A scene of 1-4 random objects with no prompt (for VQA and tests)."""
    n = int(rng.integers(1, 5)) if n_objects is None else n_objects
    kinds = [(SHAPES[int(rng.integers(len(SHAPES)))], list(COLORS)[int(rng.integers(len(COLORS)))]) for _ in range(n)]
    objs = _place(rng, kinds, size_range, None)
    if objs is None:
        raise ValueError(f"could not place {n} objects of size_range {size_range}; use fewer or smaller objects")
    return Scene(objs, None, resolution)


def coverage(shape: str, cx, cy, rx, ry, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean inside-mask of an axis-aligned shape at sample points (xs, ys); triangles point up.

    Shared by the renderer and the verifier's templates so both draw the very same geometry.
    """
    u, v = (xs - cx) / rx, (ys - cy) / ry  # [..] in [-1, 1] over the box
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":
        return (np.abs(u) <= 1.0) & (np.abs(v) <= 1.0)
    if shape == "triangle":
        return (v <= 1.0) & (np.abs(u) <= (v + 1.0) / 2.0)
    raise ValueError(f"shape {shape!r} is unknown; choose from {SHAPES}")


def render(scene: Scene, resolution: int | None = None, *, antialias: bool = True) -> np.ndarray:
    """Rasterise a scene to RGB uint8 [H, W, 3] (4x4 supersampling when `antialias`)."""
    res = int(resolution or scene.resolution)
    if res < 8:
        raise ValueError(f"resolution {res} is too small to draw shapes; use 32 or 64")
    ss = 4 if antialias else 1
    grid = (np.arange(res * ss) + 0.5) / (res * ss)  # sample centres in [0, 1]
    xs, ys = np.meshgrid(grid, grid)  # [H*ss, W*ss]
    canvas = np.empty((res * ss, res * ss, 3), np.float32)
    canvas[:] = BACKGROUND
    for obj in scene.objects:
        inside = coverage(obj.shape, obj.cx, obj.cy, obj.size, obj.size, xs, ys)
        canvas[inside] = COLORS[obj.color]
    img = canvas.reshape(res, ss, res, ss, 3).mean(axis=(1, 3))  # [H, W, 3] box-filter down-sample
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)
