"""The flow bench's report (bench/flow.py writes it): the Setting paragraph, part (a)'s and part (b)'s tables and
notes, the figures and bounds the verdict reads, and the two plots. Moved out of flow.py.

Not a bench script itself: run_all skips names starting with "_".
"""

from bench._flow_arms import (
    BASE,
    NFT,
    TARGETS,
    Evaluator,
    change,
    ends,
    gain,
    median,
    ratio_text,
    unique_transitions,
)
from bench.common import fmt_ratio, md_table, pyplot, save_plot
from pipelines.flow.plan import count_nfe, depth_of_steps


def figures(outs: list[dict]) -> dict[str, float]:
    """Medians over an arm's counted iterations of every recorded quantity (seconds, rows, trained transitions)."""
    return {key: median([o[key] for o in outs]) for key in outs[0]}


def split(f: dict) -> str:
    """'rollout (its transformer forward) + update (its transformer forward)' seconds of a figures() dict."""
    return f"{f['rollout_s']:.2f} ({f['rollout_fwd_s']:.2f}) + {f['update_s']:.2f} ({f['train_fwd_s']:.2f})"


def setting_md(base: dict, setting: dict, n_params: dict, spec: str, evaluator: Evaluator) -> str:
    """The report's Setting paragraph: the recipe, what the bench changes in it, and how arms are evaluated."""
    kw, g = base["pipeline"]["kwargs"], base["sample"]["group_size"]
    return (
        f"Setting: every arm is `configs/flow/shapes_t2i.yaml` (the `make demo` recipe) with only the rollout plan "
        f"changed: the shipped ShapesWorld text-to-image model (assets/shapes-t2i, SD3 transformer in pixel space, "
        f"{n_params['transformer'] / 1e6:.2f} M parameters, LoRA r{kw['lora_rank']} = "
        f"{n_params['trainable'] / 1e6:.2f} M trained, AdamW lr {base['optim']['lr']} {base['optim']['schedule']} "
        f"over the recipe's {base['run']['steps']} steps), {kw['resolution']} px, {kw['num_steps']} denoising "
        f"steps, CFG {kw['guidance_scale']} in rollout and training, {kw['sde']} SDE (noise {kw['noise_level']}), "
        f"{g} samples per prompt, prompts from ShapesWorld's train split "
        f"({kw['data'].split(':')[2].replace(',', ', ')}), reward = shapes_geneval partial credit (strict logged), "
        f"GRPO advantages, clipped loss, one update per rollout, no KL. Changed from the recipe to fit the budget: "
        f"{setting['prompts_per_iter']} prompts per iteration (the recipe has {base['sample']['batch_size'] // g}), "
        f"k_chunk {setting['k_chunk']} in every arm (one trained step per backward: with k_chunk null the all-step "
        f"arm's 8-step backward ran about 2x slower per transition on this CPU, which would flatter the others), "
        f"seed {setting['seed']}. Evaluation: {len(evaluator.records)} prompts of `{spec}` (never trained on) x "
        f"{evaluator.per_prompt} fixed seeds = {len(evaluator.records) * evaluator.per_prompt} images, ODE sampling, "
        f"strict and partial verifier accuracy (about {median(evaluator.seconds):.0f} s per evaluation, excluded from "
        f"every timing)."
    )


# ---- (a) tree vs independent rollouts


def arm_figures(outs_by_arm: dict[str, list[dict]], fwd: float, gflops: float) -> tuple[dict, list[list]]:
    """Each arm's figures() (plus short names roll, train, sec) and its row of the raw-data table (FLOPs, achieved)."""
    rows, figs = [], {}
    for n, outs in outs_by_arm.items():
        f = figs[n] = figures(outs)
        f.update(roll=f["rollout_rows"], train=f["train_rows"], sec=f["seconds"])
        flops = fwd * (f["roll"] + 3 * f["train"])  # a backward costs about two forwards
        rows.append(
            [
                n,
                int(f["roll"]),
                int(f["train"]),
                int(f["trained"]),
                split(f),
                f"{flops / 1e9:.1f}",
                f"{flops / f['sec'] / 1e9 / gflops:.0%}",
            ]
        )
    return figs, rows


