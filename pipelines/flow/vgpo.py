"""VGPO's dense per-step values from shared-prefix rollouts and the value-anchored per-step advantages built on them.

Tree maths on a `RolloutPlan` (tree.py's node layout); the anchored normalisation itself is mmgrpo.advantages'.
"""

import torch
from torch import Tensor

from mmgrpo.advantages.anchored import value_anchored
from pipelines.flow.tree import depth_of_steps, node_rewards

ANCHOR_KEYS = ("anchor", "scale", "alpha")
"""pipeline.kwargs.value_anchor keys: value_anchored's keywords"""


def step_values(
    plan, rewards: Tensor, steps: Tensor, *, fusion: str = "mean", leaf_logp: Tensor | None = None, alpha: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Monte-Carlo values of each trained transition's state before (v) and after (q) it: ([N, K], [N, K]).

    Paper: VGPO arXiv:2512.12387 ("expected cumulative reward at each generative stage"). Estimator (our choice, the
    abstract names none): a node of the rollout tree is a state x_t shared by the leaves below it, so the mean of
    their terminal rewards is an unbiased Monte-Carlo estimate of E[r | x_t] under the rollout policy; no value head
    to train, no extra reward calls. The transition at step t of a leaf lies on the edge into its node at depth
    d = depth(t) (splits at or before t): q = V(node_d), v = V(node_{d-1}) with V(node_{-1}) = the prompt group's
    mean. Inside an edge the tree has no finer value resolution, so every step of an edge gets the edge's values
    (BranchGRPO's edge credit). Independent groups (no split) reduce to q = r, v = mean: the group estimator.
    fusion / leaf_logp / alpha: node values as tree.node_rewards (mean, or BranchGRPO's prob fusion).

    Args:
        rewards: [B, G] leaf rewards.
        steps: [N, K] long, the denoising step of each trained transition (N = B * G, leaf-major per prompt).

    Returns:
        (q, v): [N, K] float64 values after and before each transition.
    """
    b, g = rewards.shape
    if steps.shape[0] != b * g:
        raise ValueError(f"steps {tuple(steps.shape)} must have N = B * G = {b * g} rows, one per leaf")
    fused = [node.double() for node in node_rewards(plan, rewards, fusion=fusion, leaf_logp=leaf_logp, alpha=alpha)]
    levels = [rewards.double().mean(-1, keepdim=True), *fused]  # level 0: the prompt group, then depth 0, 1, ...
    depth = depth_of_steps(plan).to(steps.device)[steps]  # [N, K]
    leaf = (torch.arange(b * g, device=steps.device) % g)[:, None].expand_as(steps)  # [N, K]
    prompt = torch.arange(b * g, device=steps.device) // g  # [N]

    def value_at(level: Tensor) -> Tensor:  # [N, K] the value of each transition's node at `level` (+1 shifted)
        out = torch.zeros(steps.shape, dtype=torch.float64, device=steps.device)
        for lv, vals in enumerate(levels):
            w = vals.shape[1]
            node = leaf // (g // w)  # [N, K]
            out = torch.where(level == lv, vals.to(steps.device)[prompt].gather(1, node), out)
        return out

    return value_at(depth + 1), value_at(depth)


def vgpo_step_advantages(
    plan,
    rewards: Tensor,
    steps: Tensor,
    *,
    anchor: float = 0.0,
    scale: float = 0.1,
    alpha: float | None = None,
    fusion: str = "mean",
    leaf_logp: Tensor | None = None,
    fusion_alpha: float = 1.0,
) -> Tensor:
    """VGPO per-step advantages [N, K]: value_anchored(q, v, sigma_b) with the tree values of `step_values`.

    Paper: VGPO arXiv:2512.12387. Formula: A_{n,k} = (q - (1 - a_w) v - a_w anchor) / sqrt(sigma_b^2 + s^2),
    a_w = s^2 / (sigma_b^2 + s^2), sigma_b the prompt group's leaf reward std (ddof 1; 0 for a flat group).
    Along a leaf's path the relative parts (q - v) telescope to r - mean_b, so the trained steps split the GRPO
    credit by where the value was gained; a flat group still gets (mean_b - anchor) / s at every step.

    Args:
        rewards: [B, G] leaf rewards; steps: [N, K] trained steps; anchor, scale, alpha: see value_anchored.
        fusion, leaf_logp, fusion_alpha: node values (see step_values).
    Returns:
        [N, K] float32.
    """
    q, v = step_values(plan, rewards, steps, fusion=fusion, leaf_logp=leaf_logp, alpha=fusion_alpha)
    r = rewards.double()
    flat = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)  # [B, 1]
    std = r.std(-1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])  # [B, 1]
    std = torch.where(flat, 0.0, std).repeat_interleave(r.shape[1], 0).to(q.device)  # [N, 1]
    return value_anchored(q, v, std, anchor=anchor, scale=scale, alpha=alpha).float()  # [N, K]
