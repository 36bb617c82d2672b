"""A tiny GRU language model over {a, b, <eos>} and its `Policy`: K = generated tokens, reward = hitting the count.

Kept deliberately small and exact: every log-prob is a log-softmax gather, so ratio == 1 on the first inner epoch.
"""

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from mmgrpo.types import Rollout, Task

VOCAB = ("a", "b", "<eos>")
EOS = 2


class CountLM(nn.Module):
    """logits[n, k] = head(GRU(emb(prev token) + emb(target) + emb(position)))."""

    def __init__(self, max_target: int, max_len: int, hidden: int = 32):
        super().__init__()
        self.max_len = max_len
        self.prompt_emb = nn.Embedding(max_target + 1, hidden)
        self.tok_emb = nn.Embedding(len(VOCAB) + 1, hidden)  # last id is BOS
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(VOCAB))

    def forward(self, target: Tensor, tokens: Tensor) -> Tensor:
        """target [n] ints, tokens [n, K] -> logits [n, K, V] for predicting tokens[:, k] from tokens[:, <k]."""
        n, k = tokens.shape
        bos = torch.full((n, 1), len(VOCAB), dtype=torch.long, device=tokens.device)
        prev = torch.cat([bos, tokens[:, :-1]], dim=1)  # [n, K]
        pos = torch.arange(k, device=tokens.device)
        h = self.tok_emb(prev) + self.prompt_emb(target)[:, None] + self.pos_emb(pos)[None]  # [n, K, H]
        out, _ = self.gru(h)  # [n, K, H]
        return self.head(out)  # [n, K, V]


def _decode(tokens: Tensor, mask: Tensor) -> list[str]:
    return [
        "".join(VOCAB[t] for t, m in zip(row.tolist(), mrow.tolist()) if m and t != EOS)
        for row, mrow in zip(tokens, mask)
    ]


class ToyPolicy:
    """`Policy` for CountLM: inverse-CDF sampling on per-prompt seeded uniforms, so rollouts are rank-independent."""

    def __init__(self, model: CountLM, device: torch.device):
        self.model = model
        self.device = device
        self.ref = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def rollout(self, prompts: list[dict[str, Any]], group_size: int, seeds: list[int]) -> Rollout:
        k = self.model.max_len
        u = torch.cat([torch.rand(group_size, k, generator=torch.Generator().manual_seed(int(s))) for s in seeds])
        u = u.to(self.device)  # [N, K] one uniform per decision, drawn per prompt
        target = torch.tensor([p["target"] for p in prompts], device=self.device).repeat_interleave(group_size)
        tokens = torch.full((len(target), k), EOS, dtype=torch.long, device=self.device)  # [N, K]
        for pos in range(k):
            probs = self.model(target, tokens)[:, pos].softmax(-1)  # [N, V]
            tokens[:, pos] = (probs.cumsum(-1) < u[:, pos, None]).sum(-1).clamp(max=len(VOCAB) - 1)
        done_before = (tokens == EOS).long().cumsum(1) - (tokens == EOS).long()  # [N, K] eos count before k
        mask = done_before == 0  # [N, K] up to and including the first eos
        tokens = torch.where(mask, tokens, EOS)
        logp = self._logp(self.model, target, tokens)
        extras = {"tokens": tokens, "target": target}
        length = mask.sum(1).float()
        return Rollout(
            samples=_decode(tokens, mask),
            old_logp=logp.float(),
            mask=mask,
            extras=extras,
            metrics={"rollout/length_mean": float(length.mean())},
        )

    @staticmethod
    def _logp(model: nn.Module, target: Tensor, tokens: Tensor, entropy: bool = False):
        logits = model(target, tokens).float()  # [n, K, V]
        logps = logits.log_softmax(-1)  # [n, K, V]
        logp = logps.gather(-1, tokens[..., None]).squeeze(-1)  # [n, K]
        if not entropy:
            return logp
        return logp, -(logps.exp() * logps).sum(-1)  # [n, K]

    def logp(self, model: nn.Module, rollout: Rollout, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        ex = rollout.extras
        logp, ent = self._logp(model, ex["target"][idx], ex["tokens"][idx], entropy=True)
        return logp, {"entropy": ent.detach()}

    @torch.no_grad()
    def ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor:
        return self._logp(self.ref, rollout.extras["target"][idx], rollout.extras["tokens"][idx])

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    def export(self, directory: Path) -> None:
        """The whole model as model.safetensors plus config.json, enough to rebuild CountLM without mmgrpo."""
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()},
            str(directory / "model.safetensors"),
        )
        m = self.model
        spec = {
            "max_target": m.prompt_emb.num_embeddings - 1,
            "max_len": m.max_len,
            "hidden": m.head.in_features,
            "vocab": list(VOCAB),
        }
        (directory / "config.json").write_text(json.dumps(spec, indent=1))

    def gallery(self, rollout: Rollout, prompts: list[dict[str, Any]], rewards: Tensor) -> list[dict[str, Any]]:
        g = len(rollout.samples) // len(prompts)
        return [
            {"prompt": prompts[i // g]["prompt"], "text": s, "reward": float(r)}
            for i, (s, r) in enumerate(zip(rollout.samples, rewards.tolist()))
        ][: 4 * g]


def count_reward(samples: list[str], prompts: list[str] | None = None, *, target: list[int], max_len: int = 8):
    """1 - |#a - target| / max_len: dense credit for writing exactly `target` letters a."""
    return [1.0 - abs(s.count("a") - int(t)) / max_len for s, t in zip(samples, target)]


def _records(targets: list[int]) -> list[dict[str, Any]]:
    return [{"prompt": f"write {t} a's", "target": t} for t in targets]


def build_toy_count(
    *,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    max_target: int = 6,
    max_len: int = 8,
    hidden: int = 32,
) -> Task:
    """The counting task: prompts "write n a's" for n in 1..max_target, completions of at most max_len tokens."""
    if not 1 <= max_target < max_len:
        raise ValueError(f"pipeline.kwargs.max_target ({max_target}) must be in [1, max_len={max_len})")
    torch.manual_seed(seed)
    model = CountLM(max_target, max_len, hidden).to(device)
    targets = list(range(1, max_target + 1))
    reward = {"name": "toy_count", "weight": 1.0, "kwargs": {"max_len": max_len}}
    return Task(
        policy=ToyPolicy(model, device),
        module=model,
        train_data=_records(targets),
        eval_data=_records(targets),
        rewards=[reward],
    )
