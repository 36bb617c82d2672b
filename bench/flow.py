"""Flow-pipeline benchmarks: BranchGRPO tree vs independent rollouts, MixGRPO window vs all-step training.

Run: python bench/flow.py [--quick]; writes bench/sections/flow.md (a section of results.md) and bench/plots/flow_*.png.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import (REPO, fmt_ratio, machine, matmul_gflops, md_table, measure_pair, now_utc,  # noqa: E402
                          pyplot, save_plot, summarise, write_section)

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star", "two purple circles",
           "an orange square above a cyan circle", "three small dots", "a large white triangle"]
TARGETS = {"tree": 3.0, "window": 2.0}  # issue 9: tree >= 3x faster per iteration; window >= 2x gain per second


# ---- the model, the runs and one training iteration


def bench_model(width: int, layers: int) -> str:
    """A tiny random SD3 pipeline whose transformer is `width` wide and `layers` deep (cached); returns its path.

    The text encoders, VAE and tokenizers are those of `tiny:sd3`; only the transformer is bigger, so that it, not
    Python overhead, dominates each iteration.
    """
    from diffusers import SD3Transformer2DModel

    from pipelines.flow.build import load_pipeline

    root = Path(os.environ.get("MMGRPO_CACHE", Path.home() / ".cache" / "mmgrpo"))
    path = root / f"bench-sd3-w{width}-l{layers}"
    if (path / "model_index.json").is_file():
        return str(path)
    pipe = load_pipeline("tiny:sd3", torch.float32)
    torch.manual_seed(0)
    heads = 4
    transformer = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=layers,
                                        attention_head_dim=width // heads, num_attention_heads=heads,
                                        caption_projection_dim=width, joint_attention_dim=32,
                                        pooled_projection_dim=64, out_channels=4, pos_embed_max_size=64)
    pipe.register_modules(transformer=transformer)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    pipe.save_pretrained(str(tmp))
    try:
        os.rename(tmp, path)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def shapes_model() -> str | None:
    """assets/shapes-t2i when it is a diffusers pipeline directory the flow pipeline can load, else None."""
    p = REPO / "assets" / "shapes-t2i"
    return str(p) if (p / "model_index.json").is_file() else None


def make_run(out_dir: Path, model: str, *, plan: str, plan_kwargs: dict, setting: dict, seed: int):
    """A `mmgrpo.setup.Run` of the flow pipeline (no progress bar, report or checkpoints): one arm of a benchmark."""
    from mmgrpo.config import load_config
    from mmgrpo.setup import setup

    tree = {
        "run": {"output_dir": str(out_dir), "seed": seed, "steps": 10_000, "checkpoint_every": 0, "resume": "never",
                "progress": False, "report": False, "log_every": 10_000},
        "pipeline": {"name": "flow", "kwargs": {
            "model": model, "prompts": setting["prompts"], "resolution": 32, "num_steps": setting["steps"],
            "max_sequence_length": 16, "sde": "flow_grpo", "noise_level": 0.7, "guidance_scale": 1.0,
            "plan": plan, "plan_kwargs": plan_kwargs, "lora_rank": setting["lora_rank"], "k_chunk": None}},
        "sample": {"batch_size": setting["group"] * setting["prompts_per_iter"], "group_size": setting["group"]},
        "algo": {"advantage": "grpo", "loss": "clipped", "loss_kwargs": {"clip_low": 0.2, "clip_high": 0.2},
                 "micro_batch_size": setting["group"]},
        "optim": {"lr": setting["lr"], "grad_clip": 1.0},
        "rewards": [{"name": setting["reward"], "weight": 1.0}],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return setup(load_config(out_dir / "bench.yaml"))


class Counter:
    """Rows (latents) through the transformer, split into no-grad (rollout, reference) and grad (training) calls."""

    def __init__(self, module: torch.nn.Module):
        self.rollout = self.train = 0
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_grad_enabled():
            self.train += int(x.shape[0])
        else:
            self.rollout += int(x.shape[0])

    def take(self) -> tuple[int, int]:
        out, self.rollout, self.train = (self.rollout, self.train), 0, 0
        return out


class Arm:
    """One side of a comparison: its Run, its iteration counter and its evaluation-row counter."""

    def __init__(self, name: str, run: Any):
        self.name, self.run, self.step = name, run, 0
        self.counter = Counter(run.policy.transformer)
        self.train_rewards: list[float] = []

    def iterate(self) -> dict[str, float]:
        """One training iteration exactly as `mmgrpo.trainer.train` runs it (minus logging and checkpoints)."""
        from mmgrpo.collect import collect
        from mmgrpo.trainer import compute_advantages, update

        run = self.run
        self.counter.take()  # drop rows counted by evaluations since the last iteration
        t0 = time.perf_counter()
        run.policy.set_iteration(self.step)
        batch = collect(run, self.step)
        t1 = time.perf_counter()
        adv, use, _ = compute_advantages(run, batch, progress=0.0)
        update(run, batch, adv, use, self.step)
        run.scheduler.step()
        t2 = time.perf_counter()
        self.step += 1
        self.train_rewards.append(float(batch.total.mean()))
        rows = self.counter.take()
        return {"reward": self.train_rewards[-1], "rollout_s": t1 - t0, "update_s": t2 - t1,
                "rollout_rows": rows[0], "train_rows": rows[1], "trained": int(batch.rollout.mask.sum())}


@torch.no_grad()
def eval_reward(run: Any, *, prompts: list[str], per_prompt: int, seed: int = 1234) -> float:
    """Mean reward of deterministic (ODE) samples from fixed noises: the same sampler for every arm and every time."""
    from pipelines.flow import plan as plans
    from pipelines.flow import sde

    pol = run.policy
    cond = pol.model.encode(prompts)
    t = pol.num_steps
    plan = plans.RolloutPlan(("ode",) * t, roots=per_prompt)
    seeds = [seed + i for i in range(len(prompts))]

    def velocity(x, sigma, prompt):
        return pol.model.velocity(pol.transformer, x, sigma, {k: v[prompt] for k, v in cond.items()})

    res = plans.execute(plan, seeds=seeds, shape=pol.model.latent_shape(), sigmas=pol.sigmas,
                        trained=torch.zeros(len(prompts) * per_prompt, t, dtype=torch.bool), velocity=velocity,
                        step=lambda kind, x, v, s, s1, **kw: sde.step(kind, x, v, s, s1, **kw),
                        noise_level=0.0, device=pol.model.device, dtype=pol.model.dtype)
    samples = pol.model.decode(res.final)
    texts = [p for p in prompts for _ in range(per_prompt)]
    _, total = run.reward_set(samples, texts, group_size=per_prompt)
    return float(total.float().mean())


def forward_flops(run: Any) -> float:
    """FLOPs of one transformer evaluation (one latent) at the benchmark's resolution and prompt length."""
    from torch.utils.flop_counter import FlopCounterMode

    pol = run.policy
    cond = pol.model.encode([PROMPTS[0]])
    x = torch.zeros(1, *pol.model.latent_shape())
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        pol.model.velocity(pol.transformer, x, torch.tensor([0.5]), cond)
    return float(fc.get_total_flops())


