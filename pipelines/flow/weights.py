"""The flow policy's weights (FlowPolicy inherits them): what trains, the state a checkpoint holds (the LoRA adapter or
the full transformer, plus SAGE-GRPO's moving anchor) and the diffusers LoRA export. Moved out of policy.py verbatim.
"""

from collections.abc import Iterable
from pathlib import Path

from torch import Tensor, nn

from pipelines.flow import trust


class FlowWeights:
    """Weights methods of `FlowPolicy`; they read its transformer, lora, pipe and anchor attributes."""

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Tensor]:
        """The peft adapter state (LoRA) or the full transformer state (full fine-tuning), detached copies; plus
        SAGE-GRPO's moving anchor under "anchor." when it is on (trust.MovingAnchor.state_dict)."""
        if self.lora:
            # lazy: peft is heavy to import (seconds); only LoRA runs need it
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.transformer)
        else:
            state = self.transformer.state_dict()
        return {k: v.detach().clone() for k, v in state.items()} | self.anchor.state_dict(self)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        anchor = {k: v for k, v in state.items() if k.startswith(trust.MovingAnchor.PREFIX)}
        state = {k: v for k, v in state.items() if k not in anchor}
        self.anchor.load_state_dict(self, anchor)  # a policy without a moving anchor ignores a saved one
        if self.lora:
            # lazy: peft is heavy to import (seconds); only LoRA runs need it
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.transformer, state)
            bad = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
            if bad:
                raise ValueError(
                    f"adapter state has keys this model lacks ({bad[:3]}...); was it saved with other lora_targets?"
                )
        else:
            self.transformer.load_state_dict(state)

    def save_lora(self, path: str) -> None:
        """Write the adapter as diffusers LoRA weights (pytorch_lora_weights.safetensors) for `load_lora_weights`."""
        if not self.lora:
            raise ValueError(
                "save_lora needs a LoRA policy (lora_rank > 0); full fine-tuning saves the transformer "
                "with transformer.save_pretrained instead"
            )
        # the adapter config (rank, alpha, targets) travels as metadata: without it a loader assumes alpha = rank
        meta = self.transformer.peft_config["default"].to_dict()
        name = "transformer" if getattr(self.pipe, "transformer", None) is not None else "unet"
        type(self.pipe).save_lora_weights(
            save_directory=path, **{f"{name}_lora_layers": self.state_dict(), f"{name}_lora_adapter_metadata": meta}
        )

    def export(self, directory: Path) -> None:
        """Each checkpoint's export/: with LoRA on a diffusers pipeline, the adapter as `load_lora_weights` reads it.
        Full fine-tuning (and the pixel-space ShapesWorld model, which has no pipeline class) writes nothing more:
        the checkpoint's safetensors already hold every trained weight."""
        if self.lora and hasattr(type(self.pipe), "save_lora_weights"):
            self.save_lora(str(directory))
