"""The flow bench's pieces (bench/flow.py runs them): the arms and their targets, one arm's Run and training iteration,
the model-call counter and timer, the fixed-noise evaluator, and the small formulas of the report (distinct tree
transitions, gains, changes).

Not a bench script itself: run_all skips names starting with "_".
"""

import copy
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from bench.common import fit_slope, summarise, training_iteration
from mmgrpo.collect import reward_fields
from mmgrpo.config import load_config
from mmgrpo.setup import setup

TARGETS = {"tree": 3.0, "window": 2.0, "nft": 5.0}
"""issue 9: tree >= 3x faster per iteration, window >= 2x gain per second; issue 15: DiffusionNFT >= 5x gain per second
(the paper reports up to 25x over Flow-GRPO on SD3.5-M)"""
BASE = "all steps"
TREE_ARMS = {
    "independent": ("independent", {"train": "all"}),
    "tree": ("tree", {"fanout": 2}),
    "tree, pruned": ("tree", {"fanout": 2, "prune_depths": [3], "width_prune": "branch_best", "width_keep": 1}),
    "tree, late splits": ("tree", {"fanout": 2, "split_steps": [4, 5, 6]}),
}
# (plan, plan_kwargs, other pipeline kwargs[, algo overrides]); None: the recipe's own plan. The window arm shares a group's initial
# noise as MixGRPO's recipe does (configs/flow/sd35m_mixgrpo.yaml, MixGRPO's --init_same_noise): the ODE steps before
# the window then run once per prompt (pipelines.flow.plan.independent), an exact saving for that distribution
WINDOW_ARMS = {
    BASE: ("independent", {"train": "all"}, None),
    "window (MixGRPO)": (
        "independent",
        {"train": "window", "window_size": 2, "window_every": 4},
        {"same_noise_per_group": True},
    ),
    "fast (Flow-GRPO-Fast, the recipe)": None,
}
NFT = "DiffusionNFT"
# DiffusionNFT as configs/flow/sd35m_diffusionnft.yaml runs it, on the recipe's model, prompts, rate and guidance:
# independent SDE rollouts keep only x0; 2 noise levels per sample trained by the forward-process loss, no likelihood
NFT_ARM = (
    "independent",
    {"train": "all"},
    {"objective": "nft", "nft_steps": 2},
    {"loss": "nft", "loss_kwargs": {"beta": 1.0, "weighting": "adaptive", "adv_clip_max": 5.0}},
)
WINDOW_ARMS[NFT] = NFT_ARM  # raced beside the others in part (b): gain per training second against all steps


def val_spec(tree: dict) -> str:
    """The recipe's eval categories on ShapesWorld's validation split (the recipe's own eval uses the test split)."""
    parts = tree["pipeline"]["kwargs"]["eval_data"].split(":")
    return ":".join(["shapes", "val", *parts[2:]])


