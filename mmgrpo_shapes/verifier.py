"""ShapesWorld verifier: a deterministic detector (hue segmentation, connected components, template shapes) and
GenEval-style strict / partial scores of images against prompts. Pure numpy; torch only touched if given tensors.
"""

import itertools
from typing import Any

import numpy as np

from mmgrpo_shapes.scenes import (
    COLORS,
    SHAPES,
    PromptSpec,
    coverage,
    parse_prompt,
    relation_holds,
)

CHROMA_MIN = 80.0  # a pixel is "object" when max(RGB) - min(RGB) >= this (objects ~180, background 0)
MIN_AREA_FRAC = 0.006  # components smaller than this fraction of the image are specks, not objects
MIN_IOU = 0.7  # below this best template IoU a blob has no shape (it still earns colour credit)
MAX_DETECTIONS = 8  # the matcher only considers the largest ones


def _hue(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees [0, 360) of float RGB [..., 3] (standard HSV hexcone formula)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    mx, mn = rgb.max(-1), rgb.min(-1)
    c = np.maximum(mx - mn, 1e-6)
    h = np.where(mx == r, ((g - b) / c) % 6.0, np.where(mx == g, (b - r) / c + 2.0, (r - g) / c + 4.0))
    return (60.0 * h) % 360.0


_REF_HUES = _hue(np.array(list(COLORS.values()), np.float64))  # [C]
_COLOR_NAMES = tuple(COLORS)


def to_uint8(image: Any) -> np.ndarray:
    """An image as uint8 [H, W, 3]: PIL, HWC numpy (uint8, or float in [0, 1]), torch [3, H, W] float or uint8.

    Floats are always read as [0, 1] (what diffusers' `output_type="pt"` gives) and clipped; never guessed.
    """
    if hasattr(image, "detach"):  # torch tensor: CHW -> HWC
        t = image.detach().cpu()
        if t.ndim != 3 or t.shape[0] != 3:
            raise ValueError(f"tensor image must be [3, H, W], got {tuple(t.shape)}; index the batch first")
        image = t.permute(1, 2, 0).float().numpy() if t.is_floating_point() else t.permute(1, 2, 0).numpy()
    elif hasattr(image, "convert"):  # PIL
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"image must be HxWx3 (or a [3, H, W] tensor), got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"image dtype {arr.dtype} is not supported; pass uint8 in [0, 255] or float in [0, 1]")
    return np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)


def connected_components(classes: np.ndarray) -> np.ndarray:
    """4-connected components of equal non-negative class ids, by min-label propagation with pointer jumping.

    Args: classes [H, W] int, -1 = background. Returns labels [H, W] int (-1 background; a component's label is
    the flat index of its first pixel).
    """
    h, w = classes.shape
    big = h * w
    fg = classes >= 0
    lab = np.where(fg, np.arange(big).reshape(h, w), big)  # [H, W]
    same_x = fg[:, :-1] & (classes[:, :-1] == classes[:, 1:])  # [H, W-1] joined to the right neighbour
    same_y = fg[:-1, :] & (classes[:-1, :] == classes[1:, :])  # [H-1, W] joined to the lower neighbour
    while True:
        new = lab.copy()
        new[:, :-1] = np.minimum(new[:, :-1], np.where(same_x, lab[:, 1:], big))
        new[:, 1:] = np.minimum(new[:, 1:], np.where(same_x, lab[:, :-1], big))
        new[:-1, :] = np.minimum(new[:-1, :], np.where(same_y, lab[1:, :], big))
        new[1:, :] = np.minimum(new[1:, :], np.where(same_y, lab[:-1, :], big))
        flat = np.append(new.ravel(), big)
        new = flat[new]  # pointer jumping: a label is a pixel of the same component, so follow it
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(fg, lab, -1)


