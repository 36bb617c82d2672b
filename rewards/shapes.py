"""The ShapesWorld GenEval-style verifier (mmgrpo_shapes/verifier.py) as the registered reward "shapes_geneval", and
its object count as "shapes_objects" (a monitor: weight 0 logs reward/<label>/mean); "shapes_think_cells" checks a
ShapesWorld VQA position think's cells against the record's objects, "shapes_think_objects" a count, existence or
arithmetic think's object list, "shapes_think_follows" whether an answer follows from its own think.

The verifier is imported inside the call, so `import rewards` works without the ShapesWorld package (mmgrpo_shapes).
"""

from rewards.api import REWARDS, FunctionReward, Reward


@REWARDS.register("shapes_geneval", input="image", range="[0, 1]", paper="GenEval-style (arXiv:2310.11513)")
def shapes_geneval(*, mode: str = "partial", extra_penalty: float = 0.0) -> Reward:
    """ShapesWorld verifier: fraction (partial) or all (strict) of the prompt's shapes/colours/counts present, minus
    `extra_penalty` per unrequested object (floored at 0; counting already pays found / max(found, asked))."""
    if mode not in ("partial", "strict"):
        raise ValueError(f"mode={mode!r} must be 'partial' or 'strict'")
    if not 0.0 <= extra_penalty <= 1.0:
        raise ValueError(f"extra_penalty={extra_penalty!r} must be in [0, 1]; 0 (the default) leaves extras free")

    def batch(samples, prompts):
        try:
            # lazy: `import rewards` works without mmgrpo_shapes (see the module docstring)
            from mmgrpo_shapes.verifier import score
        except ImportError as err:
            raise ValueError(f"shapes_geneval needs mmgrpo_shapes.verifier, which failed to import: {err}") from err
        return score(list(samples), list(prompts), mode=mode, extra_penalty=extra_penalty)

    return FunctionReward(
        batch,
        name="shapes_geneval",
        input="image",
        needs_prompts=True,
        preprocess=f"rendered-scene verifier ({mode}, extra_penalty {extra_penalty}); images PIL/uint8/float CHW",
    )


@REWARDS.register("shapes_objects", input="image", range="[0, inf)", paper="monitor (docs/t2i_study.md, finding 1)")
def shapes_objects() -> Reward:
    """Objects the ShapesWorld verifier detects per image: a monitor for weight 0, not a reward. Why: partial credit
    pays for extra shapes, and this count rising while held-out strict falls is how that hacking showed."""

    def batch(samples, prompts):
        try:
            # lazy: `import rewards` works without mmgrpo_shapes (see the module docstring)
            from mmgrpo_shapes.verifier import count_objects
        except ImportError as err:
            raise ValueError(f"shapes_objects needs mmgrpo_shapes.verifier, which failed to import: {err}") from err
        return count_objects(list(samples))

    return FunctionReward(
        batch, name="shapes_objects", input="image", needs_prompts=False, preprocess="verifier detections per image"
    )


def _think_reward(name: str, scorer: str, preprocess: str, objects: bool = True) -> Reward:
    """A text reward that scores each sample's <think> with mmgrpo_shapes.vqa_think's `scorer(text, prompt,
    objects)` against its record's `objects`, or `scorer(text, prompt)` when `objects` is False."""

    def batch(samples, prompts, objects=None):
        # lazy: `import rewards` works without mmgrpo_shapes (see the module docstring)
        from mmgrpo_shapes import vqa_think

        score = getattr(vqa_think, scorer)
        if objects is None:
            return [score(t, p) for t, p in zip(samples, prompts)]
        return [score(t, p, o) for t, p, o in zip(samples, prompts, objects)]

    need = ("objects",) if objects else ()
    return FunctionReward(
        batch, name=name, input="text", needs_prompts=True, fields=need, required=need, preprocess=preprocess
    )


@REWARDS.register(
    "shapes_think_cells", input="text", range="{0, 0.5, 1}", paper="Faithful GRPO grounding (arXiv:2604.08476)"
)
def shapes_think_cells() -> Reward:
    """The share of a ShapesWorld position think's two cell marks that are right ("x rc1 bs3": each object's
    initials and its token column or row); 0 for other questions. Needs the records' `objects` (shapes_vqa data)."""
    return _think_reward(
        "shapes_think_cells",
        "think_cells_score",
        "position questions' <think> cell marks against the scene's objects; other questions 0",
    )


@REWARDS.register(
    "shapes_think_objects", input="text", range="[0, 1]", paper="Faithful GRPO grounding (arXiv:2604.08476)"
)
def shapes_think_objects() -> Reward:
    """How well a ShapesWorld count, existence or arithmetic think lists the scene ("rc1 gt2 bs3": each object's
    initials and token column): shared marks / max(listed, present); 0 for other questions. Needs `objects`."""
    return _think_reward(
        "shapes_think_objects",
        "think_objects_score",
        "count, existence and arithmetic questions' <think> object list against the scene; others 0",
    )


@REWARDS.register(
    "shapes_think_follows", input="text", range="{0, 1}", paper="Faithful GRPO consistency (arXiv:2604.08476)"
)
def shapes_think_follows() -> Reward:
    """1 when a ShapesWorld VQA answer is the one its own <think> implies (the count, lookup or sum over its object
    list; the yes/no its two position cells give), else 0; 0 for colour and shape. Needs only the text and prompt."""
    return _think_reward(
        "shapes_think_follows",
        "think_follows_score",
        "count, existence, arithmetic and position answers against their own <think>; others 0",
        objects=False,
    )
