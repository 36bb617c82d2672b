"""SAGE-GRPO's macro level: the dual trust region of the flow policy (a periodically moved anchor reference, and a
per-update constraint to the rollout policy). State lives on the FlowPolicy; these helpers only read and write it.
"""

import contextlib

import torch
from torch import Tensor

from pipelines.flow import sde


class MovingAnchor:
    """The reference a flow policy's KL is taken to: the base model until the first move, then a snapshot of the
    trained weights taken every `every` training steps (SAGE-GRPO arXiv:2603.21872, "periodic moving anchor").

    LoRA keeps the adapter values of the snapshot and swaps them in while the reference scores (base weights are
    shared); full fine-tuning copies the weights into the policy's frozen reference module. The anchor (its step and
    its weights, once moved) is part of the policy's checkpoint state (`state_dict`), so a resumed run scores against
    the same reference as the run that was not interrupted.
    """

    PREFIX = "anchor."

    def __init__(self, every: int):
        self.every, self.at, self.state, self.moved = int(every), None, None, False

    def state_dict(self, policy) -> dict[str, torch.Tensor]:
        """The anchor as flat tensors under "anchor.": its step ("anchor.at") and, once moved, its weights (LoRA: the
        adapter snapshot by parameter name; full fine-tuning: the reference module's state under "anchor.ref.")."""
        if self.every <= 0 or self.at is None:
            return {}
        out = {self.PREFIX + "at": torch.tensor(self.at)}
        if self.moved and policy.lora:
            out |= {f"{self.PREFIX}lora.{n}": v.detach().clone() for n, v in self.state.items()}
        elif self.moved:
            out |= {f"{self.PREFIX}ref.{n}": v.detach().clone() for n, v in policy.ref.state_dict().items()}
        return out

    def load_state_dict(self, policy, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` wrote (a checkpoint without "anchor.at" leaves the anchor fresh)."""
        if self.every <= 0 or self.PREFIX + "at" not in state:
            return
        self.at = int(state[self.PREFIX + "at"])
        lora = {
            k.removeprefix(self.PREFIX + "lora."): v for k, v in state.items() if k.startswith(self.PREFIX + "lora.")
        }
        ref = {k.removeprefix(self.PREFIX + "ref."): v for k, v in state.items() if k.startswith(self.PREFIX + "ref.")}
        self.moved = bool(lora or ref)
        self.state = {n: v.clone() for n, v in lora.items()} or None
        if ref:
            with torch.no_grad():
                policy.ref.load_state_dict(ref)

    def update(self, policy, iteration: int) -> bool:
        """Move the anchor to the current weights when `every` steps have passed since the last move; True if moved."""
        if self.every <= 0:
            return False
        if self.at is None:  # first call: a fresh run (0) keeps the base reference, a resumed run anchors here
            self.at = iteration
            if iteration == 0:
                return False
        elif iteration - self.at < self.every:
            return False
        self.at, self.moved = iteration, True
        with torch.no_grad():
            if policy.lora:
                self.state = {
                    n: p.detach().clone() for n, p in policy.transformer.named_parameters() if p.requires_grad
                }
            else:
                policy.ref.load_state_dict(policy.transformer.state_dict())
        return True

    @contextlib.contextmanager
    def weights(self, policy):
        """LoRA with a snapshot: the anchor's adapter values in place while the body runs, the trained ones after."""
        if not (policy.lora and self.state):
            yield
            return
        params = dict(policy.transformer.named_parameters())
        with torch.no_grad():
            saved = {n: params[n].detach().clone() for n in self.state}
            try:
                for n, value in self.state.items():
                    params[n].copy_(value)
                yield
            finally:
                for n, value in saved.items():
                    params[n].copy_(value)


def step_kl(out: sde.StepOut, old_mean: Tensor, reduce: str) -> Tensor:
    """SAGE-GRPO's per-update ("stepwise") constraint: KL(N(mean, std^2) || N(mean_old, std^2)) per transition [E].

    Paper: SAGE-GRPO arXiv:2603.21872 (the dual trust region's velocity term, our reading: the KL to the policy that
    rolled the batch out, alongside the position term, the KL to the moving anchor). Formula: reduce_d
    (mean - mean_old)^2 / (2 std^2) (sde.kl_gaussian). It is 0 with zero gradient at the rollout weights, so it acts
    from the second mini-batch or inner epoch on. Args: out [E] scored transitions; old_mean [E, ...].
    """
    return sde.kl_gaussian(out.mean, old_mean.to(out.mean), out.std, reduce)
