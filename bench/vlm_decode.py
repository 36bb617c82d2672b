"""VLM benchmark: one rollout (prefill once + decode) with the prompt cache shared by its G rows, and repeated G times.

Run: python bench/vlm_decode.py [--quick]; writes bench/sections/vlm_decode.md (and its summary row).
A = the static cache holding each prompt's K/V G times (decode.py's `_RepeatedCache`, what the loop did before),
B = `SharedPromptCache` (pipelines/vlm/shared_decode.py). Both sample the same seeds; the completions must be equal.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.common import (
    fmt_ratio,
    machine,
    md_table,
    measure_pair,
    now_utc,
    quiet_process,
    write_section,
    write_summary,
)
from pipelines.vlm import decode
from pipelines.vlm.build import build_vlm

ASSET = str(Path(__file__).resolve().parents[1] / "assets" / "shapes-vlm-parts")


def rollout(task, prompts: list, group: int, shared: bool) -> torch.Tensor:
    """One rollout of `prompts` x `group` with the shared or the repeated prompt cache; the completion ids [N, T]."""
    old = decode.supports_shared_decode
    decode.supports_shared_decode = (lambda lm: True) if shared else (lambda lm: False)
    try:
        r = task.policy.rollout(prompts, group, list(range(len(prompts))))  # the same seeds: the same work
    finally:
        decode.supports_shared_decode = old
    return r.extras["completion_ids"]


def measure(prompts: int, group: int, *, repeats: int) -> dict:
    """The shipped ShapesWorld VLM on train questions of all six types, 24 new tokens at temperature 1."""
    task = build_vlm(
        seed=0,
        device=torch.device("cpu"),
        model=ASSET,
        data="shapes_vqa",
        train_size=max(prompts, 8),
        eval_size=8,
        resolution=32,
        max_new_tokens=24,
    )
    task.policy.defer_old_logp = True  # the rollout alone: no scoring forward after it
    recs = task.train_data[:prompts]
    res = measure_pair(
        lambda: rollout(task, recs, group, False), lambda: rollout(task, recs, group, True), repeats=repeats, warmup=1
    )
    same = all(torch.equal(a, b) for a, b in zip(res["out_a"], res["out_b"]))
    width = max(task.policy.encode(r)["input_ids"].shape[1] for r in recs)
    res.update(same=same, prompt=width, new=int(res["out_b"][0].shape[1]))
    del res["out_a"], res["out_b"]
    return res


def section(rows: list[tuple[int, int, dict]], seconds: float, cmd: str) -> str:
    table = [
        [
            f"{p} x {g}",
            r["prompt"],
            r["new"],
            fmt_ratio(r),
            "yes" if r["same"] else "**no**",
            f"{sorted(r['times_a'])[len(r['times_a']) // 2]:.3f} / {sorted(r['times_b'])[len(r['times_b']) // 2]:.3f}",
        ]
        for p, g, r in rows
    ]
    return "\n".join(
        [
            "## VLM: decoding over a shared prompt cache vs the prompt repeated G times, one rollout",
            "",
            f"`{cmd}`, {now_utc()}, {seconds:.0f} s. Machine: {machine()}.",
            "",
            (
                "Setting: `assets/shapes-vlm-parts` (Qwen2-VL, text 4 layers x 128 wide, 16 image tokens) on "
                "ShapesWorld VQA train questions, one CPU thread, temperature 1, up to 24 new tokens, the prompts "
                "prefilled once either way. A = static cache with each prompt's K/V repeated G times (the loop "
                "before), B = `SharedPromptCache`, alternating after a warm-up pair; the same seeds, so both sample "
                "the same completions (checked)."
            ),
            "",
            md_table(
                [
                    "prompts x G",
                    "prompt tokens (padded)",
                    "tokens decoded",
                    "speed-up, repeated / shared",
                    "same completions",
                    "seconds, repeated / shared (medians)",
                ],
                table,
            ),
            "",
            (
                "Reading: every decode step read each prompt's keys and values G times from the repeated cache (and "
                "built a [N, W + T] mask); the shared cache reads them once per group, and the step's own keys are "
                "the only ones written. The prompt is most of each row here (16 image tokens and the chat template "
                "against about 20 new tokens), as in GRPO on VQA."
            ),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one setting, fewer repeats: a smoke run")
    args = ap.parse_args(argv)
    quiet_process()
    t0 = time.perf_counter()
    settings = [(16, 8)] if args.quick else [(16, 8), (4, 8), (8, 16)]
    rows = [(p, g, measure(p, g, repeats=2 if args.quick else 7)) for p, g in settings]
    cmd = f"python bench/vlm_decode.py{' --quick' if args.quick else ''}"
    write_section("vlm_decode", section(rows, time.perf_counter() - t0, cmd))
    write_summary(
        "vlm_decode",
        [
            (
                "vlm: rollout decoding over a shared prompt cache vs the prompt repeated G times (shapes-vlm-parts)",
                "; ".join(f"{p} x {g}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" for p, g, r in rows),
                "(the same completions)",
            )
        ],
    )
    print(f"wrote bench/sections/vlm_decode.md in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