def classify_shape(mask: np.ndarray) -> tuple[str | None, float]:
    """Best-fitting shape of a component's box-cropped mask [h, w], by IoU with templates fitted by moments.

    Each hypothesis places its template from the mask's mean and standard deviations (circle r = 2 sd, square
    r = sqrt(3) sd, upward triangle r_x = sqrt(6) sd_x, r_y = 3 sd_y / sqrt(2) with its centroid a third of
    r_y below the box centre), so a blurred-away apex or a stray pixel barely moves the fit (a box fit would).
    Returns (shape, or None when the best IoU < MIN_IOU; best IoU).
    """
    h, w = mask.shape
    ys, xs = np.mgrid[0:h, 0:w] + 0.5  # [h, w] pixel centres
    m = mask.astype(np.float64)
    area = max(m.sum(), 1.0)
    mx, my = (m * xs).sum() / area, (m * ys).sum() / area
    sx = max(np.sqrt((m * (xs - mx) ** 2).sum() / area), 0.5)
    sy = max(np.sqrt((m * (ys - my) ** 2).sum() / area), 0.5)
    tri_ry = 3.0 * sy / np.sqrt(2.0)
    fits = {
        "circle": (mx, my, 2.0 * sx, 2.0 * sy),
        "square": (mx, my, np.sqrt(3.0) * sx, np.sqrt(3.0) * sy),
        "triangle": (mx, my - tri_ry / 3.0, np.sqrt(6.0) * sx, tri_ry),
    }
    best, best_iou = None, -1.0
    for shape in SHAPES:
        tpl = coverage(shape, *fits[shape], xs, ys)
        iou = float((tpl & mask).sum() / max((tpl | mask).sum(), 1))
        if iou > best_iou:
            best, best_iou = shape, iou
    return (best if best_iou >= MIN_IOU else None), best_iou


def detect(image: Any) -> list[dict]:
    """Objects in an image: dicts with shape (or None), color, cx, cy, w, h (fractions of the side), area, iou.

    Pixels with chroma >= CHROMA_MIN are labelled with the nearest palette hue, split into 4-connected components
    of one colour, and components under MIN_AREA_FRAC of the image are dropped. Sorted by area, largest first.
    """
    img = to_uint8(image).astype(np.float32)
    height, width = img.shape[:2]
    chroma = img.max(-1) - img.min(-1)  # [H, W]
    dist = np.abs(_hue(img)[..., None] - _REF_HUES)  # [H, W, C]
    dist = np.minimum(dist, 360.0 - dist)
    classes = np.where(chroma >= CHROMA_MIN, dist.argmin(-1), -1)  # [H, W]
    labels = connected_components(classes)
    ids, counts = np.unique(labels[labels >= 0], return_counts=True)
    out = []
    for lab, area in zip(ids, counts):
        if area < MIN_AREA_FRAC * height * width:
            continue
        ys, xs = np.nonzero(labels == lab)
        y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
        shape, iou = classify_shape(labels[y0:y1, x0:x1] == lab)
        color = _COLOR_NAMES[int(classes[ys[0], xs[0]])]
        out.append(
            dict(
                shape=shape,
                color=color,
                cx=(x0 + x1) / 2 / width,
                cy=(y0 + y1) / 2 / height,
                w=(x1 - x0) / width,
                h=(y1 - y0) / height,
                area=int(area),
                iou=round(iou, 4),
            )
        )
    return sorted(out, key=lambda d: -d["area"])


def _credit(req, det: dict | None) -> float:
    """Per requested object: shape 1 (no colour asked) or shape 0.5 + colour 0.5."""
    if det is None:
        return 0.0
    shape_ok = float(det["shape"] == req.shape)
    if req.color is None:
        return shape_ok
    return 0.5 * shape_ok + 0.5 * float(det["color"] == req.color)


def _matches(req, det: dict) -> bool:
    return det["shape"] == req.shape and (req.color is None or det["color"] == req.color)


def _relation(dets: list[dict | None], relation: str) -> bool:
    a, b = dets
    if a is None or b is None:
        return False
    return relation_holds((a["cx"], a["cy"]), (a["w"], a["h"]), (b["cx"], b["cy"]), (b["w"], b["h"]), relation)


def evaluate(spec: PromptSpec, dets: list[dict]) -> dict:
    """Strict 0/1 and partial [0, 1] scores of detections against a spec (see `verify` for the rules)."""
    dets = dets[:MAX_DETECTIONS]
    if spec.exact:  # counting: matched / max(asked, found), as GenEval's include + exclude pair
        (req,) = spec.objects
        found = sum(_matches(req, d) for d in dets)
        partial = min(found, req.count) / max(found, req.count)
        return dict(strict=found == req.count, partial=partial, assignment=None, relation_ok=None, extra=0)
    reqs = [o for o in spec.objects for _ in range(o.count)]
    slots = dets + [None] * len(reqs)  # None = requested object left unmatched
    best = (-1.0, None, False)
    for perm in itertools.permutations(range(len(slots)), len(reqs)):
        chosen = [slots[i] for i in perm]
        total = sum(_credit(r, d) for r, d in zip(reqs, chosen))
        rel_ok = spec.relation is not None and _relation(chosen, spec.relation)
        value = total + float(rel_ok)
        if value > best[0]:
            best = (value, chosen, rel_ok)
    value, chosen, rel_ok = best
    n_terms = len(reqs) + (spec.relation is not None)
    all_full = all(_credit(r, d) == 1.0 for r, d in zip(reqs, chosen))
    strict = all_full and (spec.relation is None or rel_ok)
    return dict(
        strict=bool(strict),
        partial=value / n_terms,
        assignment=chosen,
        relation_ok=rel_ok if spec.relation is not None else None,
        extra=len(dets) - sum(d is not None for d in chosen),
    )


