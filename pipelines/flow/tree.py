"""BranchGRPO's tree maths on a `RolloutPlan` (arXiv:2509.06040): node depths, rewards fused up the tree, per-depth
advantages, width pruning, and which distinct parent -> child transitions (edges) a trained mask covers.

Leaf i of a group lies under node i // plan.fanout_after(t) at step t, so an edge is (prompt, step, node). The rollout
stores every leaf's whole path; `credit_edges_once` keeps each edge in one row only. `pipelines.flow.plan`
re-exports all of this.
"""

import torch
from torch import Tensor

EDGE_CREDIT = ("once", "per_leaf")
"""once: each distinct tree edge is one loss element (BranchGRPO); per_leaf: every leaf's whole path, so an edge
counts once per leaf below it (the weighting before edge credit existed)"""


def depth_of_steps(plan) -> Tensor:
    """[T] long: how many real splits (fan-out > 1) happened at or before each step; roots are depth 0."""
    splits = torch.tensor([plan.branches.get(t, 1) > 1 for t in range(plan.num_steps)], dtype=torch.long)
    return splits.cumsum(0)


def node_rewards(
    plan, rewards: Tensor, *, fusion: str = "mean", leaf_logp: Tensor | None = None, alpha: float = 1.0
) -> list[Tensor]:
    """Rewards fused up the tree: entry d is [B, nodes at depth d] (BranchGRPO, arXiv:2509.06040).

    mean: a node's reward is the mean of its leaves. prob: bottom-up, r(node) = softmax(alpha * logp(child)) . r(child),
    where logp(child) is the log-prob of the transition that created the child.
    Args:
        rewards: [B, G] leaf rewards.
        leaf_logp: [B, G, T] per-step transition log-probs of each leaf (needed for fusion="prob").
    """
    b, g = rewards.shape
    split_steps = sorted(t for t, f in plan.branches.items() if f > 1)
    widths = [plan.roots] + [g // plan.fanout_after(t) for t in split_steps]  # nodes per depth
    if fusion == "mean":
        return [rewards.view(b, w, g // w).mean(-1) for w in widths]
    if fusion != "prob":
        raise ValueError(f"fusion={fusion!r} must be mean or prob")
    if leaf_logp is None or leaf_logp.shape[:2] != (b, g):
        raise ValueError(
            f"fusion=prob needs leaf_logp [B={b}, G={g}, T], got "
            f"{None if leaf_logp is None else tuple(leaf_logp.shape)}"
        )
    out = [rewards.view(b, w, g // w).mean(-1) for w in widths]
    for d in range(len(widths) - 1, 0, -1):
        t, f = split_steps[d - 1], plan.branches[split_steps[d - 1]]
        edge = leaf_logp[:, :: g // widths[d], t]  # [B, W_d] log-prob of the transition that created each child
        w = torch.softmax(alpha * edge.reshape(b, widths[d - 1], f), -1)  # [B, W_{d-1}, f]
        out[d - 1] = (w * out[d].view(b, widths[d - 1], f)).sum(-1)  # [B, W_{d-1}]
    return out


def normalise_over(r: Tensor, dim: int, eps: float = 1e-8) -> Tensor:
    """(r - mean) / (std + eps) along `dim` with the unbiased std; 0 where std < 1e-6 or `dim` has one entry
    (the group normalisation BranchGRPO and G2RPO share, arXiv:2509.06040 / 2510.01982)."""
    if r.shape[dim] < 2:
        return torch.zeros_like(r)
    std = r.std(dim, keepdim=True)
    return torch.where(std < 1e-6, 0.0, (r - r.mean(dim, keepdim=True)) / (std + eps))


def depth_advantages(
    plan,
    rewards: Tensor,
    steps: Tensor,
    *,
    fusion: str = "mean",
    leaf_logp: Tensor | None = None,
    alpha: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """Per-transition advantages [N, K]: each node's fused reward normalised against the nodes of its depth.

    A = (r_node - mean_depth) / (std_depth + eps) with the unbiased std; 0 where a depth has one node or std < 1e-6.
    With no branching every leaf is its own node at every step, so this is GRPO's group advantage (ddof=1).
    Args:
        rewards: [B, G] leaf rewards.
        steps: [N, K] long, the step of each trained transition (as in PlanResult.steps).
        leaf_logp, alpha: for fusion="prob", see `node_rewards`.
    """
    b, g = rewards.shape
    fused = node_rewards(plan, rewards, fusion=fusion, leaf_logp=leaf_logp, alpha=alpha)
    adv_by_depth = [normalise_over(r, 1, eps) for r in fused]  # [B, W] per depth
    depth = depth_of_steps(plan)[steps]  # [N, K]
    leaf = torch.arange(b * g) % g  # [N] index within the group
    out = torch.zeros(steps.shape, dtype=rewards.dtype)
    for d, a in enumerate(adv_by_depth):
        w = a.shape[1]
        node = (leaf // (g // w))[:, None].expand_as(steps)  # [N, K]
        val = a.repeat_interleave(g, 0).gather(1, node)  # [N, K]
        out = torch.where(depth == d, val, out)
    return out


# ---- width pruning (BranchGRPO): after reward fusion, back-propagate only some leaves; the rollout is unchanged

WIDTH_PRUNE = ("branch_best", "extremes")


def check_width(plan) -> None:
    """Raise ValueError on an unknown width_prune rule, a bad width_keep or branch_best without a split."""
    mode, keep = plan.width_prune, plan.width_keep
    if mode is None:
        return
    if mode not in WIDTH_PRUNE:
        raise ValueError(
            f"plan width_prune={mode!r} is not a width pruning rule; choose {', '.join(WIDTH_PRUNE)} or leave it unset"
        )
    is_count = isinstance(keep, int) and not isinstance(keep, bool)
    if not ((is_count and keep >= 1) or (isinstance(keep, float) and 0 < keep < 1)):
        raise ValueError(f"plan width_keep={keep!r} must be a count >= 1 or a fraction in (0, 1)")
    if mode == "branch_best" and not any(f > 1 for f in plan.branches.values()):
        raise ValueError("plan width_prune='branch_best' needs a split (fan-out > 1); add split_steps or use extremes")


def _keep_count(keep: float, size: float) -> int:
    # a count is taken as given; a fraction of `size` rounds but keeps at least one
    return int(keep) if isinstance(keep, int) else max(1, round(keep * size))


def width_keep_leaves(plan, rewards: Tensor) -> Tensor:
    """[B, G] bool: the leaves BranchGRPO back-propagates (arXiv:2509.06040, --width_pruning_mode 1 and 2).

    branch_best: in each sibling set of the last split, its k highest-reward leaves. extremes: in each group, the k
    lowest and the k highest rewards (k = width_keep, or round(width_keep * G / 2) for a fraction). Ties keep the
    lower index. With width_prune None every leaf is kept.
    Args:
        rewards: [B, G] leaf rewards.
    """
    b, g = rewards.shape
    check_width(plan)
    if plan.width_prune is None:
        return torch.ones(b, g, dtype=torch.bool)
    if plan.width_prune == "branch_best":
        last = max(t for t, f in plan.branches.items() if f > 1)
        sib = plan.branches[last]  # leaves sharing the parent of the last split are contiguous
        k = min(sib, _keep_count(plan.width_keep, sib))
        r = rewards.reshape(b * g // sib, sib)  # [B * G / f, f]
        order = torch.sort(-r, dim=1, stable=True).indices[:, :k]  # [S, k] best first
    else:
        k = min(g, _keep_count(plan.width_keep, g / 2))
        r = rewards  # [B, G]
        asc = torch.sort(r, dim=1, stable=True).indices  # [B, G] worst first
        order = torch.cat([asc[:, :k], asc[:, g - k :]], 1)  # [B, 2k] (overlaps when 2k > G)
    keep = torch.zeros(r.shape, dtype=torch.bool).scatter_(1, order, True)
    return keep.view(b, g)


def width_prune_mask(plan, rewards: Tensor, mask: Tensor) -> Tensor:
    """[N, K] trained mask with the rows of width-pruned leaves set False.

    A shared-prefix transition stays trained in the row of every kept leaf below it, so an edge survives exactly when
    some kept leaf descends from it; an edge whose whole subtree is pruned drops out of the loss.
    Args:
        rewards: [B, G] leaf rewards; mask: [N = B * G, K] bool.
    """
    keep = width_keep_leaves(plan, rewards).reshape(-1)  # [N]
    if keep.shape[0] != mask.shape[0]:
        raise ValueError(f"width pruning: rewards give {keep.shape[0]} leaves but the mask has {mask.shape[0]} rows")
    return mask & keep.to(mask.device)[:, None]  # [N, K]


# ---- edges: which distinct transitions a mask trains


def edge_keys(plan, steps: Tensor, group_size: int) -> Tensor:
    """[N, K] long: one id per distinct transition (prompt, step, node at that step) of each element of `steps`."""
    fan = torch.tensor([plan.fanout_after(t) for t in range(plan.num_steps)])  # [T]
    leaf = torch.arange(steps.shape[0])[:, None].expand_as(steps)  # [N, K]
    node = (leaf % group_size) // fan[steps]  # [N, K] < group_size
    return ((leaf // group_size) * plan.num_steps + steps) * group_size + node  # [N, K]


def credit_edges_once(plan, steps: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """[N, K] bool: `mask` keeping each distinct edge only in the lowest row that trains it (BranchGRPO: every
    parent -> child transition is one loss term with the child's advantage, arXiv:2509.06040).

    Applied after width pruning, that row is the first leaf under the edge that survived it; the set of trained edges
    (`trained_edges`) is unchanged, only the duplicates are dropped.
    Args:
        steps: [N, K] long step of each element; mask: [N, K] bool (leaf paths, depth- and width-pruned).
    """
    m = mask.cpu().bool()
    pos = m.flatten().nonzero().flatten()  # [E] row-major: ascending rows
    out = torch.zeros(m.numel(), dtype=torch.bool)
    if pos.numel():
        key = edge_keys(plan, steps.cpu(), group_size).flatten()[pos]  # [E]
        _, inv = torch.unique(key, return_inverse=True)  # [E] edge id of each element
        first = torch.full((int(inv.max()) + 1,), pos.numel()).scatter_reduce(
            0, inv, torch.arange(pos.numel()), "amin"
        )  # [U]
        out[pos[first]] = True
    return out.view(m.shape).to(mask.device)


def trained_edges(plan, steps: Tensor, mask: Tensor, group_size: int) -> set[tuple[int, int, int]]:
    """The distinct tree transitions (prompt, step, node at that step) with a trained element; for counting work."""
    key = edge_keys(plan, steps.cpu(), group_size)[mask.cpu().bool()]  # [E]
    prompt_step, node = key // group_size, key % group_size
    return {(int(ps) // plan.num_steps, int(ps) % plan.num_steps, int(c)) for ps, c in zip(prompt_step, node)}