def _tree_table(res: dict, figs: dict) -> str:
    """Part (a)'s comparison table: each arm over independent in evaluations, seconds and gain per iteration."""
    arms, ind = res["arms"], figs["independent"]
    g_ind = {m: gain(arms["independent"].curve, m, "iteration") for m in ("partial", "strict")}
    table = []
    for n, p in res["pairs"].items():
        g = {m: gain(arms[n].curve, m, "iteration") for m in ("partial", "strict")}
        table.append(
            [
                n,
                (
                    f"{(ind['roll'] + ind['train']) / (figs[n]['roll'] + figs[n]['train']):.2f}x "
                    f"(rollout only {ind['roll'] / figs[n]['roll']:.2f}x)"
                ),
                fmt_ratio(p),
                f">= {TARGETS['tree']:.0f}x" if n == "tree" else "(variant)",
                ratio_text(g["partial"], g_ind["partial"], 100),
                ratio_text(g["strict"], g_ind["strict"], 100),
            ]
        )
    iters = arms["independent"].step
    return md_table(
        [
            "comparison (B over A = independent)",
            "network evaluations per iteration, A / B",
            "seconds per iteration, A / B (measured)",
            "target",
            f"partial-accuracy gain per iteration, B / A ({iters} iterations, points)",
            "strict-accuracy gain per iteration, B / A (points)",
        ],
        table,
    )


def _raw_note(ind: dict, fwd: float, gflops: float) -> str:
    """What part (a)'s raw-data table counts and how FLOPs and the achieved rate are figured."""
    return (
        f"Raw data (medians; seconds are this machine's, not the code's): evaluations are latents through the "
        f"transformer, CFG's two passes counted (rollout = no grad, train = with grad); trained = unmasked "
        f"(sample, step) transitions in the loss; FLOPs = forward FLOPs per latent ({fwd / 1e6:.1f} MFLOP, "
        f"torch FlopCounter) x (rollout + 3 x train); achieved = FLOP/s over this process's measured fp32 "
        f"matmul rate ({gflops:.1f} GFLOP/s). Rollout seconds include the reward (shapes verifier, about "
        f"{ind['reward_s']:.2f} s); an update's seconds beyond its transformer forward are the backward and the "
        f"optimizer step."
    )


def _tree_shape(plan, late, figs: dict, uniq: int, uniq_late: int, b: int) -> str:
    """The trees' splits and depths, how the engine credited shared transitions, and the distinct-transition bound."""
    ind, tr = figs["independent"], figs["tree"]
    depth = depth_of_steps(plan).tolist()
    n_ind = ind["trained"]
    proj = tr["rollout_s"] + tr["update_s"] * uniq / tr["trained"]
    credit = (
        f"Each distinct transition is trained once ({int(tr['trained'])} trained = the tree's {uniq} distinct ones)"
        if tr["trained"] <= uniq
        else f"The engine trained {int(tr['trained'])} transitions where the tree has {uniq} distinct ones (a "
        f"shared transition once per leaf below it); training each once would bring the tree to about "
        f"{ind['sec'] / proj:.1f}x (projection)"
    )
    return (
        f"Tree: splits at steps {sorted(plan.branches)} (fan-out 2, {plan.group_size} leaves, depths "
        f"{depth}); pruned = BranchGRPO's width pruning (branch_best, 1 leaf of each sibling pair "
        f"back-propagated) plus depth pruning (depth 3, steps {[t for t in range(len(depth)) if depth[t] == 3]}"
        f", not trained); rollouts unchanged; late splits = splits at {sorted(late.branches)}. {credit}. At "
        f"equal leaves and steps the tree has {uniq} distinct transitions against independent's {int(n_ind)}, "
        f"so its trained transitions can shrink at most {n_ind / uniq:.2f}x (its rollout evaluations "
        f"{n_ind / count_nfe(plan, b):.2f}x: siblings share the call at a split); "
        f"the late-split tree has {uniq_late} ({n_ind / uniq_late:.2f}x), but its leaves share the first "
        f"{min(late.branches)} of the {late.num_steps} steps, so a group's samples differ only in the last "
        f"{late.num_steps - min(late.branches)}."
    )


