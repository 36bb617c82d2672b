"""The ShapesWorld GenEval-style verifier (pipelines/shapes/verifier.py) as the registered reward "shapes_geneval".

The verifier is imported inside the call, so `import rewards` works without the ShapesWorld pipeline.
"""

from rewards.api import REWARDS, FunctionReward, Reward


@REWARDS.register("shapes_geneval", input="image", range="[0, 1]", paper="GenEval-style (arXiv:2310.11513)")
def shapes_geneval(*, mode: str = "partial") -> Reward:
    """ShapesWorld verifier: fraction (partial) or all (strict) of the prompt's shapes/colours/counts present."""
    if mode not in ("partial", "strict"):
        raise ValueError(f"mode={mode!r} must be 'partial' or 'strict'")

    def batch(samples, prompts):
        try:
            from pipelines.shapes.verifier import score
        except ImportError as err:
            raise ValueError(f"shapes_geneval needs pipelines.shapes.verifier, which failed to import: {err}") from err
        return score(list(samples), list(prompts), mode=mode)

    return FunctionReward(
        batch,
        name="shapes_geneval",
        input="image",
        needs_prompts=True,
        preprocess=f"rendered-scene verifier ({mode}); images PIL/uint8/float CHW",
    )
