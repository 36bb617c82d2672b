"""The VLM `Policy`: chat-template prompts with images, seeded rollouts (the model's own sampling loop, or vLLM on CUDA:
see pipelines/vlm/rollout.py), completion log-probs through the prefix-shared (or plain) forward, LoRA or full
fine-tuning, reference by disabled adapter or frozen copy. Old log-probs are always the training model's own.

K = completion tokens; the mask covers each completion up to and including its EOS or stop string.
"""

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo.types import Rollout
from pipelines import visual_ablation
from pipelines.vlm.data import load_image, record_images
from pipelines.vlm.generation import SampleSettings, _StopTracker, chat_prompt  # noqa: F401  imported from here too
from pipelines.vlm.methods import CareLikelihood
from pipelines.vlm.prefix import completion_logp, vision_token_ids
from pipelines.vlm.rollout import HFBackend, hf_generate_group
from pipelines.vlm.vision_cache import VisionCache
from pipelines.vlm.wrapping import needs_synced_gpus, unwrap


class VLMModule(nn.Module):
    """Task.module: owns the (peft-wrapped) model; forward(prompts, completions, lengths) -> (logp, entropy) [n, K],
    or forward(generate=kwargs) -> hf.generate(**kwargs), or forward(step=kwargs) -> hf(**kwargs) (one sampling step).

    The whole log-prob computation runs inside this forward, so accelerate's DDP wrapper sees one forward call.
    """

    def __init__(
        self,
        hf: nn.Module,
        *,
        pad_id: int,
        temperature: float,
        shared: bool,
        chunk_tokens: int,
        prefix_attention: str = "auto",
        vision_cache: str = "auto",
        vision_cache_items: int = 64,
    ):
        super().__init__()
        self.hf, self.prefix_attention = hf, prefix_attention
        # the frozen vision tower's features, once per image/video (pipelines/vlm/vision_cache.py)
        self.vision_cache = VisionCache(unwrap(hf).model, mode=vision_cache, max_items=vision_cache_items)
        self.pad_id, self.temperature, self.shared, self.chunk_tokens = pad_id, temperature, shared, chunk_tokens
        self.suppress_ids = vision_token_ids(unwrap(hf).config)
        vocab = unwrap(hf).get_output_embeddings().weight.shape[0]
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[self.suppress_ids] = True
        self.register_buffer("suppress", suppress, persistent=False)

    def forward(
        self,
        prompts: list[dict[str, Any]] | None = None,
        completions: Tensor | None = None,
        lengths: Tensor | None = None,
        shared: bool | None = None,
        *,
        generate: dict[str, Any] | None = None,
        step: dict[str, Any] | None = None,
    ) -> Any:
        # sampling enters here too (generate, or one step of the rollout's own loop), so wrapper hooks run (FSDP2's
        # weight gathering)
        if step is not None and not any(k.startswith("pixel_values") for k in step):
            return self.hf(**step)  # a decode step: no pixels, no cache to install
        with self.vision_cache.installed():
            if generate is not None:
                return self.hf.generate(**generate)
            if step is not None:
                return self.hf(**step)
            return self._logp(prompts, completions, lengths, shared)

    def _logp(
        self, prompts: list[dict[str, Any]], completions: Tensor, lengths: Tensor, shared: bool | None
    ) -> tuple[Tensor, Tensor]:
        base = unwrap(self.hf)
        return completion_logp(
            base.model,
            base.get_output_embeddings(),
            prompts,
            completions,
            lengths,
            shared=self.shared if shared is None else shared,
            pad_id=self.pad_id,
            temperature=self.temperature,
            chunk_tokens=self.chunk_tokens,
            suppress=self.suppress if self.suppress_ids else None,
            prefix_attention=self.prefix_attention,
        )


