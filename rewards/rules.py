"""Rule rewards as pure per-sample functions: format, accuracy, multiple choice, numeric, box/temporal IoU, length.

No model and no registry here (rewards/rule_rewards.py wraps these as registered batch rewards).
"""

import math
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Contents of the last <tag>...</tag> in `text` (stripped), or None when there is none."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def answer_text(text: str, tag: str = "answer") -> str:
    """The answer span: the last <answer> block when present, else the whole text (stripped)."""
    inner = extract_tag(text, tag)
    return text.strip() if inner is None else inner


def format_ok(
    text: str, *, mode: str = "strict", allow_empty_think: bool = False, think: str = "think", answer: str = "answer"
) -> bool:
    """Whether `text` follows the <think>...</think><answer>...</answer> format (R1-V, VLM-R1; TON empty think).

    strict: exactly one think block then one non-empty answer block, nothing else but whitespace.
    lenient: a think block followed (anywhere later) by a non-empty answer block; text around them is allowed.
    The think block may be empty only when allow_empty_think (Think-or-Not drops the reasoning).
    """
    if mode not in ("strict", "lenient"):
        raise ValueError(f"format mode={mode!r} must be 'strict' or 'lenient'")
    t, a = re.escape(think), re.escape(answer)
    if mode == "strict":
        m = re.fullmatch(rf"\s*<{t}>(.*?)</{t}>\s*<{a}>(.*?)</{a}>\s*", text, flags=re.DOTALL)
        if m is None or any(f"<{tag}>" in g or f"</{tag}>" in g for g in m.groups() for tag in (think, answer)):
            return False
    else:
        m = re.search(rf"<{t}>(.*?)</{t}>.*?<{a}>(.*?)</{a}>", text, flags=re.DOTALL)
        if m is None:
            return False
    reasoning, ans = m.group(1).strip(), m.group(2).strip()
    return bool(ans) and (bool(reasoning) or allow_empty_think)


_LATEX_WRAPPERS = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\displaystyle", "$")


def _unbox(s: str) -> str:
    m = re.search(r"\\boxed\{", s)
    if not m:
        return s
    depth, i = 1, m.end()
    while i < len(s) and depth:
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        i += 1
    return s[m.end() : i - 1] if depth == 0 else s


def normalize_answer(s: str) -> str:
    """Lower-cased answer without \\boxed{}, $, LaTeX spacing, \\text{}, trailing period and inner spaces."""
    s = _unbox(s.strip())
    for w in _LATEX_WRAPPERS:
        s = s.replace(w, "")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = s.strip().rstrip(".").strip()
    return re.sub(r"\s+", "", s).lower()


def parse_number(s: str) -> Fraction | None:
    """An exact number from an answer: '3', '-2.5', '1,000', '3/4', '\\frac{3}{4}', '50%' (=1/2), '1e3'; else None."""
    t = normalize_answer(s).replace(",", "")
    percent = t.endswith("%")  # also "\\%"
    t = t.rstrip("%").rstrip("\\")
    m = re.fullmatch(rf"\(?({_NUM})\)?(?:/\(?({_NUM})\)?)?", t)
    if m is None:
        return None
    try:
        value = Fraction(m.group(1))
        if m.group(2) is not None:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            value = value / den
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _math_verify_equal(pred: str, gold: str, timeout: float) -> bool | None:
    """math-verify's verdict (False on timeout or error), or None when the package is missing or cannot parse.

    math-verify times out with signal.alarm, which works only in the main thread; elsewhere (the reward server's
    worker threads, async trainers) the call runs in a daemon thread and we stop waiting after `timeout` seconds.
    """
    try:
        # lazy: math_verify takes ~0.7 s to import; only math answers need it
        import math_verify
    except ImportError:
        return None
    if threading.current_thread() is threading.main_thread():
        return _math_verify_call(math_verify, pred, gold, max(1, math.ceil(timeout)))
    box: list[bool | None] = []
    worker = threading.Thread(
        target=lambda: box.append(_math_verify_call(math_verify, pred, gold, None)), daemon=True, name="math-verify"
    )
    worker.start()
    worker.join(timeout)
    return box[0] if box else False  # a hostile answer that keeps sympy busy scores as not equal


