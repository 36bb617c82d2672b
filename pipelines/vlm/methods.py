"""Method hooks the VLM pipeline computes itself: GRPO-CARE's answer likelihood under a slow EMA reference, and
TON's thought dropout for the cold-start SFT data. The reward maths live in `rewards.compose`.
"""

import random
import re
from typing import Any

import torch
from torch import Tensor


def answer_token_mask(pieces: list[list[str]], *, tag: str = "answer") -> Tensor:
    """[N, K] bool: the tokens overlapping the content of each completion's last <tag>...</tag> block.

    pieces[i][t] is the text of token t of completion i (decoded alone); offsets are taken in "".join(pieces[i]),
    so a multi-byte character split over tokens cannot shift the ASCII tags.
    """
    k = max((len(p) for p in pieces), default=0)
    mask = torch.zeros((len(pieces), k), dtype=torch.bool)
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    for i, toks in enumerate(pieces):
        found = list(pattern.finditer("".join(toks)))
        if not found or not found[-1].group(1).strip():
            continue
        a, b = found[-1].span(1)
        end = 0
        for t, piece in enumerate(toks):
            start, end = end, end + len(piece)
            mask[i, t] = start < b and end > a
    return mask


def mean_likelihood(logp: Tensor, mask: Tensor) -> Tensor:
    """GRPO-CARE's answer likelihood (arXiv:2506.16141): p_i = exp(mean_{t in answer} logp[i, t]), 0 without answer.

    Args:
        logp: [N, K] token log-probs under the reference.  mask: [N, K] answer tokens.
    Returns:
        [N] likelihoods in [0, 1].
    """
    if logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)} != mask {tuple(mask.shape)}")
    m = mask.to(logp.dtype)  # [N, K]
    count = m.sum(1)  # [N]
    mean = (logp * m).sum(1) / count.clamp(min=1)  # [N]
    return torch.where(count > 0, mean.exp(), torch.zeros_like(mean))  # [N]


class CareLikelihood:
    """GRPO-CARE's consistency signal: the likelihood of the answer given the reasoning under an EMA of the policy.

    The EMA (decay `decay`, updated every `every` rollouts, starting from the weights at the first rollout) covers the
    trainable weights only (the LoRA adapter, or all weights in full fine-tuning). The policy puts the result in
    rollout.extras["reward_fields"]["likelihood"]; the `grpo_care` reward reads it as field `likelihood`.
    """

    def __init__(self, *, decay: float = 0.995, every: int = 10, tag: str = "answer"):
        if not 0 <= decay < 1:
            raise ValueError(f"care_ema_decay ({decay}) must be in [0, 1)")
        if every < 1:
            raise ValueError(f"care_ema_every ({every}) must be >= 1")
        self.decay, self.every, self.tag = decay, every, tag
        self.calls = 0
        self.last_step: int | None = None
        self.ema: dict[str, Tensor] | None = None

    @torch.no_grad()
    def update(self, named: dict[str, Tensor], step: int | None = None) -> None:
        """Start the EMA from `named` on the first call; then ema = decay * ema + (1 - decay) * w every `every` calls.

        With `step` (the training iteration), calls within one iteration (DAPO refill rounds) count once.
        """
        if step is not None and step == self.last_step:
            return
        self.last_step = step
        if self.ema is None:
            self.ema = {k: v.detach().clone() for k, v in named.items()}
        elif self.calls % self.every == 0:
            for k, v in named.items():
                self.ema[k].lerp_(v.detach(), 1.0 - self.decay)
        self.calls += 1

    @torch.no_grad()
    def likelihood(
        self, policy: Any, encs: list, completions: Tensor, lengths: Tensor, group_size: int, step: int | None = None
    ) -> Tensor:
        """[N] answer likelihoods of the rollout's completions under the EMA weights (swapped in, then restored)."""
        params = {n: p for n, p in policy.module.named_parameters() if p.requires_grad}
        self.update(params, step)
        backup = {n: p.detach().clone() for n, p in params.items()}
        try:
            for n, p in params.items():
                p.copy_(self.ema[n])
            logp = policy._score(policy.module, encs, completions, lengths, group_size)  # [N, K]
        finally:
            for n, p in params.items():
                p.copy_(backup[n])
        tok = policy.tokenizer
        pieces = [[tok.decode([t]) for t in c[:n].tolist()] for c, n in zip(completions, lengths.tolist())]
        mask = answer_token_mask(pieces, tag=self.tag).to(logp.device)  # [N, K']
        mask = torch.nn.functional.pad(mask, (0, logp.shape[1] - mask.shape[1]))
        return mean_likelihood(logp.float(), mask).cpu()


def thought_dropout(
    records: list[dict[str, Any]], *, p: float = 0.5, seed: int = 0, think: str = "think", answer: str = "answer"
) -> list[dict[str, Any]]:
    """TON's thought dropout (arXiv:2505.16854): SFT targets whose reasoning is replaced by an empty think w.p. p.

    target = "<think>\\n{reasoning}\\n</think><answer>{answer}</answer>", or "<think>\\n\\n</think><answer>...</answer>"
    when dropped. Records need "answers" and optionally "reasoning"; each output record gains a "target" string.
    """
    if not 0 <= p <= 1:
        raise ValueError(f"thought dropout p ({p}) must be in [0, 1]")
    rng = random.Random(seed)
    out = []
    for rec in records:
        reasoning = "" if rng.random() < p else str(rec.get("reasoning", "")).strip()
        target = f"<{think}>\n{reasoning}\n</{think}><{answer}>{rec['answers']}</{answer}>"
        out.append({**rec, "target": target})
    return out