def register_brightness() -> str:
    """A bench-only reward, mean pixel brightness in [0, 1]: cheap and quick to move on a random tiny model."""
    from rewards.api import REWARDS, FunctionReward

    name = "bench_brightness"
    if name not in REWARDS.names():
        REWARDS.register(name, input="image", range="[0, 1]", paper="bench-only")(
            lambda: FunctionReward(lambda samples, prompts: [float(s.float().mean()) for s in samples], name=name,
                                   input="image", preprocess="mean of float [3, H, W] pixels in [0, 1]"))
    return name


def quiet() -> None:
    """Silence diffusers/transformers progress bars and prompt-truncation notices in the bench output."""
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0


def median(xs: list[float]) -> float:
    return summarise(xs)["median"]


# ---- (a) tree vs independent rollouts at equal leaves and steps


def bench_tree(model: str, setting: dict, tmp: Path, *, repeats: int, evaluate) -> dict:
    """Alternate training iterations of independent groups and BranchGRPO trees (plain, and with depth pruning)."""
    plans_ = {"independent": ("independent", {"train": "all"}),
              "tree": ("tree", {"fanout": 2}),
              "tree, depth-pruned": ("tree", {"fanout": 2, "prune_depths": setting["prune_depths"]})}
    arms = {n: Arm(n, make_run(tmp / f"a_{i}", model, plan=p, plan_kwargs=k, setting=setting, seed=0))
            for i, (n, (p, k)) in enumerate(plans_.items())}
    ind = arms["independent"]
    ev = {n: [evaluate(a.run)] for n, a in arms.items()}
    out = {"arms": arms, "pairs": {}, "gain_per_iter": {}}
    for n in ("tree", "tree, depth-pruned"):
        e0, s0 = evaluate(ind.run), ind.step
        pair = measure_pair(ind.iterate, arms[n].iterate, repeats=repeats, warmup=1, ratio="a/b")
        out["pairs"][n] = pair
        iters = ind.step - s0
        out["gain_per_iter"][(n, "independent")] = (evaluate(ind.run) - e0) / iters
        out["gain_per_iter"][(n, n)] = (evaluate(arms[n].run) - ev[n][0]) / iters
    out["plan"] = {n: a.run.policy.last_plan for n, a in arms.items()}
    return out


# ---- (b) window (MixGRPO) and few-step (Flow-GRPO-Fast) vs all-step training on a fixed wall-clock budget


def bench_window(model: str, setting: dict, tmp: Path, *, budget: float, seeds: list[int], evaluate) -> dict:
    """Per seed, run the arms interleaved (always the one with the least time spent) until each used `budget`
    seconds of training; evaluate at a few points; the gain per second is the slope of reward on training time."""
    plans_ = {"all steps": ("independent", {"train": "all"}),
              "window (MixGRPO)": ("independent", {"train": "window", "window_size": setting["window"],
                                                   "window_every": setting["window_every"]}),
              "fast (Flow-GRPO-Fast)": ("fast", {"sde_steps": 2})}
    runs = []
    for seed in seeds:
        arms = {n: Arm(n, make_run(tmp / f"b{seed}_{i}", model, plan=p, plan_kwargs=k, setting=setting, seed=seed))
                for i, (n, (p, k)) in enumerate(plans_.items())}
        curves = {n: [(0.0, evaluate(a.run))] for n, a in arms.items()}
        spent = {n: 0.0 for n in arms}
        iter_s: dict[str, list[float]] = {n: [] for n in arms}
        marks = {n: budget / 4 for n in arms}
        while min(spent.values()) < budget:
            n = min(spent, key=spent.get)
            t0 = time.perf_counter()
            arms[n].iterate()
            dt = time.perf_counter() - t0
            spent[n] += dt
            iter_s[n].append(dt)
            if spent[n] >= marks[n]:
                curves[n].append((spent[n], evaluate(arms[n].run)))
                marks[n] += budget / 4
        runs.append({"curves": curves, "iter_s": iter_s, "slopes": {n: slope(c) for n, c in curves.items()}})
    return {"runs": runs, "arms": list(plans_)}
