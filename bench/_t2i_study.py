"""Does ShapesWorld text-to-image learning keep rising? Held-out verifier accuracy at 0, 1x, 2x, 4x the demo budget.

Each arm is `configs/flow/shapes_t2i.yaml` plus dotted overrides (ARMS below). Per arm and seed it trains with
`mmgrpo train` (a subprocess: one thread, niced) to max(--mults) x --budget steps with a checkpoint at every
multiple, then scores every checkpoint (and the base model) as `pipelines.flow.compare` does: ODE sampling, the 20
held-out test prompts x 16 seeds, strict and partial credit per category. A recipe whose learning rate decays over
run.steps (cosine) cannot be read off one run's checkpoints, so such an arm trains one run per multiple.

Besides accuracy it records the monitors that tell why a run fades: the same scores on the training prompts (2 seeds
each: memorising the 83 training prompts vs generalising), objects detected per image and the pixel diversity of
one prompt's images (reward hacking by drawing extra shapes, mode collapse), the LoRA weights' norm (drift), and from
metrics.jsonl the training reward, the ratio's std and the clip fractions over the steps before each checkpoint.

Run:  python bench/_t2i_study.py [--arms recipe kl_0.01 ...] [--seeds 0 1 2] [--mults 1 2 4] [--budget 72]
      python bench/_t2i_study.py --report        (tables from what is stored: docs/t2i_study.md)
Full study: every arm x 3 seeds x 4x the budget, 30 to 40 hours of one core here. Results accumulate in
bench/sections/t2i_study.jsonl (one line per arm, seed and multiple), so a study can be run in parts; an
(arm, seed, multiple) already stored is skipped. Not part of `make bench` (run_all skips names starting with "_").
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._t2i_study_report import write_report
from mmgrpo import checkpoint
from mmgrpo.config import load_config
from mmgrpo.runtime import prompt_seed
from mmgrpo.setup import build_task
from mmgrpo_shapes.verifier import verify
from pipelines.flow.build import shapes_prompts
from pipelines.flow.compare import EVAL_OVERRIDES

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "flow" / "shapes_t2i.yaml"
STORE = REPO / "bench" / "sections" / "t2i_study.jsonl"
DOC = REPO / "docs" / "t2i_study.md"
TRAIN_SPLIT = "shapes:train:single_object,two_objects,counting,colors,color_attr"

STRICT = (
    "[{name: shapes_geneval, label: partial, weight: 0.0, kwargs: {mode: partial}}, "
    "{name: shapes_geneval, label: strict, weight: 1.0, kwargs: {mode: strict}}]"
)
"""Strict verifier credit as the reward (partial still logged): extra shapes earn nothing."""
PENALTY = (
    "[{{name: shapes_geneval, label: partial, weight: 1.0, kwargs: {{mode: partial, extra_penalty: {p}}}}}, "
    "{{name: shapes_geneval, label: strict, weight: 0.0, kwargs: {{mode: strict}}}}]"
)
"""Partial credit minus `p` per unrequested object (the verifier's `extra_penalty`): drawing extra shapes costs."""

ARMS: dict[str, list[str]] = {
    "recipe": [],
    "const_lr1e-3": ["optim.schedule=constant", "optim.lr=1e-3"],
    "const_kl_0.04": ["optim.schedule=constant", "pipeline.kwargs.reference=true", "algo.kl_coef=0.04"],
    "const_kl_0.4": ["optim.schedule=constant", "pipeline.kwargs.reference=true", "algo.kl_coef=0.4"],
    "kl_0.01": ["pipeline.kwargs.reference=true", "algo.kl_coef=0.01"],
    "kl_0.1": ["pipeline.kwargs.reference=true", "algo.kl_coef=0.1"],
    "kl_1": ["pipeline.kwargs.reference=true", "algo.kl_coef=1.0"],
    "grpo_guard": [
        "algo.loss=guard_clipped",
        "pipeline.kwargs.ratio_norm=true",
        "pipeline.kwargs.step_weights=guard",
        "algo.num_minibatches=2",
    ],
    "diffusionnft": [
        "pipeline.kwargs.objective=nft",
        "algo.loss=nft",
        "pipeline.kwargs.plan=independent",
        "pipeline.kwargs.plan_kwargs={}",
        "algo.loss_kwargs={beta: 1.0, weighting: adaptive, adv_clip_max: 5.0}",
    ],
    "tree_pruned": [
        "pipeline.kwargs.plan=tree",
        "pipeline.kwargs.plan_kwargs={split_steps: [0, 1, 2], prune_depths: [0], width_prune: extremes}",
    ],
    "pref_winrate": [
        (
            "rewards=[{name: pairwise, label: winrate, weight: 1.0, kwargs: {base: shapes_geneval, "
            "base_kwargs: {mode: partial}}}, {name: shapes_geneval, label: strict, weight: 0.0, "
            "kwargs: {mode: strict}}]"
        )
    ],
    "group_16": ["sample.group_size=16", "sample.batch_size=128"],
    "sde_steps_2": ["pipeline.kwargs.plan_kwargs={sde_steps: 2, branch_range: [0, 2]}"],
    "strict_reward": ["rewards=" + STRICT],
    "const_strict": ["optim.schedule=constant", "rewards=" + STRICT],
    "vgpo": [
        "pipeline.kwargs.plan=tree",
        ("pipeline.kwargs.plan_kwargs={roots: 2, split_steps: [0, 2], fanout: 2, prune_depths: [2]}"),
        "pipeline.kwargs.value_anchor={anchor: 0.67, scale: 0.1}",
        "algo.advantage=vgpo",
        "algo.advantage_kwargs={anchor: 0.67, scale: 0.1}",
    ],
    "sage": [
        "pipeline.kwargs.sde=sage",
        "pipeline.kwargs.reference=true",
        "pipeline.kwargs.anchor_every=24",
        "pipeline.kwargs.trust_step=1.0",
        "algo.kl_coef=0.04",
        "pipeline.kwargs.step_weights=grad_equalizer",
        "algo.loss=weighted_clipped",
    ],
    "const_vgpo": ["optim.schedule=constant"],
    "const_sage": ["optim.schedule=constant"],
    "ema_0.9": ["optim.ema_decay=0.9"],
    "penalty_ema": ["optim.ema_decay=0.9", "rewards=" + PENALTY.format(p=0.15)],
    "penalty_0.15": ["rewards=" + PENALTY.format(p=0.15)],
    "const_penalty_0.15": ["optim.schedule=constant", "rewards=" + PENALTY.format(p=0.15)],
}
"""Arms: dotted overrides on the shipped recipe. Names are the study's rows; add an arm by adding a line."""
ARMS["nft_const"] = ["optim.schedule=constant", *ARMS["diffusionnft"]]  # NFT without the cosine's early stop
ARMS["nft_lr2e-3"] = [*ARMS["diffusionnft"], "optim.lr=2e-3"]  # NFT's bounded loss may take the rate GRPO cannot
ARMS["nft_penalty_0.05"] = [*ARMS["diffusionnft"], "rewards=" + PENALTY.format(p=0.05)]  # extra shapes cost
ARMS["nft_const_penalty_0.05"] = ["optim.schedule=constant", *ARMS["nft_penalty_0.05"]]  # does the fade go too?
ARMS["nft_const_penalty_mb2"] = [*ARMS["nft_const_penalty_0.05"], "algo.num_minibatches=2"]  # 2 steps per rollout
ARMS["nft_const_penalty_mb4"] = [*ARMS["nft_const_penalty_0.05"], "algo.num_minibatches=4"]  # for free: beta holds
ARMS["nft_const_penalty_mb2_k4"] = [*ARMS["nft_const_penalty_mb2"], "pipeline.kwargs.nft_steps=4"]  # 2x the points
ARMS["nft_strict"] = [*ARMS["diffusionnft"], "rewards=" + STRICT]  # NFT on the reward that extra shapes cannot game
ARMS["const_vgpo"] += ARMS["vgpo"]  # the fading test: VGPO and SAGE at the constant rate whose gain fades
ARMS["const_sage"] += ARMS["sage"]


def load(overrides: list[str]):
    return load_config(RECIPE, overrides)


def horizon_bound(cfg) -> bool:
    """True when the lr schedule depends on run.steps (so 2x the budget is a different run, not a later checkpoint)."""
    return cfg.optim.schedule != "constant"


def train(run_dir: Path, overrides: list[str], steps: int, every: int, log: Path) -> float:
    """`mmgrpo train` in a niced one-thread subprocess; returns its wall seconds (raises if it failed)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(REPO),
    )
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "mmgrpo.cli",
        "train",
        str(RECIPE),
        *overrides,
        f"run.output_dir={run_dir}",
        f"run.steps={steps}",
        f"run.checkpoint_every={every}",
        "run.keep_last=100",
        "run.resume=auto",
        "run.progress=false",
        "run.report=false",
        "run.gallery_every=0",
    ]
    t0 = time.perf_counter()
    with log.open("a") as fh:
        done = subprocess.run(cmd, check=False, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}; see {log}")
    return time.perf_counter() - t0


@torch.no_grad()
def score(cfg, ckpt: Path | None, data: str, group_size: int) -> dict:
    """Per category: strict, partial, objects per image, and within-prompt pixel diversity (mean pairwise RMS)."""
    task = build_task(cfg, torch.device("cpu"))
    task.policy.for_evaluation()
    if ckpt is not None:
        saved = checkpoint.load(ckpt, 0)
        task.policy.load_state_dict(saved["weights"])
        if cfg.optim.ema_decay > 0:  # an EMA arm is scored on its EMA weights, as `mmgrpo eval ema=true` does
            task.module.load_state_dict(saved["ema"], strict=False)
    records = shapes_prompts(data)
    rows: dict[str, dict[str, list[float]]] = {}
    for lo in range(0, len(records), 16):
        chunk = records[lo : lo + 16]
        ro = task.policy.rollout(
            chunk,
            group_size,
            [
                prompt_seed(cfg.run.seed, -1, 0, i)  # as mmgrpo.evaluate
                for i in range(len(chunk))
            ],
        )
        images = torch.stack(list(ro.samples)).float()  # [n*G, 3, H, W] in [0, 1]
        for i, rec in enumerate(chunk):
            group = images[i * group_size : (i + 1) * group_size]  # [G, 3, H, W]
            flat = group.flatten(1)  # [G, 3HW]
            dist = torch.cdist(flat, flat) / flat.shape[1] ** 0.5  # [G, G] RMS pixel distance
            div = float(dist.sum() / (group_size * (group_size - 1)))
            res = [verify(img, rec["prompt"]) for img in group]  # as the shapes_geneval reward
            for cat in ("all", rec["category"]):
                r = rows.setdefault(cat, {"strict": [], "partial": [], "objects": [], "diversity": []})
                r["strict"] += [float(x["strict"]) for x in res]
                r["partial"] += [x["partial"] for x in res]
                r["objects"] += [float(len(x["objects"])) for x in res]
                r["diversity"].append(div)
    return {c: {k: sum(v) / len(v) for k, v in r.items()} | {"n": len(r["strict"])} for c, r in rows.items()}


def lora_norm(ckpt: Path | None) -> float:
    """Frobenius norm of the product B A summed over LoRA layers (0 for the base model)."""
    if ckpt is None:
        return 0.0

    w = checkpoint.load(ckpt, 0)["weights"]
    total = 0.0
    for name, a in w.items():
        if "lora_A" in name and not name.startswith("anchor."):  # SAGE's moving anchor is saved beside the adapter
            b = w[name.replace("lora_A", "lora_B")]
            total += float((b.float() @ a.float()).pow(2).sum())
    return total**0.5


def monitors(metrics: Path, lo: int, hi: int) -> dict:
    """Means of training-reward and ratio monitors over logged steps lo <= step < hi."""
    keys = {
        "train_partial": "reward/partial/mean",
        "train_strict": "reward/strict/mean",
        "ratio_std": "ratio/std",
        "clip_frac": "clip/upper_frac",
        "clip_lower": "clip/lower_frac",
        "kl": "kl/ref",
        "zero_std": "adv/zero_std_frac",
        "step_s": "time/step",
    }
    sums = {k: [] for k in keys}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if lo <= row.get("step", -1) < hi:
            for k, m in keys.items():
                if m in row:
                    sums[k].append(float(row[m]))
    return {k: sum(v) / len(v) for k, v in sums.items() if v}


def stored() -> list[dict]:
    return [json.loads(ln) for ln in STORE.read_text().splitlines() if ln.strip()] if STORE.is_file() else []


def record(row: dict) -> None:
    STORE.parent.mkdir(parents=True, exist_ok=True)
    with STORE.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def evaluate_point(
    arm: str,
    seed: int,
    mult: int,
    budget: int,
    ckpt: Path | None,
    overrides: list[str],
    metrics: Path | None,
    train_s: float,
    test_only: bool,
) -> None:
    cfg = load([*overrides, f"run.seed={seed}", *EVAL_OVERRIDES])
    t0 = time.perf_counter()
    row = {
        "arm": arm,
        "seed": seed,
        "mult": mult,
        "steps": mult * budget,
        "budget": budget,
        "overrides": overrides,
        "test": score(cfg, ckpt, cfg.pipeline.kwargs["eval_data"], 16),
        "lora_norm": lora_norm(ckpt),
        "train_s": round(train_s, 1),
    }
    if not test_only:
        row["train"] = score(cfg, ckpt, TRAIN_SPLIT, 2)
    if metrics is not None and metrics.is_file():
        row["monitors"] = monitors(metrics, max(0, mult * budget - budget // 4), mult * budget)
    row["eval_s"] = round(time.perf_counter() - t0, 1)
    record(row)
    t = row["test"]["all"]
    print(
        f"{arm} seed {seed} x{mult} ({mult * budget} steps): strict {t['strict']:.3f} partial {t['partial']:.3f} "
        f"objects {t['objects']:.2f} diversity {t['diversity']:.3f} lora {row['lora_norm']:.2f}",
        flush=True,
    )


def run_arm(arm: str, seed: int, mults: list[int], budget: int, out: Path, test_only: bool) -> None:
    overrides = [*ARMS[arm], f"run.seed={seed}"]
    done = {(r["arm"], r["seed"], r["mult"]) for r in stored()}
    if (arm, seed, 0) not in done:
        evaluate_point(arm, seed, 0, budget, None, overrides, None, 0.0, test_only)
    todo = [m for m in mults if m > 0 and (arm, seed, m) not in done]
    if not todo:
        return
    log = out / f"{arm}_s{seed}.log"
    if horizon_bound(load(overrides)):  # one run per multiple: the schedule spans run.steps
        for m in todo:
            run_dir = out / f"{arm}_s{seed}_x{m}"
            secs = train(run_dir, overrides, m * budget, m * budget, log)
            ckpt = run_dir / "checkpoints" / f"step_{m * budget:08d}"
            evaluate_point(arm, seed, m, budget, ckpt, overrides, run_dir / "metrics.jsonl", secs, test_only)
        return
    run_dir = out / f"{arm}_s{seed}"
    secs = train(run_dir, overrides, max(todo) * budget, budget, log)
    for m in todo:
        ckpt = run_dir / "checkpoints" / f"step_{m * budget:08d}"
        evaluate_point(
            arm, seed, m, budget, ckpt, overrides, run_dir / "metrics.jsonl", secs * m / max(todo), test_only
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--mults", type=int, nargs="+", default=[1, 2, 4], help="multiples of the budget to score")
    ap.add_argument("--budget", type=int, default=None, help="steps of 1x (default: the recipe's run.steps)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "t2i_study", help="run directories and logs")
    ap.add_argument("--test-only", action="store_true", help="skip the training-prompt scores (faster)")
    ap.add_argument("--report", action="store_true", help="only write docs/t2i_study.md from the stored results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not args.report:
        budget = args.budget or load([]).run.steps
        args.out.mkdir(parents=True, exist_ok=True)
        for arm in args.arms:
            for seed in args.seeds:
                run_arm(arm, seed, sorted(args.mults), budget, args.out, args.test_only)

    print(f"wrote {write_report(stored(), DOC)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