def _bounds(plan, late, figs: dict, uniq: int, uniq_late: int, b: int) -> dict:
    """The tree's speed-up bounds from counted work (distinct transitions, rollout evaluations, work at independent's
    per-evaluation seconds) and its per-evaluation costs over independent's."""
    ind, tr = figs["independent"], figs["tree"]
    n_ind = ind["trained"]
    # the tree's counted work at independent's measured seconds per rollout and per training evaluation
    at_ind_cost = ind["rollout_s"] * tr["roll"] / ind["roll"] + ind["update_s"] * tr["train"] / ind["train"]
    return {
        "tree": n_ind / uniq,
        "late": n_ind / uniq_late,
        "roll": n_ind / count_nfe(plan, b),
        "roll_late": n_ind / count_nfe(late, b),
        "work": ind["sec"] / at_ind_cost,
        "roll_cost": (tr["rollout_s"] / tr["roll"]) / (ind["rollout_s"] / ind["roll"]),
        "train_cost": (tr["update_s"] / tr["train"]) / (ind["update_s"] / ind["train"]),
    }


def tree_section(res: dict, setting: dict, fwd: float, gflops: float) -> tuple[str, dict]:
    """Part (a)'s markdown (comparison, raw-data and accuracy tables, the trees' shape) and the figures and bounds the
    verdict reads."""
    arms, (figs, rows) = res["arms"], arm_figures(res["outs"], fwd, gflops)
    plan, late = arms["tree"].plan, arms["tree, late splits"].plan
    b = setting["prompts_per_iter"]
    every = list(range(plan.num_steps))
    uniq = unique_transitions(plan, every, b)
    uniq_late = unique_transitions(late, every, b)
    lines = [
        _tree_table(res, figs),
        "",
        _raw_note(figs["independent"], fwd, gflops),
        "",
        md_table(
            [
                "arm",
                "rollout evaluations",
                "train evaluations",
                "trained transitions",
                "seconds: rollout (transformer forward) + update (transformer forward)",
                "GFLOP per iteration",
                "achieved / matmul rate",
            ],
            rows,
        ),
        "",
        md_table(
            ["arm", "partial accuracy: start -> end (change, points +- s.e.)", "strict accuracy"],
            [[n, ends(a.curve, "partial"), ends(a.curve, "strict")] for n, a in arms.items()],
        ),
        "",
        _tree_shape(plan, late, figs, uniq, uniq_late, b),
    ]
    return "\n".join(lines), {"figs": figs, "bound": _bounds(plan, late, figs, uniq, uniq_late, b)}


# ---- (b) window and fast vs all steps


def _target(arm: str) -> str:
    """The gain-per-second target of a part (b) arm: window (issue 9) and DiffusionNFT (issue 15); others are variants."""
    key = "window" if arm.startswith("window") else "nft" if arm == NFT else None
    return f">= {TARGETS[key]:.0f}x" if key else "(variant)"


def _window_table(arms: list[str], figs: dict, slopes: dict) -> str:
    """Part (b)'s comparison table: each arm over all steps in gain per training second and iteration speed."""
    rows = []
    for n in arms[1:]:
        rows.append(
            [
                n,
                ratio_text(slopes[n]["partial"], slopes[BASE]["partial"], 6000),
                ratio_text(slopes[n]["strict"], slopes[BASE]["strict"], 6000),
                f"{figs[BASE]['seconds'] / figs[n]['seconds']:.2f}x",
                _target(n),
            ]
        )
    return md_table(
        [
            "comparison (B over A = all steps)",
            "partial-accuracy gain per training second, B / A (points per minute)",
            "strict-accuracy gain per training second, B / A (points per minute)",
            "iterations per second, B / A (median iteration)",
            "target",
        ],
        rows,
    )


