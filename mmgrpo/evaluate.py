"""`mmgrpo eval` and `mmgrpo sample`: roll out a (trained) policy on held-out prompts, score, tabulate, save.

Uses the same pipeline builder, rewards and checkpoint format as training; no gradient, no optimizer.
"""

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmgrpo import checkpoint, looking
from mmgrpo.collect import reward_fields
from mmgrpo.config import Config
from mmgrpo.errors import UserError
from mmgrpo.runtime import prompt_seed
from mmgrpo.setup import build_rewards, build_task
from mmgrpo.tracking import save_gallery

SAMPLE_GROUP = 4
"""samples per record in the report's before/after gallery (`samples=` records, whatever the eval's group_size)"""


def resolve_checkpoint(cfg: Config, ckpt: str | None) -> Path | None:
    """ "latest" (newest valid in run.output_dir), a checkpoint directory, or None for the untrained policy."""
    if ckpt in (None, "", "none"):
        return None
    if ckpt == "latest":
        path = checkpoint.latest_valid(Path(cfg.run.output_dir) / "checkpoints")
        if path is None:
            raise UserError(
                f"ckpt=latest: no valid checkpoint under {cfg.run.output_dir}/checkpoints; train first "
                f"or pass ckpt=<checkpoint dir>"
            )
        return path
    path = Path(ckpt)
    reason = checkpoint.check(path) if path.is_dir() else "no such directory"
    if reason:
        raise UserError(
            f"ckpt ({ckpt!r}) is not a valid checkpoint: {reason}; pass a directory such as "
            f"{cfg.run.output_dir}/checkpoints/step_00000060, or ckpt=latest"
        )
    return path


def _load(cfg: Config, ckpt: str | None, ema: bool = False):
    path = resolve_checkpoint(cfg, ckpt)  # before building the model, so a bad path fails at once
    if ema and (path is None or not (path / "ema.safetensors").is_file()):
        raise UserError(
            f"ema=true: checkpoint {str(path) if path else ckpt!r} holds no EMA weights; train with "
            f"optim.ema_decay>0 (e.g. 0.99) or drop ema=true"
        )
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.run.device != "cpu" else "cpu")
    task = build_task(cfg, device)
    if hasattr(task.policy, "for_evaluation"):
        task.policy.for_evaluation()  # no training-only rollout tricks (e.g. TempSamp's injected ground truth)
    if path is not None:
        data = checkpoint.load(path, 0)
        task.policy.load_state_dict(data["weights"])
        if ema:  # EMA keys are the module's parameter names (see setup): overwrite the trainable weights with them
            unexpected = task.module.load_state_dict(data["ema"], strict=False).unexpected_keys
            if unexpected:
                raise UserError(
                    f"ema=true: EMA weights of {str(path)!r} do not fit this model (e.g. "
                    f"{unexpected[0]!r}); use the recipe the checkpoint was trained with"
                )
    return task, device, path


def _rollout_scored(
    cfg: Config,
    task,
    reward_set,
    records: list[dict[str, Any]],
    group_size: int,
    *,
    first_seed: int = 0,
    step: int = -1,
):
    seeds = [prompt_seed(cfg.run.seed, step, 0, first_seed + i) for i in range(len(records))]
    rollout = task.policy.rollout(records, group_size, seeds)
    texts, fields = reward_fields(records, group_size)
    fields.update(rollout.extras.get("reward_fields", {}))
    per_reward, total = reward_set(rollout.samples, texts, group_size=group_size, **fields)
    return rollout, per_reward, total


def _scores(
    cfg: Config, task, reward_set, records: list[dict[str, Any]], group_size: int, batch_prompts: int
) -> np.ndarray:
    """Every reward and the weighted total of each sample: [len(records), G, R + 1] float64 (reward_set.names order,
    then "total"). Rollout seeds depend on the position in a batch only, so any condition gets the same ones."""
    out = []
    for lo in range(0, len(records), batch_prompts):
        chunk = records[lo : lo + batch_prompts]
        _, per_reward, total = _rollout_scored(cfg, task, reward_set, chunk, group_size)
        s = torch.cat([per_reward.double().cpu(), total.double().cpu()[:, None]], 1)  # [b * G, R + 1]
        out.append(s.reshape(len(chunk), group_size, -1).numpy())  # [b, G, R + 1]
    return np.concatenate(out)


