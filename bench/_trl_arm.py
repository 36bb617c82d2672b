"""TRL's arm of bench/vlm_vs_trl.py: GRPOTrainer set up on the same model, prompts and settings, its reward (the bench's
tag reward in TRL's calling convention), one optimizer step as `Trainer.train` runs it, and its peak with a fitted
log-prob buffer. Moved out of vlm_vs_trl.py, which re-exports these names. Needs trl (pip install -e .[bench]).
"""

import time
from pathlib import Path
from typing import Any

import torch

from bench._vlm_model import profile_step
from pipelines.vlm.build import FORMAT_INSTRUCTION
from pipelines.vlm.data import load_image

TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def tag_score(text: str) -> float:
    """0.25 per reasoning tag present: a graded format reward a random model already scatters (tags are single ids)."""
    return 0.25 * sum(t in text for t in TAGS)


def trl_reward(completions: list[Any], **_: Any) -> list[float]:
    """The same reward for TRL, whose conversational completions are [{"role": "assistant", "content": text}]."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [tag_score(t if isinstance(t, str) else "".join(p.get("text", "") for p in t)) for t in texts]


def trl_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's conversational dataset rows: the image and the prompt with the format instruction, as the vlm pipeline."""
    return [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": f"{r['prompt']}\n{FORMAT_INSTRUCTION}"}],
                }
            ],
            "image": load_image(r["image"]),
        }
        for r in records
    ]


def trl_trainer(model_dir: str, out_dir: Path, records: list[dict[str, Any]], s: dict[str, Any]):
    """TRL's GRPOTrainer on the same model (float32, SDPA), the same prompts, reward and settings."""
    # lazy: trl and datasets are the optional extra [bench]; transformers is heavy to import (~1 s)
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    n = s["prompts"] * s["group"]
    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=n,
        num_generations=s["group"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=s["lr"],
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=10_000,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        bf16=False,
        fp16=False,
    )
    rows = trl_rows(records)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train's loop sets per optimizer step
    return trainer, rows


class TrlIter:
    """One optimizer step as `Trainer.train` runs it with gradient_accumulation_steps=1: training_step (TRL generates
    and scores the batch inside it, then the loss and backward), gradient clipping, optimizer and scheduler step."""

    def __init__(self, trainer: Any, rows: list[dict[str, Any]], group: int):
        self.trainer, self.split = trainer, []
        self.batch = [row for row in rows for _ in range(group)]  # what TRL's RepeatSampler hands to one step
        gen = trainer._generate_and_score_completions
        self._gen_s = 0.0

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = gen(*a, **kw)
            self._gen_s += time.perf_counter() - t0
            return out

        trainer._generate_and_score_completions = timed

    def __call__(self) -> float:
        tr = self.trainer
        self._gen_s = 0.0
        t0 = time.perf_counter()
        tr.model.train()
        loss = tr.training_step(tr.model, list(self.batch), None)
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tr.args.max_grad_norm)
        tr.optimizer.step()
        tr.lr_scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        tr.state.global_step += 1
        dt = time.perf_counter() - t0
        self.split.append((self._gen_s, dt - self._gen_s))
        return float(loss)


def trl_fitted_peak(tr: TrlIter, trainer: Any) -> int:
    """TRL's peak with its log-prob buffer sized for this model's vocabulary instead of 32768 columns.

    Without Triton (CPU), TRL's chunked log-prob allocates a [min(N, 4096), 32768] float32 tile buffer whatever the
    vocabulary; with a 267-token vocabulary that buffer, not the model, sets TRL's peak. Setting TRL's module constant
    to the vocabulary size gives the same log-probs (the tiles are sliced to the vocabulary) with the buffer a real
    one-chunk logits tensor would take, which is the fair comparison for a small-vocabulary model.
    """
    # lazy: optional extra [bench]
    import trl.trainer.utils as trl_utils

    old = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = int(trainer.model.get_output_embeddings().weight.shape[0])
    try:
        return profile_step(tr)[0]
    finally:
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = old
