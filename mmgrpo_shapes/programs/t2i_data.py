"""What the tiny ShapesWorld text-to-image model (pretrain_t2i) is shown: the pool of ground-truth train renders
it trains on, the category weights and curriculum of its batches, and its fixed evaluation prompt lists; no model.
"""

import functools

import numpy as np
import torch

from mmgrpo_shapes.scenes import CATEGORIES, SIZE_RANGE, ground_truth_scenes, list_prompts, split_of

BIG_SIZES = (0.17, 0.25)  # bigger than SIZE_RANGE: more pixels per shape; counting keeps SIZE_RANGE (4 must fit)
# sampling weight per category: the six categories hold 1..856 train prompts, so sampling by prompt would show
# the model almost only position scenes; single objects and colours are where it learns what a shape looks like
CATEGORY_WEIGHTS = {
    "single_object": 0.12,
    "two_objects": 0.1,
    "counting": 0.16,
    "colors": 0.22,
    "position": 0.2,
    "color_attr": 0.2,
}


def hflip_prompt(prompt: str) -> str:
    """The prompt of a horizontally mirrored scene ("left of" <-> "right of"; upward triangles stay upward)."""
    return prompt.replace("left of", "\0").replace("right of", "left of").replace("\0", "right of")


@functools.lru_cache(maxsize=8192)
def mirror_allowed(prompt: str) -> bool:
    """Whether a train scene may be mirrored: "A left of B" becomes "B left of A", which can be a val/test prompt."""
    return split_of(hflip_prompt(prompt)) == "train"


class ScenePool:
    """Ground-truth renders of train prompts by category, refreshed a few per step (rendering costs ~7 ms)."""

    def __init__(self, per_category: int, *, seed: int, resolution: int = 32, big_objects: bool = True):
        self.rng = np.random.default_rng(seed)
        self.resolution, self.big = resolution, big_objects
        self.prompts = {c: list_prompts("train", c) for c in CATEGORIES}
        self.images = {c: np.zeros((per_category, resolution, resolution, 3), np.uint8) for c in CATEGORIES}
        self.texts = {c: [""] * per_category for c in CATEGORIES}
        for c in CATEGORIES:
            for i in range(per_category):
                self._render(c, i)

    def _render(self, cat: str, i: int) -> None:
        prompt = self.prompts[cat][int(self.rng.integers(len(self.prompts[cat])))]
        sizes = BIG_SIZES if self.big and cat != "counting" else SIZE_RANGE
        seed = int(self.rng.integers(2**31))
        scene = ground_truth_scenes(prompt, 1, seed=seed, resolution=self.resolution, size_range=sizes)[0]
        self.images[cat][i], self.texts[cat][i] = scene.render(), prompt

    def refresh(self, n: int) -> None:
        for _ in range(n):
            cat = CATEGORIES[int(self.rng.integers(len(CATEGORIES)))]
            self._render(cat, int(self.rng.integers(len(self.texts[cat]))))

    def batch(self, size: int, weights: dict[str, float]) -> tuple[torch.Tensor, list[str]]:
        """A batch x0 [size, 3, H, W] in [-1, 1] with its prompts; half the scenes mirrored left-right when the
        mirrored prompt is a train prompt too."""
        p = np.array([weights.get(c, 0.0) for c in CATEGORIES], np.float64)
        cats = self.rng.choice(len(CATEGORIES), size=size, p=p / p.sum())
        imgs, texts = [], []
        for k in cats:
            c = CATEGORIES[k]
            i = int(self.rng.integers(len(self.texts[c])))
            img, text = self.images[c][i], self.texts[c][i]
            if mirror_allowed(text) and self.rng.random() < 0.5:
                img, text = img[:, ::-1], hflip_prompt(text)
            imgs.append(img)
            texts.append(text)
        x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [B, 3, H, W]
        return x, texts


def curriculum(progress: float, single_frac: float) -> dict[str, float]:
    """The category weights of a batch at `progress` (elapsed fraction of the budget, in [0, 1])."""
    # the first `single_frac` of the budget only shows one-object scenes, where shapes are learnt fastest
    if progress < single_frac:
        return {"single_object": 0.3, "colors": 0.7}
    return CATEGORY_WEIGHTS


def eval_prompts(split: str, n_per_prompt: int, max_prompts: int = 48) -> list[str]:
    """A fixed evaluation list: each category's prompts (evenly thinned to max_prompts), n_per_prompt times,
    with small categories repeated up to about max_prompts * n_per_prompt / 4 images."""
    out = []
    for cat in CATEGORIES:
        ps = list_prompts(split, cat)
        ps = [ps[i] for i in np.linspace(0, len(ps) - 1, min(len(ps), max_prompts)).astype(int)]
        reps = max(n_per_prompt, -(-max_prompts * n_per_prompt // (4 * len(ps))))
        out += [p for p in ps for _ in range(reps)]
    return out
