"""What every VLM rollout backend shares: the sampling settings and chat prompt, the stop rule, seeded group sampling,
padding, and `SamplingPolicy`, the part of the policy a backend reads.

Group = (completions [G, T] token ids, lengths [G] real tokens >= 1, generation-time log-probs [G, T] or None).
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pipelines.vlm.data import load_image, record_images
from pipelines.vlm.prefix import TOKEN_KEYS

Group = tuple[Tensor, Tensor, Tensor | None]


@dataclass
class SampleSettings:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ("</answer>",)
    system_prompt: str | None = None
    instruction: str | None = None


def chat_prompt(processor: Any, settings: SampleSettings, record: dict[str, Any]) -> tuple[str, list]:
    """(chat-template text, PIL images) of one record: the prompt every rollout backend samples from."""
    try:
        images = [load_image(x) for x in record_images(record)]
    except (OSError, ValueError) as err:
        raise ValueError(
            f"record {record.get('id', record.get('prompt'))!r}: cannot load its image ({err}); "
            f"fix the data or enable pipeline.kwargs.skip_bad_images"
        ) from err
    text = record["prompt"] if not settings.instruction else f"{record['prompt']}\n{settings.instruction}"
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    messages.append({"role": "user", "content": content})
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), images


class SamplingPolicy(Protocol):
    """What a rollout backend reads from the policy it samples for (VLMPolicy and the video policy have it all).

    Backends never call back into the policy's rollout: they get the model, the processor and the settings here.
    """

    module: Any
    """Task.module (VLMModule): .hf (peft-wrapped), .suppress [V] bool, .suppress_ids; forward(generate= | step=)"""
    processor: Any
    tokenizer: Any
    s: SampleSettings
    eos_ids: list[int]
    device: torch.device
    check_logp: bool
    """also return generation-time log-probs"""

    def synced_gpus(self) -> bool:
        """Whether sampling must run in lockstep over ranks (FSDP-sharded weights)."""


# ----- the stop rule, shared by every backend
def stop_window(stop: tuple[str, ...]) -> int:
    """Tokens to decode when looking for a stop string that ends at the newest token (each decodes to >= 1 char)."""
    return max((len(s) for s in stop), default=0) + 2


def _stops_here(ids: list[int], eos: set[int], stop: tuple[str, ...], tokenizer, window: int) -> bool:
    """Whether a completion ends at its last token of `ids`: an EOS id, or a stop string inside the decoded tail."""
    if ids[-1] in eos:
        return True
    if not stop:
        return False
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in tail for s in stop)


def stop_lengths(completions: list[list[int]], eos_ids: list[int], stop: tuple[str, ...], tokenizer) -> list[int]:
    """Per completion, the tokens kept: up to and including the first EOS or the token completing a stop string;
    all of them when neither occurs (truncated); at least 1. The same rule _StopTracker applies while `generate` runs."""
    eos, window, out = set(eos_ids), stop_window(stop), []
    for ids in completions:
        end = next(
            (
                t
                for t in range(1, len(ids) + 1)
                if _stops_here(ids[max(t - window, 0) : t], eos, stop, tokenizer, window)
            ),
            len(ids),
        )
        out.append(max(end, 1))
    return out


class _StopTracker(StoppingCriteria):
    """Stopping criterion that records where each row ended: its first EOS token or the end of a stop string."""

    def __init__(self, prompt_len: int, eos_ids: list[int], stop: tuple[str, ...], tokenizer):
        self.prompt_len, self.stop, self.tokenizer = prompt_len, stop, tokenizer
        self.eos = {int(e) for e in eos_ids}
        self.window = stop_window(stop)
        self.done_at: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Any = None, **kwargs: Any) -> Tensor:
        gen = input_ids[:, self.prompt_len :].cpu()  # [G, t]
        if self.done_at is None:
            self.done_at = torch.full((gen.shape[0],), -1, dtype=torch.long)
        for r in range(gen.shape[0]):
            tail = gen[r, -self.window :].tolist()
            if self.done_at[r] < 0 and _stops_here(tail, self.eos, self.stop, self.tokenizer, self.window):
                self.done_at[r] = gen.shape[1]
        return (self.done_at >= 0).to(input_ids.device)


def pad_group(ids: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """Token-id lists of one group as [G, T] (T = the longest, at least 1), right-padded with pad_id."""
    t = max(max((len(x) for x in ids), default=0), 1)
    return torch.tensor([x + [pad_id] * (t - len(x)) for x in ids], dtype=torch.long, device=device)  # [G, T]


# ----- seeded sampling of G rows per prompt, in one batch
def sampling_warpers(temperature: float, top_k: int | None, top_p: float) -> list:
    """The logits warpers transformers' `generate(do_sample=True)` applies, in its order (temperature, top-k, top-p)."""
    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        out.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
    return out


class GroupSampler(LogitsProcessor):
    """Per-prompt seeded sampling inside one `generate` over many prompts: rows [b*G, (b+1)*G) draw their next
    tokens with torch.multinomial from softmax(warped logits), using prompt b's own torch.Generator (seeded by
    seeds[b]); every other token gets -inf, so generate's own selection (argmax, or a multinomial over this one-hot
    row) returns the draw.

    The distribution is the one `generate(do_sample=True)` samples (same warpers, same softmax, same multinomial), and
    prompt b's generator is read by prompt b's rows only, so its completions do not depend on the other prompts in
    the call: one call per rank batch gives the completions one call per prompt gives (up to padding round-off in the
    logits), on any rank count. Alone, a prompt draws the stream the global RNG seeded with its seed would.
    """

    def __init__(
        self,
        seeds: list[int],
        group_size: int,
        *,
        temperature: float,
        top_k: int | None,
        top_p: float,
        device: torch.device,
    ):
        self.group, self.warpers = group_size, sampling_warpers(temperature, top_k, top_p)
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if scores.shape[0] != self.group * len(self.gens):
            raise ValueError(f"GroupSampler got {scores.shape[0]} rows for {len(self.gens)} prompts x G={self.group}")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = scores.float().softmax(-1)  # [N, V]
        picks = torch.cat(
            [
                torch.multinomial(probs[b * self.group : (b + 1) * self.group], 1, generator=gen)
                for b, gen in enumerate(self.gens)
            ]
        )  # [N, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, picks, 0.0)  # [N, V]


def left_pad_prompts(encs: list[dict[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """One generate batch from per-prompt encodings (batch of 1 each): per-token tensors left-padded to the longest
    prompt (input_ids with pad_id, masks with 0), per-image tensors (pixel_values, *_grid_thw...) concatenated."""
    keys = [k for k, v in encs[0].items() if isinstance(v, Tensor) and not k.startswith("_")]
    if len(encs) == 1:
        return {k: encs[0][k] for k in keys}
    width = max(e["input_ids"].shape[1] for e in encs)
    out = {}
    for k in keys:
        if k in TOKEN_KEYS:
            fill = pad_id if k == "input_ids" else 0
            out[k] = torch.cat(
                [nn.functional.pad(e[k], (width - e[k].shape[1], 0), value=fill) for e in encs]
            )  # [B, L]
        else:
            out[k] = torch.cat([e[k] for e in encs], dim=0)
    return out