def make_run(
    out_dir: Path,
    base: dict,
    *,
    plan: str | None,
    plan_kwargs: dict | None,
    setting: dict,
    seed: int,
    pipeline_kwargs: dict | None = None,
    algo: dict | None = None,
):
    """A `mmgrpo.setup.Run` of the recipe `base` (no progress bar, report or checkpoints): one arm of a benchmark.

    Changed from the recipe: the plan (None keeps the recipe's), prompts per iteration, k_chunk (the same in every
    arm, so no arm pays for a bigger backward than another), run.seed and any `pipeline_kwargs` (e.g. same-noise
    groups for the MixGRPO arm, as MixGRPO's recipe has them)."""
    tree = copy.deepcopy(base)
    tree["run"].update(
        {
            "output_dir": str(out_dir),
            "seed": seed,
            "checkpoint_every": 0,
            "gallery_every": 0,
            "resume": "never",
            "progress": False,
            "report": False,
            "log_every": 10**6,
        }
    )
    kw = tree["pipeline"]["kwargs"]
    if plan is not None:
        kw.update({"plan": plan, "plan_kwargs": plan_kwargs})
    kw.update(pipeline_kwargs or {})
    tree["algo"].update(algo or {})  # e.g. DiffusionNFT's loss
    kw["k_chunk"] = setting["k_chunk"]
    tree["sample"]["batch_size"] = setting["prompts_per_iter"] * tree["sample"]["group_size"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return setup(load_config(out_dir / "bench.yaml"))


class Counter:
    """Rows (latents) through the transformer and seconds inside its forward, split into no-grad (rollout) and grad
    (training) calls; CFG's two passes count as two rows. CPU only: on CUDA the forward seconds would need a sync."""

    def __init__(self, module: torch.nn.Module):
        self.rows = {"rollout": 0, "train": 0}
        self.secs = {"rollout": 0.0, "train": 0.0}
        self._t0 = 0.0
        module.register_forward_pre_hook(self._pre, with_kwargs=True)
        module.register_forward_hook(self._post)

    def _pre(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        self.rows["train" if torch.is_grad_enabled() else "rollout"] += int(x.shape[0])
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        self.secs["train" if torch.is_grad_enabled() else "rollout"] += time.perf_counter() - self._t0

    def take(self) -> dict[str, float]:
        """rollout_rows, train_rows, rollout_fwd_s, train_fwd_s since the last take; resets them."""
        out = {
            "rollout_rows": self.rows["rollout"],
            "train_rows": self.rows["train"],
            "rollout_fwd_s": self.secs["rollout"],
            "train_fwd_s": self.secs["train"],
        }
        self.rows = {"rollout": 0, "train": 0}
        self.secs = {"rollout": 0.0, "train": 0.0}
        return out


class Arm:
    """One side of a comparison: its Run, iteration count, training seconds spent and evaluation curve."""

    def __init__(self, name: str, run: Any):
        self.name, self.run, self.step, self.spent = name, run, 0, 0.0
        self.counter = Counter(run.policy.transformer)
        self.curve: list[tuple[float, int, dict[str, float]]] = []  # (seconds spent, iterations, accuracies)
        self.plan = None

    def iterate(self) -> dict[str, float]:
        """One training iteration exactly as `mmgrpo.trainer.train` runs it (minus logging and checkpoints)."""
        self.counter.take()  # drop what evaluations counted since the last iteration
        batch, roll_s, upd_s = training_iteration(self.run, self.step)
        self.step += 1
        self.spent += roll_s + upd_s
        self.plan = self.run.policy.last_plan
        return {
            "seconds": roll_s + upd_s,
            "rollout_s": roll_s,
            "update_s": upd_s,
            "reward_s": batch.seconds.get("reward", 0.0),
            "trained": int(batch.rollout.mask.sum()),
            **self.counter.take(),
        }

    def evaluate(self, evaluator: "Evaluator") -> dict[str, float]:
        acc = evaluator(self.run)
        self.curve.append((self.spent, self.step, acc))
        return acc


class Evaluator:
    """Strict and partial verifier accuracy of ODE samples (noise 0, independent noises, as pipelines.flow.compare)
    on fixed validation prompts with fixed per-prompt seeds: the same images for every arm at every time."""

    def __init__(self, records: list[dict], per_prompt: int, seed: int = 1234, chunk: int = 4):
        self.records, self.per_prompt, self.chunk = records, per_prompt, chunk
        self.seeds = [seed + i for i in range(len(records))]
        self.seconds: list[float] = []

    @torch.no_grad()
    def __call__(self, run: Any) -> dict[str, float]:
        t0, pol = time.perf_counter(), run.policy
        saved = (pol.noise_level, pol.plan_name, pol.plan_kwargs, pol.same_noise, pol.iteration, pol.last_plan)
        # one fresh noise per image even for a same-noise arm (else a prompt's 8 ODE images would be one image)
        pol.noise_level, pol.plan_name, pol.plan_kwargs, pol.same_noise = 0.0, "independent", {"train": "all"}, False
        scores = []
        try:
            for lo in range(0, len(self.records), self.chunk):
                recs = self.records[lo : lo + self.chunk]
                ro = pol.rollout(recs, self.per_prompt, self.seeds[lo : lo + self.chunk])
                texts, fields = reward_fields(recs, self.per_prompt)
                per_reward, _ = run.reward_set(ro.samples, texts, group_size=self.per_prompt, **fields)
                scores.append(per_reward.double())  # [n_chunk, R]
        finally:
            (pol.noise_level, pol.plan_name, pol.plan_kwargs, pol.same_noise, pol.iteration, pol.last_plan) = saved
        self.seconds.append(time.perf_counter() - t0)
        scores = torch.cat(scores)  # [n, R]
        out: dict[str, Any] = {name: float(scores[:, r].mean()) for r, name in enumerate(run.reward_set.names)}
        out["per_image"] = {name: scores[:, r] for r, name in enumerate(run.reward_set.names)}
        return out


def interleave(arms: dict[str, Arm], budget: float, marks: int, evaluator: "Evaluator", tag: str) -> dict[str, list]:
    """Train the arm with the least training time next (so machine load hits all alike) until each spent `budget`
    seconds, scoring each at every `budget / marks` of its own time; returns each arm's per-iteration profile."""
    outs: dict[str, list[dict]] = {n: [] for n in arms}
    due = {n: budget / marks for n in arms}
    while min(a.spent for a in arms.values()) < budget:
        n = min(arms, key=lambda m: arms[m].spent)
        outs[n].append(arms[n].iterate())
        if arms[n].spent >= due[n]:
            arms[n].evaluate(evaluator)
            due[n] += budget / marks
            print(f"{tag} {n}: {arms[n].step} iterations, {arms[n].spent:.0f} s", flush=True)
    return outs


def forward_flops(run: Any) -> float:
    """FLOPs of one transformer evaluation (one latent, no CFG) at the recipe's resolution and prompt length."""
    pol = run.policy
    cond = pol.model.encode(["a red circle"])
    x = torch.zeros(1, *pol.model.latent_shape())
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        pol.model.forward(pol.transformer, x, torch.tensor([0.5]), cond)
    return float(fc.get_total_flops())


def median(xs: list[float]) -> float:
    return summarise(xs)["median"]


# ---- the report's formulas


def unique_transitions(plan, trained_steps: list[int], prompts: int) -> int:
    """Distinct (node, step) transitions a tree trains: shared prefixes counted once, as BranchGRPO's update would."""
    alive, total = prompts * plan.roots, 0
    for t in range(plan.num_steps):
        alive *= plan.branches.get(t, 1)
        total += alive if t in trained_steps else 0
    return total


def gain(curve: list, metric: str, per: str) -> float:
    """Accuracy gain per iteration (end minus start over iterations) or per training second (least-squares slope)."""
    if per == "iteration":
        return (curve[-1][2][metric] - curve[0][2][metric]) / max(1, curve[-1][1])
    return fit_slope([(s, acc[metric]) for s, _, acc in curve])


def delta(curve: list, metric: str) -> tuple[float, float]:
    """End minus start of a curve in points and the standard error of the mean paired per-image difference (same
    prompts and noises at both ends, so only the weights differ)."""
    d = 100 * (curve[-1][2]["per_image"][metric] - curve[0][2]["per_image"][metric])  # [n]
    return float(d.mean()), float(d.std(unbiased=True)) / len(d) ** 0.5 if len(d) > 1 else float("nan")


def change(curve: list, metric: str) -> str:
    return "{:+.1f} +- {:.1f}".format(*delta(curve, metric))


def ends(curve: list, metric: str) -> str:
    return f"{curve[0][2][metric]:.3f} -> {curve[-1][2][metric]:.3f} ({change(curve, metric)})"


def ratio_text(b: float, a: float, unit: float = 1.0) -> str:
    """B's gain over A's, or why there is no ratio (A's gain <= 0)."""
    if a <= 0:
        return f"n/a (A's gain {a * unit:+.4f} <= 0; B's {b * unit:+.4f})"
    return f"{b / a:.2f} ({b * unit:+.4f} vs {a * unit:+.4f})"


def max_z(curves: list) -> float:
    """The largest |change| / standard error over the curves' partial and strict accuracy."""
    z = lambda d, se: abs(d) / se if se > 0 else (0.0 if d == 0 else float("inf"))
    return max(z(*delta(c, m)) for c in curves for m in ("partial", "strict"))