def _math_verify_call(math_verify, pred: str, gold: str, seconds: int | None) -> bool | None:
    try:
        g = math_verify.parse(gold, parsing_timeout=seconds)
        p = math_verify.parse(pred, parsing_timeout=seconds)
        if not g or not p:
            return None
        return bool(math_verify.verify(g, p, timeout_seconds=seconds))
    except Exception:  # noqa: BLE001  math-verify's TimeoutException or any sympy error on hostile input: not equal
        return False


def math_equal(pred: str, gold: str, *, timeout: float = 5.0, use_math_verify: bool = True) -> bool:
    """Whether two final answers are mathematically equal (R1-V / VLM-R1 accuracy).

    math-verify first (when importable; `timeout` seconds per parse/verify), then a fallback that compares
    normalised strings and exact rationals (fractions, decimals, percentages). An empty prediction is never equal.
    """
    if not pred.strip():
        return False
    if use_math_verify:
        verdict = _math_verify_equal(pred, gold, timeout)
        if verdict:
            return True
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    p, g = parse_number(pred), parse_number(gold)
    return p is not None and g is not None and p == g


def choice_letter(text: str) -> str | None:
    """The single option letter in an answer: 'B', '(B)', 'B.', 'B) cat', 'B: cat'; None for 'A, B', 'AB', 'A or B'."""
    t = text.strip()
    m = re.fullmatch(r"\(?([A-Za-z])\)?", t)
    if m:
        return m.group(1).upper()
    m = re.fullmatch(r"\(?([A-Z])(?:\)|\.|:|\)\.)(?:\s+(.*))?", t, flags=re.DOTALL)
    if m is None:
        return None
    rest = m.group(2) or ""
    # "B. or C" style lists name a second option: a hedge, not an answer
    if re.search(r"(?:^|[\s,;/(])\(?[A-Z]\)?(?:[.):,;]|\s*$)", rest) and re.search(r"\b(or|and)\b|[,;/]", rest):
        return None
    return m.group(1)


def numeric_close(pred: str, gold: str | float, *, atol: float = 1e-6, rtol: float = 0.0) -> bool:
    """|p - g| <= atol + rtol * |g| (numpy.isclose convention); an unparsable prediction is not close."""
    p = parse_number(pred)
    g = parse_number(str(gold)) if not isinstance(gold, int | float) else Fraction(gold)
    if p is None or g is None:
        return False
    return abs(float(p) - float(g)) <= atol + rtol * abs(float(g))


def parse_box(text: str) -> list[float] | None:
    """The first [x1, y1, x2, y2] (or four comma-separated numbers) in the answer span; None when absent."""
    m = re.search(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]", text)
    if m is None:
        m = re.search(rf"({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})", text)
    return None if m is None else [float(v) for v in m.groups()]


def rescale_box(box: Sequence[float], from_size: Sequence[float], to_size: Sequence[float]) -> list[float]:
    """A box given in an image of (width, height) `from_size` expressed in `to_size` pixels (x by w, y by h)."""
    sx, sy = to_size[0] / from_size[0], to_size[1] / from_size[1]
    return [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]


def box_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """Continuous IoU of two (x1, y1, x2, y2) boxes; a degenerate (reversed) box or an empty union scores 0.

    IoU = area(P ∩ G) / (area(P) + area(G) - area(P ∩ G)), areas in continuous coordinates (no +1 pixel term).
    """
    if len(pred) != 4 or len(gt) != 4:
        raise ValueError(f"boxes must have 4 numbers (x1, y1, x2, y2), got {len(pred)} and {len(gt)}")
    if pred[2] < pred[0] or pred[3] < pred[1] or gt[2] < gt[0] or gt[3] < gt[1]:
        return 0.0
    iw = max(0.0, min(pred[2], gt[2]) - max(pred[0], gt[0]))
    ih = max(0.0, min(pred[3], gt[3]) - max(pred[1], gt[1]))
    inter = iw * ih
    union = (pred[2] - pred[0]) * (pred[3] - pred[1]) + (gt[2] - gt[0]) * (gt[3] - gt[1]) - inter
    return inter / union if union > 0 else 0.0


def parse_span(text: str) -> tuple[float, float] | None:
    """(start, end) seconds from 'X to Y', 'X and Y', 'X - Y', '[X, Y]' or any first two numbers; None otherwise."""
    m = re.search(rf"({_NUM})\s*(?:s|sec|seconds)?\s*(?:to|and|-|–|,)\s*({_NUM})", text)
    if m is None:
        nums = re.findall(_NUM, text)
        if len(nums) < 2:
            return None
        return float(nums[0]), float(nums[1])
    return float(m.group(1)), float(m.group(2))