def _window_raw(outs: dict, figs: dict, curves: dict) -> str:
    """Part (b)'s raw-data table: iterations, seconds, evaluations (median, min-max) and the accuracy trail per arm."""
    trail = lambda c, m: " -> ".join(f"{acc[m]:.3f}" for _, _, acc in c)
    rng = lambda n, key: (
        f"{median([o[key] for o in outs[n]]):.0f} ({min(o[key] for o in outs[n])}-{max(o[key] for o in outs[n])})"
    )
    raw = [
        [
            n,
            c[-1][1],
            f"{c[-1][0]:.0f}",
            rng(n, "rollout_rows"),
            rng(n, "train_rows"),
            split(figs[n]),
            f"{trail(c, 'partial')} ({change(c, 'partial')})",
            f"{trail(c, 'strict')} ({change(c, 'strict')})",
        ]
        for n, c in curves.items()
    ]
    return md_table(
        [
            "arm",
            "iterations",
            "training seconds",
            "rollout evaluations per iteration (median, min-max)",
            "train evaluations (median, min-max)",
            "seconds: rollout (transformer forward) + update (transformer forward)",
            "partial accuracy at 0, 1/2, 1 of the budget (change, points +- s.e.)",
            "strict accuracy",
        ],
        raw,
    )


def _window_note() -> str:
    """How part (b)'s arms race and why the window arm's groups share their noise."""
    return (
        "The arms race side by side from the same start (the next iteration always goes to the arm with "
        "the least training time, so the machine's load hits all alike). Gain per second = least-squares slope of "
        "accuracy on the arm's own training seconds (evaluation excluded). The window arm shares each group's "
        "initial noise, as MixGRPO's recipe does (configs/flow/sd35m_mixgrpo.yaml; MixGRPO's script passes "
        "--init_same_noise): the ODE steps before the window are then the same for the group's samples and run "
        "once per prompt, the group splitting at the window's first SDE step (an exact saving for that sampling "
        "distribution, tests/test_flow_plan.py); its rollout evaluations vary with the window's position. The "
        "all-step arm has no ODE prefix to share, so it keeps independent noises. The DiffusionNFT arm samples as "
        "all-step does (independent SDE rollouts) but keeps only each sample's x0 and trains the forward-process "
        "loss at 2 noise levels per sample (configs/flow/sd35m_diffusionnft.yaml's settings), without log-probs."
    )


def window_section(win: dict) -> tuple[str, dict]:
    """Part (b)'s markdown (comparison and raw-data tables, the race's note) and the curves, slopes and figures the
    verdict reads."""
    figs = {n: figures(o) for n, o in win["outs"].items()}  # medians
    curves = {n: w.curve for n, w in win["arms"].items()}
    slopes = {n: {m: gain(c, m, "second") for m in ("partial", "strict")} for n, c in curves.items()}
    md = "\n".join(
        [
            _window_table(list(win["arms"]), figs, slopes),
            "",
            _window_raw(win["outs"], figs, curves),
            "",
            _window_note(),
        ]
    )
    return md, {"curves": curves, "slopes": slopes, "figs": figs}


def plots(figs: dict, curves: dict) -> list[str]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(figs)
    ax.barh(names, [figs[n]["rollout_s"] for n in names], label="rollout + reward")
    ax.barh(names, [figs[n]["update_s"] for n in names], left=[figs[n]["rollout_s"] for n in names], label="update")
    for i, n in enumerate(names):
        ax.text(figs[n]["sec"], i, f"  {int(figs[n]['roll'])}+{int(figs[n]['train'])} evals", va="center")
    ax.set_xlabel("seconds per training iteration (median, this machine)")
    ax.set_title("Flow (ShapesWorld): tree vs independent, equal leaves and steps")
    ax.set_xlim(0, 1.45 * max(figs[n]["sec"] for n in names))
    ax.legend(loc="upper right")
    paths = [save_plot(fig, "flow_tree")]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for j, (n, c) in enumerate(curves.items()):
        for metric, style in (("partial", "-"), ("strict", ":")):
            ax.plot([p[0] for p in c], [p[2][metric] for p in c], f"C{j}{style}", marker="o", label=f"{n}, {metric}")
    ax.set_xlabel("training seconds spent by the arm")
    ax.set_ylabel("validation accuracy (ODE, fixed noises)")
    ax.set_title("Flow (ShapesWorld): accuracy vs training time")
    ax.legend(fontsize=7)
    paths.append(save_plot(fig, "flow_window"))
    return [p.name for p in paths]
