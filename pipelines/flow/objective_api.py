"""The flow objective interface, typed both ways: FlowObjective is all FlowPolicy calls (so the policy never names an
objective), and ObjectivePolicy is all an objective may read or call on the policy that called it."""

from typing import Protocol

from torch import Tensor, nn

from mmgrpo.types import Rollout
from pipelines.flow.models import FlowModel
from pipelines.flow.plan import PlanResult, RolloutPlan


class ObjectivePolicy(Protocol):
    """What an objective uses of FlowPolicy: the schedule, the iteration, the model adapter and denoiser, and the
    likelihood path of the kept SDE transitions (objective grpo delegates to it: it needs the policy's reference,
    adapters, trust region and GRPO-Guard switches)."""

    sigmas: Tensor  # [T+1] the sampling schedule's noise levels
    iteration: int  # the training iteration (seeds NFT's forward-process noise)
    model: FlowModel  # the model family's adapter (SD3, FLUX, Wan, UNet)
    transformer: nn.Module  # the denoiser being trained

    def transition_rollout(
        self, plan: RolloutPlan, res: PlanResult, samples: list, cond: dict[str, Tensor], group_size: int
    ) -> Rollout: ...

    def transition_logp(
        self, model: nn.Module, rollout: Rollout, idx: Tensor, ks: slice
    ) -> tuple[Tensor, dict[str, Tensor]]: ...

    def transition_ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor | None: ...


class FlowObjective(Protocol):
    """What a flow policy trains on: the one interface FlowPolicy calls, so the policy never names an objective.

    `policy` is the calling FlowPolicy, seen through ObjectivePolicy.
    """

    def trained(self, trained: Tensor) -> Tensor:
        """[N, T] bool: which of the plan's transitions the rollout keeps, from the plan's choice `trained`."""

    def rollout(
        self,
        policy: ObjectivePolicy,
        plan: RolloutPlan,
        res: PlanResult,
        samples: list,
        cond: dict[str, Tensor],
        group_size: int,
        seeds: list[int],
    ) -> Rollout:
        """The Rollout of a run plan: reward samples plus this objective's training inputs in extras."""

    def logp(
        self, policy: ObjectivePolicy, model: nn.Module, rollout: Rollout, idx: Tensor, ks: slice
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[n, k] log-probs through `model` and the aux dict (kl, loss_kwargs) the trainer reads."""

    def ref_logp(self, policy: ObjectivePolicy, rollout: Rollout, idx: Tensor) -> Tensor | None:
        """[n, K] reference log-probs, or None when the objective has no KL term."""