@torch.no_grad()
def evaluate(
    cfg: Config,
    ckpt: str | None = None,
    *,
    group_size: int = 4,
    limit: int | None = None,
    batch_prompts: int = 16,
    ema: bool = False,
) -> dict[str, dict[str, float]]:
    """Mean of every reward per prompt category ("all" plus each record's "category") on the eval prompts."""
    return evaluate_conditions(cfg, ckpt, group_size=group_size, limit=limit, batch_prompts=batch_prompts, ema=ema)[
        "conditions"
    ]["real"]


@torch.no_grad()
def evaluate_conditions(
    cfg: Config,
    ckpt: str | None = None,
    *,
    ablate: str = "none",
    group_size: int = 4,
    limit: int | None = None,
    batch_prompts: int = 16,
    ema: bool = False,
    samples: int = 0,
) -> dict[str, Any]:
    """`evaluate` with the real inputs and with each visual ablation on the same records and rollout seeds, the
    paired tests of each ablation against the real inputs, and (samples > 0) gallery items of `samples` records
    spread over the eval set, for the report's before/after samples.

    `ablate`: "auto" (blank,shuffle where the records hold images or videos), "none", or a list such as
    "blank,shuffle"; the swap is the policy's `ablate_records` hook (pipelines/visual_ablation.py).

    Returns {"ckpt", "label", "seed", "group_size", "records", "conditions": {condition: table},
    "tests": {condition: {category: {metric: paired test}}}, "items": [...]}; see mmgrpo/looking.py."""
    task, device, path = _load(cfg, ckpt, ema)
    reward_set = build_rewards(cfg, task, device)
    records = (task.eval_data or task.train_data)[:limit]
    pixels = hasattr(task.policy, "ablate_records") and any(
        r.get(k) is not None for r in records for k in ("image", "video")
    )
    try:
        ablations = looking.parse_ablate(ablate, pixels)
    except ValueError as err:
        raise UserError(str(err)) from None
    if ablations and not pixels:
        raise UserError(
            f"ablate={ablate}: pipeline {cfg.pipeline.name!r} has no images or videos to "
            f"ablate; use it with vlm or video recipes, or pass ablate=none"
        )
    names = [*reward_set.names, "total"]
    scores = {"real": _scores(cfg, task, reward_set, records, group_size, batch_prompts)}
    with tempfile.TemporaryDirectory(prefix="mmgrpo-ablate-") as workdir:
        for name in ablations:
            try:
                ablated = task.policy.ablate_records(records, name, seed=cfg.run.seed, workdir=workdir)
            except ValueError as err:
                raise UserError(f"ablate={name}: {err}") from None
            scores[looking.CONDITIONS[name]] = _scores(cfg, task, reward_set, ablated, group_size, batch_prompts)
    cats = [str(r.get("category", "all")) for r in records]
    label = ("base" if path is None else path.name) + ("_ema" if ema else "")
    return {
        "ckpt": str(path) if path is not None else "none",
        "label": label,
        "seed": cfg.run.seed,
        "group_size": group_size,
        "records": len(records),
        "conditions": {c: looking.category_table(s, cats, names) for c, s in scores.items()},
        "tests": looking.paired_tests(scores, cats, names),
        "items": _sample_items(cfg, task, reward_set, records, samples, SAMPLE_GROUP) if samples else [],
    }