def temporal_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """IoU of two (start, end) intervals; an empty union or a reversed interval scores 0 (not 1, cf. VideoChat-R1).

    tIoU = max(0, min(e_p, e_g) - max(s_p, s_g)) / (max(e_p, e_g) - min(s_p, s_g)).
    """
    (sp, ep), (sg, eg) = pred, gt
    if ep < sp or eg < sg:
        return 0.0
    inter = max(0.0, min(ep, eg) - max(sp, sg))
    union = max(ep, eg) - min(sp, sg)
    return inter / union if union > 0 else 0.0


def tempsamp_shaping(iou: float, *, threshold: float = 0.8, alpha: float = 1.0) -> float:
    """TempSamp-R1's asymmetric soft reward shaping of an IoU (arXiv:2509.18056).

    r = th + 0.01 * log(1 + iou - th) if iou >= th else th - (exp(alpha * (th - iou)) - 1) / (exp(alpha) - 1).
    """
    if alpha <= 0:
        raise ValueError(f"alpha={alpha} must be > 0 (it is the curvature of the shaping below the threshold)")
    if iou >= threshold:
        return threshold + 0.01 * math.log(1.0 + iou - threshold)
    return threshold - math.expm1(alpha * (threshold - iou)) / math.expm1(alpha)


def cosine_length(
    length: int,
    correct: bool,
    *,
    max_len: int = 1024,
    correct_range: tuple[float, float] = (0.5, 1.0),
    wrong_range: tuple[float, float] = (-0.5, 0.0),
) -> float:
    """Cosine length reward (Yeo et al., arXiv:2502.03373): short correct answers and long wrong ones score higher.

    c = cos(pi * min(L, L_max) / L_max); correct: lo + (hi - lo) * (1 + c) / 2; wrong: hi - (hi - lo) * (1 + c) / 2.
    Correctness is an input here (VLM-R1's version overwrote it with 1.0, scoring every answer as correct).
    """
    if max_len <= 0:
        raise ValueError(f"max_len={max_len} must be > 0")
    c = math.cos(math.pi * min(length, max_len) / max_len)
    lo, hi = correct_range if correct else wrong_range
    return lo + (hi - lo) * (1 + c) / 2 if correct else hi - (hi - lo) * (1 + c) / 2


def overlong_penalty(length: int, *, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment (arXiv:2503.14476): 0 up to max_len - cache_len, then linear to -1, then -1.

    r = 0 if L <= Lmax - Lc; (Lmax - Lc - L) / Lc if L <= Lmax; -1 otherwise.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must be in (0, max_len={max_len}]")
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return (max_len - cache_len - length) / cache_len
    return -1.0


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (unit insert, delete, substitute) between two strings or token lists."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def word_error_rate(hyp: str, ref: str) -> float:
    """WER = word-level edit distance / number of reference words (an empty reference: 0 if hyp empty, else 1)."""
    h, r = hyp.split(), ref.split()
    if not r:
        return 0.0 if not h else 1.0
    return edit_distance(h, r) / len(r)


def quoted_text(prompt: str) -> str | None:
    """The text a prompt asks to render: everything inside double quotes (straight or curly), joined by spaces."""
    parts = re.findall(r"[\"“”](.*?)[\"“”]", prompt)
    return " ".join(parts) if parts else None


def ocr_similarity(reading: str, target: str, *, substring: bool = False) -> float:
    """1 - normalised edit distance between OCR reading and target, both lower-cased with whitespace removed.

    r = 1 - min(ED(reading, target), len(target)) / len(target) (Flow-GRPO OCR reward); an empty target scores 1.0
    for an empty reading, else 0. substring=True scores 1.0 whenever the target appears inside the reading, as
    Flow-GRPO does (extra rendered text then goes unpunished).
    """
    a, b = re.sub(r"\s+", "", reading).lower(), re.sub(r"\s+", "", target).lower()
    if not b:
        return 1.0 if not a else 0.0
    if substring and b in a:
        return 1.0
    return 1.0 - min(edit_distance(a, b), len(b)) / len(b)