def verify(image: Any, prompt: str | PromptSpec) -> dict:
    """Check one image against one prompt; the verifier behind the `shapes_geneval` reward.

    Rules (GenEval categories): every requested object must be found with its shape (and colour when asked);
    counting needs exactly N objects of the shape; position needs the relation between the matched pair.
    Extra objects are allowed except in counting, as in GenEval. Partial credit: per requested object 1 for
    the shape (no colour asked) or 0.5 shape + 0.5 colour, plus 1 for the relation, divided by the number of
    terms; counting scores min(found, N) / max(found, N). Objects are matched to maximise the credit.
    Returns dict(strict: bool, partial: float, category, prompt, objects: detections, relation_ok).
    """
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    dets = detect(image)
    res = evaluate(spec, dets)
    return dict(
        strict=res["strict"],
        partial=float(res["partial"]),
        category=spec.category,
        prompt=spec.prompt,
        objects=dets,
        relation_ok=res["relation_ok"],
    )


def _as_list(images: Any) -> list:
    if hasattr(images, "ndim") and images.ndim == 4:  # a batch array / tensor [N, 3, H, W] or [N, H, W, 3]
        return [images[i] for i in range(images.shape[0])]
    return list(images)


def score(images: list, prompts: list[str], *, mode: str = "partial", extra_penalty: float = 0.0) -> np.ndarray:
    """ShapesWorld GenEval reward: one score per (image, prompt) pair.

    Args:
        images: N images: PIL, uint8 [H, W, 3] arrays, float [3, H, W] tensors in [0, 1], uint8 tensors, or
            one batched [N, 3, H, W] tensor / [N, H, W, 3] array.
        prompts: N ShapesWorld prompts.
        mode: "strict" (GenEval 0/1 correctness) or "partial" (dense credit in [0, 1]).
        extra_penalty: subtracted per detected object the prompt did not ask for (outside counting, whose
            partial already divides by the objects found), floored at 0: max(0, score - p * extra). Why: partial
            credit alone pays for drawing more shapes (docs/t2i_study.md, finding 1); GenEval's counting rule
            applied to every category.
    Returns: float32 [N].
    """
    if mode not in ("strict", "partial"):
        raise ValueError(f"mode {mode!r} is unknown; choose 'strict' (0/1 GenEval) or 'partial' (dense credit)")
    if not 0.0 <= extra_penalty <= 1.0:
        raise ValueError(f"extra_penalty={extra_penalty!r} must be in [0, 1]; 0 (the default) leaves extras free")
    images = _as_list(images)
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts; pass one prompt per image")
    out = np.empty(len(images), np.float32)
    for i, (img, prompt) in enumerate(zip(images, prompts)):
        spec = parse_prompt(prompt)
        res = evaluate(spec, detect(img))
        value = float(res["strict"]) if mode == "strict" else res["partial"]
        out[i] = max(0.0, value - extra_penalty * res["extra"])
    return out


def count_objects(images: list) -> np.ndarray:
    """float32 [N]: the objects `detect` finds in each image (the training log's extra-shape monitor)."""
    return np.array([len(detect(img)) for img in _as_list(images)], np.float32)


def category_report(images: list, prompts: list[str]) -> dict[str, dict[str, float]]:
    """Per-category GenEval table: `{category: {"strict": mean, "partial": mean, "n": count}}` plus "overall"
    (the mean over categories, as GenEval reports it). For `mmgrpo eval` and before/after comparisons."""
    images = _as_list(images)
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts; pass one prompt per image")
    rows: dict[str, list[tuple[float, float]]] = {}
    for img, prompt in zip(images, prompts):
        spec = parse_prompt(prompt)
        res = evaluate(spec, detect(img))
        rows.setdefault(spec.category, []).append((float(res["strict"]), float(res["partial"])))
    table = {
        cat: {"strict": float(np.mean([r[0] for r in v])), "partial": float(np.mean([r[1] for r in v])), "n": len(v)}
        for cat, v in rows.items()
    }
    if table:
        table["overall"] = {
            "strict": float(np.mean([t["strict"] for t in table.values()])),
            "partial": float(np.mean([t["partial"] for t in table.values()])),
            "n": len(images),
        }
    return table