def _sample_items(
    cfg: Config, task, reward_set, records: list[dict[str, Any]], k: int, group_size: int
) -> list[dict[str, Any]]:
    """Gallery items of k records spread over the eval set, one rollout per record at fixed seeds (the same for
    every checkpoint, so a report can show before and after on the same prompts and seeds), with an input preview."""
    picks = records[:: max(1, len(records) // k)][:k]
    items = []
    for i, rec in enumerate(picks):
        rollout, _, total = _rollout_scored(cfg, task, reward_set, [rec], group_size, first_seed=i, step=-2)
        if hasattr(task.policy, "gallery"):
            got = task.policy.gallery(rollout, [rec], total)[:group_size]
        else:
            got = [
                {"prompt": str(rec.get("prompt")), "text": str(s), "reward": float(r)}
                for s, r in zip(rollout.samples, total.tolist())
            ]
        if got and not ({"image", "frames"} & set(got[0])) and hasattr(task.policy, "preview"):
            got[0].update(task.policy.preview(rec))
        truth = rec.get("answers", rec.get("spans"))
        for g, item in enumerate(got):
            item.update(record=i, sample=g, category=str(rec.get("category", "all")))
            item.pop("answer", None)
            if truth is not None:
                item["answer"] = str(truth)
        items += got
    return items


def evaluate_run(
    cfg: Config, ckpt: str | None = None, *, out_dir: str | Path | None = None, **kwargs: Any
) -> tuple[dict[str, Any], Path]:
    """`evaluate_conditions`, saved for scripts and the report: <out_dir>/eval/<label>.json (tables, paired tests)
    and <out_dir>/eval/<label>_samples/ (gallery); out_dir defaults to run.output_dir. Returns (result, json path)."""
    result = evaluate_conditions(cfg, ckpt, **kwargs)
    root = Path(out_dir or cfg.run.output_dir) / "eval"
    items = result.pop("items")
    try:
        root.mkdir(parents=True, exist_ok=True)
        keep_previous(root, result["label"])
        if items:
            save_gallery(root / f"{result['label']}_samples", items)
        path = root / f"{result['label']}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)  # atomic: a crash leaves the old result or the new one, never a cut file
    except OSError as err:
        raise UserError(
            f"cannot write the eval results under {str(root)!r} ({err.strerror}); pass a writable run.output_dir=DIR"
        ) from None
    return result, path


def keep_previous(root: Path, label: str) -> Path | None:
    """An earlier result of `label` (another `mmgrpo eval` of the same checkpoint, perhaps on more records) moves to
    <label>.<n>.json and <label>.<n>_samples (n = 1, 2, ...): a re-evaluation never erases one. Returns its new path."""
    old = root / f"{label}.json"
    if not old.exists():
        return None
    n = 1
    while (root / f"{label}.{n}.json").exists() or (root / f"{label}.{n}_samples").exists():
        n += 1
    samples = root / f"{label}_samples"
    if samples.exists():
        samples.rename(root / f"{label}.{n}_samples")
    return old.rename(root / f"{label}.{n}.json")


def format_table(table: dict[str, dict[str, float]]) -> str:
    cols = [k for k in next(iter(table.values())) if k != "n"] + ["n"]
    head = f"{'category':<18}" + "".join(f"{c:>14}" for c in cols)
    lines = [head, "-" * len(head)]
    for cat, row in table.items():
        lines.append(f"{cat:<18}" + "".join(f"{row[c]:>14.4f}" if c != "n" else f"{int(row[c]):>14d}" for c in cols))
    return "\n".join(lines)


@torch.no_grad()
def sample(
    cfg: Config, ckpt: str | None, out_dir: str, *, num_prompts: int = 4, group_size: int = 4, ema: bool = False
) -> Path:
    """Roll out a few eval prompts and save them as a gallery (PNGs or texts with their rewards)."""
    task, device, _ = _load(cfg, ckpt, ema)
    reward_set = build_rewards(cfg, task, device)
    records = (task.eval_data or task.train_data)[:num_prompts]
    rollout, _, total = _rollout_scored(cfg, task, reward_set, records, group_size)
    if hasattr(task.policy, "gallery"):
        items = task.policy.gallery(rollout, records, total)
    else:
        items = [
            {"prompt": str(records[i // group_size].get("prompt")), "text": str(s), "reward": float(r)}
            for i, (s, r) in enumerate(zip(rollout.samples, total.tolist()))
        ]
    return save_gallery(Path(out_dir), items)
