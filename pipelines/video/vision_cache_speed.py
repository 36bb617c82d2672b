"""Side-by-side measurement of the vision-feature cache (pipelines/vlm/vision_cache.py) on one video GRPO iteration:
rollout (prefill + decode), old log-probs, the update's forward + backward and the adapter-off reference, with
vision_cache=off and auto alternating in one process. Prints each mode's median (min, max) seconds, the ratio and the
tower calls per iteration; the cache is cleared before every iteration (only the within-iteration reuse counts) unless
--keep (the same prompts re-sampled: no tower call at all).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 python -m pipelines.video.vision_cache_speed --frames 8 --group 8
"""

import argparse
import gc
import statistics
import time

import torch


def _iteration(task, prompts: list, group: int, seed: int) -> int:
    """One iteration (rollout, update forward + backward, reference); returns the vision tower's forward calls."""
    pol, mod = task.policy, task.module
    calls = []
    handle = mod.vision_cache.lm.visual.register_forward_pre_hook(lambda m, args: calls.append(1))
    try:
        r = pol.rollout(prompts, group, [seed + i for i in range(len(prompts))])
        idx = torch.arange(len(r.samples))
        logp, _ = pol.logp(mod, r, idx)
        (logp * r.mask).sum().backward()
        mod.zero_grad(set_to_none=True)
        pol.ref_logp(r, idx)
    finally:
        handle.remove()
    return len(calls)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random-qwen2-vl")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=112, help="ShapesWorld video side (pixels)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix-sharing", default="auto", choices=("auto", "off"))
    ap.add_argument("--keep", action="store_true", help="keep entries across iterations (the same prompts re-sampled)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pipelines.video.build import build_video

    task = build_video(seed=0, device=torch.device("cpu"), model=args.model, train_size=args.prompts, eval_size=1,
                       num_frames=args.frames, shapes_resolution=args.resolution, lora_rank=8,
                       max_new_tokens=args.max_new_tokens, pixels_per_frame=args.resolution ** 2,
                       prefix_sharing=args.prefix_sharing)
    vc, prompts = task.module.vision_cache, task.train_data[: args.prompts]
    assert vc.why_off() == "", vc.why_off()
    enc = task.policy.encode(prompts[0])
    times: dict[str, list[float]] = {"off": [], "auto": []}
    calls: dict[str, int] = {}
    for rep in range(args.repeats + 1):  # the first round warms up and is dropped
        for mode in ("off", "auto") if rep % 2 == 0 else ("auto", "off"):
            vc.mode = mode
            if not args.keep:
                vc.clear()
            gc.collect()
            t0 = time.perf_counter()
            calls[mode] = _iteration(task, prompts, args.group, seed=0)  # the same work each time
            if rep:
                times[mode].append(time.perf_counter() - t0)
    print(f"video GRPO iteration, {args.model} + LoRA r8, {args.prompts} prompts x G={args.group}, "
          f"{args.frames} frames at {args.resolution}px ({tuple(enc['video_grid_thw'][0].tolist())} grid), "
          f"{args.max_new_tokens} new tokens, prefix_sharing={args.prefix_sharing}, "
          f"entries {'kept' if args.keep else 'cleared'} between iterations, {torch.get_num_threads()} thread(s), "
          f"{args.repeats} repeats")
    for mode, ts in times.items():
        print(f"  vision_cache={mode:4s}: median {statistics.median(ts):.3f} s (min {min(ts):.3f}, "
              f"max {max(ts):.3f}), tower calls {calls[mode]}")
    ratio = [a / b for a, b in zip(times["off"], times["auto"])]
    print("  per repeat (off, auto):", [(round(a, 3), round(b, 3)) for a, b in zip(times["off"], times["auto"])])
    print(f"  off / auto: median {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f})")


if __name__ == "__main__":
    main()
