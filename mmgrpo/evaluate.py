"""`mmgrpo eval` and `mmgrpo sample`: roll out a (trained) policy on held-out prompts, score, tabulate, save.

Uses the same pipeline builder, rewards and checkpoint format as training; no gradient, no optimizer.
"""

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from mmgrpo import checkpoint
from mmgrpo.collect import reward_fields
from mmgrpo.config import Config
from mmgrpo.errors import UserError
from mmgrpo.runtime import prompt_seed
from mmgrpo.setup import build_rewards, build_task
from mmgrpo.tracking import save_gallery


def resolve_checkpoint(cfg: Config, ckpt: str | None) -> Path | None:
    """"latest" (newest valid in run.output_dir), a checkpoint directory, or None for the untrained policy."""
    if ckpt in (None, "", "none"):
        return None
    if ckpt == "latest":
        path = checkpoint.latest_valid(Path(cfg.run.output_dir) / "checkpoints")
        if path is None:
            raise UserError(f"ckpt=latest: no valid checkpoint under {cfg.run.output_dir}/checkpoints; train first "
                            f"or pass ckpt=<checkpoint dir>")
        return path
    path = Path(ckpt)
    reason = checkpoint.check(path) if path.is_dir() else "no such directory"
    if reason:
        raise UserError(f"ckpt ({ckpt!r}) is not a valid checkpoint: {reason}; pass a directory such as "
                        f"{cfg.run.output_dir}/checkpoints/step_00000060, or ckpt=latest")
    return path


def _load(cfg: Config, ckpt: str | None, ema: bool = False):
    path = resolve_checkpoint(cfg, ckpt)  # before building the model, so a bad path fails at once
    if ema and (path is None or not (path / "ema.safetensors").is_file()):
        raise UserError(f"ema=true: checkpoint {str(path) if path else ckpt!r} holds no EMA weights; train with "
                        f"optim.ema_decay>0 (e.g. 0.99) or drop ema=true")
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
                raise UserError(f"ema=true: EMA weights of {str(path)!r} do not fit this model (e.g. "
                                f"{unexpected[0]!r}); use the recipe the checkpoint was trained with")
    return task, device, path


def _rollout_scored(cfg: Config, task, reward_set, records: list[dict[str, Any]], group_size: int):
    rollout = task.policy.rollout(records, group_size,
                                  [prompt_seed(cfg.run.seed, -1, 0, i) for i in range(len(records))])
    texts, fields = reward_fields(records, group_size)
    fields.update(rollout.extras.get("reward_fields", {}))
    per_reward, total = reward_set(rollout.samples, texts, group_size=group_size, **fields)
    return rollout, per_reward, total


@torch.no_grad()
def evaluate(cfg: Config, ckpt: str | None = None, *, group_size: int = 4, limit: int | None = None,
             batch_prompts: int = 16, ema: bool = False) -> dict[str, dict[str, float]]:
    """Mean of every reward per prompt category ("all" plus each record's "category") on the eval prompts."""
    task, device, _ = _load(cfg, ckpt, ema)
    reward_set = build_rewards(cfg, task, device)
    records = (task.eval_data or task.train_data)[:limit]
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, int] = defaultdict(int)
    for lo in range(0, len(records), batch_prompts):
        chunk = records[lo: lo + batch_prompts]
        _, per_reward, total = _rollout_scored(cfg, task, reward_set, chunk, group_size)
        for n in range(total.numel()):
            for cat in {"all", str(chunk[n // group_size].get("category", "all"))}:  # uncategorised: once
                counts[cat] += 1
                for r, name in enumerate(reward_set.names):
                    sums[cat][name] += float(per_reward[n, r])
                sums[cat]["total"] += float(total[n])
    cats = sorted(set(counts), key=lambda c: (c != "all", c))
    return {c: {k: v / counts[c] for k, v in sums[c].items()} | {"n": counts[c]} for c in cats}


def format_table(table: dict[str, dict[str, float]]) -> str:
    cols = [k for k in next(iter(table.values())) if k != "n"] + ["n"]
    head = f"{'category':<18}" + "".join(f"{c:>14}" for c in cols)
    lines = [head, "-" * len(head)]
    for cat, row in table.items():
        lines.append(f"{cat:<18}" + "".join(f"{row[c]:>14.4f}" if c != "n" else f"{int(row[c]):>14d}" for c in cols))
    return "\n".join(lines)


@torch.no_grad()
def sample(cfg: Config, ckpt: str | None, out_dir: str, *, num_prompts: int = 4, group_size: int = 4,
           ema: bool = False) -> Path:
    """Roll out a few eval prompts and save them as a gallery (PNGs or texts with their rewards)."""
    task, device, _ = _load(cfg, ckpt, ema)
    reward_set = build_rewards(cfg, task, device)
    records = (task.eval_data or task.train_data)[:num_prompts]
    rollout, _, total = _rollout_scored(cfg, task, reward_set, records, group_size)
    if hasattr(task.policy, "gallery"):
        items = task.policy.gallery(rollout, records, total)
    else:
        items = [{"prompt": str(records[i // group_size].get("prompt")), "text": str(s), "reward": float(r)}
                 for i, (s, r) in enumerate(zip(rollout.samples, total.tolist()))]
    return save_gallery(Path(out_dir), items)