class VLMPolicy:
    """`Policy` for an image-text-to-text model; see the module docstring."""

    # `mmgrpo eval ablate=`: the records with blank or another record's pixels, and the report's input previews
    ablate_records = staticmethod(visual_ablation.ablate_records)
    preview = staticmethod(visual_ablation.preview)

    def __init__(
        self,
        module: VLMModule,
        processor: Any,
        *,
        device: torch.device,
        settings: SampleSettings,
        reference: str = "auto",
        care: CareLikelihood | None = None,
        check_logp: bool = False,
        backend: Any = None,
    ):
        self.module, self.processor, self.device, self.s = module, processor, device, settings
        self.backend = backend if backend is not None else HFBackend()
        self._synced_gpus: bool | None = None
        self.tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        self.is_peft = hasattr(module.hf, "disable_adapter")
        if reference not in ("auto", "copy", "none"):
            raise ValueError(
                f"reference={reference!r} must be auto (LoRA: adapter off, full FT: frozen copy), copy or none"
            )
        self.reference = ("adapter" if self.is_peft else "copy") if reference == "auto" else reference
        self.ref_module = None
        if self.reference == "copy":
            self.ref_module = copy.deepcopy(module).requires_grad_(False).eval()
        self.care, self.check_logp = care, check_logp
        self.iteration: int | None = None
        self.defer_old_logp = False  # the engine sets it (see mmgrpo.types.Policy)
        gen_cfg = unwrap(module.hf).generation_config
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = sorted(
            {int(e) for e in (eos if isinstance(eos, list) else [eos])} | {int(self.tokenizer.eos_token_id)}
        )

    def set_iteration(self, step: int) -> None:
        """Called by the trainer before each step's rollout: the step reaches rewards (Trust-GRPO's annealing)."""
        self.iteration = int(step)

    # ----- prompts
    def encode(self, record: dict[str, Any]) -> dict[str, Any]:
        """Processor inputs (batch of 1, on the device) for one record, through the chat template."""
        chat, images = chat_prompt(self.processor, self.s, record)
        enc = self.processor(text=[chat], images=images or None, return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items() if isinstance(v, Tensor)}

    # ----- rollout
    def synced_gpus(self) -> bool:
        """generate's synced_gpus: True when the weights are FSDP-sharded over ranks (decided at the first rollout,
        after accelerate has prepared the model)."""
        if self._synced_gpus is None:
            self._synced_gpus = needs_synced_gpus(self.module.hf)
        return self._synced_gpus

    def _generate_group(self, enc: dict[str, Any], group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """G completions [G, T] of one prompt (the hf backend's sampling, seeded by `seed`), their lengths [G], and
        generation-time log-probs when checked (the video policy samples through this)."""
        return hf_generate_group(self, enc, group_size, seed, prefill_once=getattr(self.backend, "prefill_once", None))

    @torch.no_grad()
    def rollout(self, prompts: list[dict[str, Any]], group_size: int, seeds: list[int]) -> Rollout:
        self.module.eval()
        prompt_encs = [self.encode(record) for record in prompts]
        comps, lens, gen_lps = zip(*self.backend.generate(self, prompts, prompt_encs, group_size, list(seeds)))
        encs = [enc for enc in prompt_encs for _ in range(group_size)]
        k = max(c.shape[1] for c in comps)
        completions = torch.cat(
            [nn.functional.pad(c, (0, k - c.shape[1]), value=self.tokenizer.pad_token_id) for c in comps]
        )  # [N, K]
        lengths = torch.cat(lens)  # [N]
        mask = torch.arange(k, device=completions.device)[None] < lengths[:, None]  # [N, K]
        completions = torch.where(mask, completions, self.tokenizer.pad_token_id)
        deferred = self.defer_old_logp and not self.check_logp
        if deferred:  # the engine uses the update's first forward instead: one no-grad forward saved
            old_logp = torch.zeros(mask.shape, device=completions.device)  # [N, K]
        else:
            old_logp = self._score(self.module, encs, completions, lengths, group_size)  # [N, K]
        texts = [
            self.tokenizer.decode(c[:n].tolist(), skip_special_tokens=True)
            for c, n in zip(completions, lengths.tolist())
        ]
        extras = {
            "completion_ids": completions,
            "lengths": lengths,
            "prompt_enc": encs,
            "reward_fields": {"lengths": lengths.tolist()},
        }
        if deferred:
            extras["old_logp_deferred"] = True
        if self.iteration is not None:
            extras["reward_fields"]["step"] = [self.iteration] * len(texts)
        metrics = {
            "rollout/length_mean": float(lengths.float().mean()),
            "rollout/truncated_frac": float((lengths == self.s.max_new_tokens).float().mean()),
        }
        if self.check_logp:
            gen = torch.cat([nn.functional.pad(g, (0, k - g.shape[1])) for g in gen_lps])  # [N, K]
            extras["gen_logp"] = torch.where(mask, gen, 0.0)
            metrics["rollout/gen_logp_max_abs_diff"] = float((extras["gen_logp"] - old_logp).abs().max())
        if self.care is not None:
            like = self.care.likelihood(self, encs, completions, lengths, group_size, self.iteration)  # [N]
            extras["reward_fields"]["likelihood"] = like.tolist()
            metrics["care/likelihood_mean"] = float(like.mean())
        return Rollout(samples=texts, old_logp=old_logp.float(), mask=mask, extras=extras, metrics=metrics)

    @torch.no_grad()
    def _score(
        self,
        module: nn.Module,
        encs: list,
        completions: Tensor,
        lengths: Tensor,
        group_size: int,
        groups_per_call: int = 4,
    ) -> Tensor:
        """No-grad log-probs [N, K], a few groups per forward."""
        step = group_size * groups_per_call
        out = [
            module(encs[i : i + step], completions[i : i + step], lengths[i : i + step])[0]
            for i in range(0, len(encs), step)
        ]
        return torch.cat(out)

    # ----- update
    def _batch(self, rollout: Rollout, idx: Tensor) -> tuple[list, Tensor, Tensor]:
        ex = rollout.extras
        ids = idx.tolist()
        return (
            [ex["prompt_enc"][i] for i in ids],
            ex["completion_ids"][idx.to(ex["completion_ids"].device)],
            ex["lengths"][idx.to(ex["lengths"].device)],
        )

    def logp(self, model: nn.Module, rollout: Rollout, idx: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.module.train()
        logp, entropy = model(*self._batch(rollout, idx))  # [n, K] each
        return logp, {"entropy": entropy}

    @torch.no_grad()
    def ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor | None:
        if self.reference == "none":
            raise ValueError(
                "algo.kl_coef > 0 needs a reference policy but pipeline.kwargs.reference=none; set "
                "reference=auto (LoRA: adapter disabled; full fine-tuning: frozen copy) or kl_coef=0"
            )
        batch = self._batch(rollout, idx)
        if self.reference == "adapter":
            with self.module.hf.disable_adapter():
                return self.module(*batch)[0]
        return self.ref_module(*batch)[0]

    # ----- weights
    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Tensor]:
        """LoRA: the peft adapter state (keys as in adapter_model.safetensors); full FT: every trainable weight."""
        if self.is_peft:
            # lazy: peft is heavy to import (seconds); only LoRA runs need it
            from peft import get_peft_model_state_dict

            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.module.hf).items()}
        return {n: p.detach().clone() for n, p in self.module.hf.named_parameters() if p.requires_grad}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(
                f"VLM weights do not match this model (LoRA rank / trainable modules differ): "
                f"missing {missing[:3]}, unexpected {extra[:3]}; load a checkpoint of the same recipe"
            )
        if self.is_peft:
            # lazy: peft is heavy to import (seconds); only LoRA runs need it
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.module.hf, state)
            return
        params = dict(self.module.hf.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def export(self, directory: Path) -> None:
        """LoRA: the peft adapter folder (adapter_model.safetensors + adapter_config.json) that
        `PeftModel.from_pretrained(base, dir)` loads. Full fine-tuning writes nothing: the checkpoint's safetensors
        already hold every trained weight, and a second full copy per checkpoint would double a 7B run's disk."""
        if self.is_peft:
            self.module.hf.save_pretrained(str(directory))

    def gallery(self, rollout: Rollout, prompts: list[dict[str, Any]], rewards: Tensor) -> list[dict[str, Any]]:
        g = len(rollout.samples) // len(prompts)
        items = []
        for i, (text, r) in enumerate(zip(rollout.samples[: 4 * g], rewards.tolist())):
            rec = prompts[i // g]
            item = {"prompt": rec["prompt"], "text": text, "reward": float(r), "answer": str(rec.get("answers"))}
            images = record_images(rec)
            if images and i % g == 0:  # one picture per group
                item["image"] = load_image(images[0])
            items.append(item)
        return items
