"""The video `Policy`: the VLM policy with video inputs (frames sampled and read by pipelines/video/io.py, encoded by the
Qwen2-VL / Qwen2.5-VL video processor with `second_per_grid_ts`), plus the rollout-time parts of the video methods.

Log-probs, the prefix-shared forward (vision tower once per group), references and weights are the VLM policy's.
Rollout extras: completion_ids, lengths, prompt_enc (as the VLM's), injected [N] bool (TempSamp ground truth).
"""

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from transformers.video_utils import VideoMetadata

from mmgrpo.types import Rollout
from pipelines.video import methods as vm
from pipelines.video.io import frame_indices, read_frames, video_info
from pipelines.video.settings import FrameSettings, MethodSettings
from pipelines.vlm.methods import answer_token_mask
from pipelines.vlm.policy import VLMPolicy
from rewards import load


class VideoPolicy(VLMPolicy):
    """`Policy` for a video-text-to-text model; see the module docstring."""

    def __init__(
        self, module: nn.Module, processor: Any, *, frames: FrameSettings, methods: MethodSettings, **vlm_kwargs: Any
    ):
        super().__init__(module, processor, **vlm_kwargs)
        self.frames, self.m = frames, methods
        self.augment_reward = None
        self.evaluating = False  # set by for_evaluation
        if methods.augment:
            spec = methods.augment_reward
            name, kw = (spec, {}) if isinstance(spec, str) else (spec["name"], dict(spec.get("kwargs") or {}))
            self.augment_reward = load(name, **kw)

    def for_evaluation(self) -> None:
        """Called by `mmgrpo eval` / `sample`: rollouts become plain on-policy samples. Ground-truth injection would
        put the answer into every scored group, and shuffled-frame passes and noise augmentation are training
        signals, not what a user measures."""
        self.m = dataclasses.replace(self.m, inject_ground_truth=False, temporal="none", augment=False)
        self.augment_reward = None
        self.evaluating = True  # tells T-GRPO's reward that its shuffled-frame signal is off on purpose

    def _context_fields(self, n: int) -> dict[str, list]:
        """Reward fields about the run, one per sample: the training step (annealed rewards), and under `mmgrpo eval`
        that T-GRPO's shuffled-frame pass is off on purpose (temporal_contrast then scores 0)."""
        out: dict[str, list] = {} if self.iteration is None else {"step": [self.iteration] * n}
        return out | ({"temporal_off": [True] * n} if self.evaluating else {})

    # ----- prompts
    def encode(
        self, record: dict[str, Any], *, seed: int = 0, shuffle_seed: int | None = None, noise_seed: int | None = None
    ) -> dict[str, Any]:
        """Processor inputs (batch of 1, on the device) for one record: sampled frames (optionally noisier or shuffled)
        with their metadata, so Qwen2.5-VL's `second_per_grid_ts` follows the real sampling rate."""
        f = self.frames
        info = video_info(record["video"], backend=f.backend)
        idx = frame_indices(info, f, seed=seed)
        frames, times = read_frames(info.path, idx, backend=f.backend, cache_dir=f.cache_dir, info=info)
        if noise_seed is not None:
            frames = vm.noisier(frames, std=self.m.augment_noise, seed=noise_seed)
        if shuffle_seed is not None:
            frames = frames[vm.shuffle_order(len(frames), shuffle_seed)]
        text = record["prompt"] if not self.s.instruction else f"{record['prompt']}\n{self.s.instruction}"
        messages = [{"role": "system", "content": self.s.system_prompt}] if self.s.system_prompt else []
        messages.append({"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]})
        chat = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        meta = VideoMetadata(
            total_num_frames=info.num_frames,
            fps=info.fps,
            frames_indices=idx.tolist(),
            duration=info.duration,
            height=info.height,
            width=info.width,
        )
        enc = self.processor(
            text=[chat],
            videos=[frames],
            video_metadata=[meta],
            do_sample_frames=False,
            cap_pixels_per_frame=True,
            return_tensors="pt",
        )
        out = {k: v.to(self.device) for k, v in enc.items() if isinstance(v, Tensor)}
        out["_timestamps"] = times  # seconds of each sampled frame (numpy, never reaches the model)
        return out

    # ----- rollout
    def _sample(self, enc: dict[str, Any], n: int, seed: int) -> tuple[Tensor, Tensor]:
        comp, lengths, _ = self._generate_group(enc, n, seed)
        return comp, lengths

    def _texts(self, comp: Tensor, lengths: Tensor) -> list[str]:
        return [
            self.tokenizer.decode(c[:n].tolist(), skip_special_tokens=True) for c, n in zip(comp, lengths.tolist())
        ]

    def _augment(self, record: dict, enc: dict, comp: Tensor, lengths: Tensor, seed: int):
        """DeepVideo-R1: re-pose a group whose samples all pass (noisier frames) or all fail (a hint), and resample."""
        texts = self._texts(comp, lengths)
        fields = {k: [record.get(k)] * len(texts) for k in self.augment_reward.fields if record.get(k) is not None}
        scores = self.augment_reward(texts, **fields).tolist()
        level = vm.difficulty(scores, easy_min=self.m.augment_easy_min, hard_max=self.m.augment_hard_max)
        view = {"record": record, "noise_seed": None}
        if level is None:
            return enc, comp, lengths, view, level
        if level == "hard":
            view["record"] = vm.with_hint(record)
        else:
            view["noise_seed"] = seed + 3
        enc = self.encode(view["record"], seed=seed, noise_seed=view["noise_seed"])
        comp, lengths = self._sample(enc, comp.shape[0], seed + 4)
        return enc, comp, lengths, view, level

    def _match_generate_calls(self, resampled: int, enc: dict[str, Any]) -> None:
        """Under FSDP each generate call all-gathers the sharded weights, so every rank must make as many calls: a rank
        that re-posed fewer groups than another (augmentation is per group) runs the difference as 1-sample calls."""
        if not self.synced_gpus():
            return
        most = torch.tensor([resampled], device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        for _ in range(int(most) - resampled):
            self._sample(enc, 1, 0)  # output discarded: only the collective calls matter

    def _ground_truth(self, record: dict[str, Any]) -> Tensor:
        """Token ids [1, T] of the injected ground-truth completion; ends at its stop string, or with EOS."""
        text = vm.ground_truth_text(record, span_template=self.m.span_template, answer_template=self.m.answer_template)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not any(text.endswith(s) for s in self.s.stop):
            ids = ids + [int(self.tokenizer.eos_token_id)]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @staticmethod
    def _pad_cat(parts: list[Tensor], pad: int) -> Tensor:
        k = max(p.shape[1] for p in parts)
        return torch.cat([nn.functional.pad(p, (0, k - p.shape[1]), value=pad) for p in parts])

    def _group(self, record: dict[str, Any], seed: int, group_size: int) -> dict[str, Any]:
        """One prompt's group: encoding, G completions (augmented, ground truth injected) and shuffled-frame view."""
        m = self.m
        enc = self.encode(record, seed=seed)
        n_gen = group_size - 1 if m.inject_ground_truth else group_size
        comp, lengths = self._sample(enc, n_gen, seed)  # [n_gen, K], [n_gen]
        view, level = {"record": record, "noise_seed": None}, None
        if self.augment_reward is not None:
            enc, comp, lengths, view, level = self._augment(record, enc, comp, lengths, seed)
        flags = [False] * n_gen
        if m.inject_ground_truth:
            gt = self._ground_truth(record)  # [1, T]
            comp = self._pad_cat([comp, gt], self.tokenizer.pad_token_id)  # [G, K]
            lengths = torch.cat([lengths, torch.tensor([gt.shape[1]], device=lengths.device)])  # [G]
            flags.append(True)
        shuf = shuffled = None
        if m.temporal != "none":
            shuf = self.encode(view["record"], seed=seed, noise_seed=view["noise_seed"], shuffle_seed=seed + 1)
            if m.temporal == "generate":
                s_comp, s_len = self._sample(shuf, m.temporal_samples or max(group_size // 2, 1), seed + 2)
                shuffled = self._texts(s_comp, s_len)
        return {
            "enc": enc,
            "comp": comp,
            "lengths": lengths,
            "flags": flags,
            "shuf": shuf,
            "shuffled": shuffled,
            "level": level,
        }

    @torch.no_grad()
    def rollout(self, prompts: list[dict[str, Any]], group_size: int, seeds: list[int]) -> Rollout:
        self.module.eval()
        m, pad = self.m, self.tokenizer.pad_token_id
        if m.inject_ground_truth and group_size < 2:
            raise ValueError(
                f"inject_ground_truth needs sample.group_size >= 2 (G - 1 sampled + 1 ground truth), got {group_size}"
            )
        groups = [self._group(record, int(seed), group_size) for record, seed in zip(prompts, seeds)]
        encs = [g["enc"] for g in groups for _ in range(group_size)]
        levels = [g["level"] for g in groups] if self.augment_reward is not None else []
        if levels:
            self._match_generate_calls(sum(lv is not None for lv in levels), encs[-1])
        completions = self._pad_cat([g["comp"] for g in groups], pad)  # [N, K]
        lengths = torch.cat([g["lengths"] for g in groups])  # [N]
        mask = torch.arange(completions.shape[1], device=completions.device)[None] < lengths[:, None]  # [N, K]
        completions = torch.where(mask, completions, pad)  # [N, K]
        # old_logp of every member, the injected ground truth included, is its log-prob under the rollout policy from
        # this forward pass: the first ratio is exactly 1 and clipping bounds the move away from that policy
        old_logp = self._score(self.module, encs, completions, lengths, group_size)  # [N, K]
        texts = self._texts(completions, lengths)
        inj = torch.tensor([f for g in groups for f in g["flags"]], dtype=torch.bool)  # [N]
        extras = {
            "completion_ids": completions,
            "lengths": lengths,
            "prompt_enc": encs,
            "injected": inj,
            "reward_fields": {"lengths": lengths.tolist()},
        }
        metrics = {
            "rollout/length_mean": float(lengths.float().mean()),
            "rollout/truncated_frac": float((lengths == self.s.max_new_tokens).float().mean()),
            "video/frames_mean": sum(len(e["_timestamps"]) for e in encs) / len(encs),
        }
        extras["reward_fields"].update(self._context_fields(len(texts)))
        if m.temporal == "generate":
            extras["reward_fields"]["shuffled_samples"] = [g["shuffled"] for g in groups for _ in range(group_size)]
        if m.temporal == "logp_gap":
            shuffled_encs = [g["shuf"] for g in groups for _ in range(group_size)]
            gap = self._logp_gap(old_logp, shuffled_encs, completions, lengths, mask, group_size)  # [N]
            extras["reward_fields"]["temporal_gap"] = gap.tolist()
            metrics["temporal/gap_mean"] = float(gap.mean())
        if levels:
            metrics["augment/hard_frac"] = sum(lv == "hard" for lv in levels) / len(levels)
            metrics["augment/easy_frac"] = sum(lv == "easy" for lv in levels) / len(levels)
        if m.inject_ground_truth:
            metrics["gt/logp_mean"] = float(old_logp[inj].sum() / mask[inj].sum().clamp(min=1))
        if self.care is not None:
            like = self.care.likelihood(self, encs, completions, lengths, group_size, self.iteration)  # [N]
            extras["reward_fields"]["likelihood"] = like.tolist()
            metrics["care/likelihood_mean"] = float(like.mean())
        return Rollout(samples=texts, old_logp=old_logp.float(), mask=mask, extras=extras, metrics=metrics)

    def _logp_gap(
        self,
        old_logp: Tensor,
        shuffled_encs: list,
        completions: Tensor,
        lengths: Tensor,
        mask: Tensor,
        group_size: int,
    ) -> Tensor:
        """[N] mean over each answer's tokens (the whole completion when it has no answer) of log pi(ordered) -
        log pi(shuffled): one extra forward of the same completions, no generation."""
        shuffled = self._score(self.module, shuffled_encs, completions, lengths, group_size)  # [N, K]
        pieces = [[self.tokenizer.decode([t]) for t in c[:n].tolist()] for c, n in zip(completions, lengths.tolist())]
        ans = answer_token_mask(pieces).to(mask.device)  # [N, K']
        ans = nn.functional.pad(ans, (0, mask.shape[1] - ans.shape[1])) & mask  # [N, K]
        use = torch.where(ans.any(1, keepdim=True), ans, mask)  # [N, K]
        diff = torch.where(use, old_logp.float() - shuffled.float(), 0.0)  # [N, K]
        return (diff.sum(1) / use.sum(1).clamp(min=1)).cpu()  # [N]
