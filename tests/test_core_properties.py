"""Cross-cutting contracts of the core maths (issue 2, item 7): every estimator on equal-reward groups and G = 1,
[B, G] vs flattened (verl-style uid) equivalence, KL with masked garbage and under gradient accumulation, the
MC-GRPO authors' rescale, the issue's signatures, unknown names, and the docs' "Core maths" listing (docs/maths.md).

Expected values come from plain-Python references (statistics module, dicts keyed by prompt uid) or are worked by
hand in the comments; nothing is copied from running the code under test.
"""

import inspect
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from mmgrpo import advantages as A
from mmgrpo import losses, sampling
from mmgrpo.advantages import ADVANTAGES, compute, loss_mask
from mmgrpo.losses import aggregate, denominator, kl, policy_loss

F64 = torch.float64
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
MATHS_DOC = Path(__file__).resolve().parents[1] / "docs" / "maths.md"

# every core estimator, with option sets that take different code paths (eps = 0 where the estimator allows it)
ESTIMATORS = [
    ("grpo", {}),
    ("grpo", {"std": "batch", "eps": 0.0, "ddof": 0}),
    ("grpo", {"std": "none"}),
    ("rloo", {}),
    ("mc_grpo", {}),
    ("mc_grpo", {"scale": "std", "eps": 0.0}),
    ("mc_grpo", {"rescale_nonzero": True}),
    ("passk", {"eps": 0.0}),
    ("gdpo", {"eps": 0.0}),
    ("gdpo", {"batch_norm": False}),
    ("winrate", {"eps": 0.0}),
    (
        "asymmetric",
        {"accuracy_gate": 1.0, "difficulty_focus": True, "pos_scale": 0.5, "neg_scale_end": 2.0, "progress": 0.5},
    ),
]


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _constant_groups(name: str, G: int) -> torch.Tensor:
    """Two prompts whose G samples all score the same (0.1 and 0.7: 3 x 0.1 != 0.3 in floats)."""
    kind = ADVANTAGES.meta(name)["input"]
    if kind == "pairwise":  # every pair tied; the diagonal is ignored
        return torch.full((2, G, G), 0.5, dtype=F64)
    r = t([[0.1] * G, [0.7] * G])  # [2, G]
    return torch.stack([r, 1 - r], dim=-1) if kind == "multi" else r  # [2, G, 2] or [2, G]


@pytest.mark.parametrize("name, kw", ESTIMATORS)
@pytest.mark.parametrize("G", [2, 3, 5])
def test_equal_reward_groups_give_exact_zero(name, kw, G):
    adv = compute(name, _constant_groups(name, G), **kw)
    assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(2, G))


@pytest.mark.parametrize("name, kw", ESTIMATORS)
def test_singleton_groups_give_zero(name, kw):
    kind = ADVANTAGES.meta(name)["input"]
    x = {"scalar": t([[0.3], [0.9]]), "multi": t([[[0.3, 1.0]], [[0.9, 0.0]]]), "pairwise": t([[[0.5]], [[0.5]]])}
    adv = compute(name, x[kind], **kw)
    assert torch.equal(adv, torch.zeros(2, 1))


# ---------------------------------------------------------------- [B, G] vs flattened with prompt uids (verl layout)


def _by_uid(uid: list[int]) -> dict[int, list[int]]:
    groups = defaultdict(list)
    for i, u in enumerate(uid):
        groups[u].append(i)
    return groups


def _flat_reference(name: str, kw: dict, flat: list, uid: list[int]) -> list[float]:
    """Advantages of a flat, shuffled batch where uid[i] names sample i's prompt (verl's `index`)."""
    out = [0.0] * len(flat)
    groups = _by_uid(uid)
    stdev = statistics.stdev if kw.get("ddof", 1) == 1 else statistics.pstdev
    batch_std = stdev(flat) if name == "grpo" else None
    for rows in groups.values():
        vals = [flat[i] for i in rows]
        if name == "grpo":
            s = {"group": stdev(vals), "batch": batch_std, "none": None}[kw.get("std", "group")]
            adv = [(v - statistics.mean(vals)) / (1.0 if s is None else s + kw.get("eps", 1e-6)) for v in vals]
        elif name == "rloo":
            adv = [v - (sum(vals) - v) / (len(vals) - 1) for v in vals]
        elif name == "mc_grpo":
            med = statistics.median(vals)
            mad = statistics.median([abs(v - med) for v in vals])
            adv = [(v - med) / (mad + 1e-3) for v in vals]
        elif name == "passk":  # only the best moves, by its margin over the runner-up, over the group std
            top = sorted(vals, reverse=True)
            adv = [(v - top[1]) / (stdev(vals) + 1e-6) if v == top[0] else 0.0 for v in vals]
        elif name == "gdpo":  # per reward column: z-score within the group; weighted sum (weights 1, .5)
            cols = list(zip(*vals))
            z = [[(x - statistics.mean(c)) / (statistics.stdev(c) + 1e-6) for x in c] for c in cols]
            adv = [z[0][g] + 0.5 * z[1][g] for g in range(len(vals))]
        for i, a in zip(rows, adv):
            out[i] = a
    if name == "gdpo":  # then whiten over the whole batch
        m, s = statistics.mean(out), statistics.stdev(out)
        out = [(a - m) / (s + 1e-6) for a in out]
    return out


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {}),
        ("grpo", {"ddof": 0, "eps": 1e-4}),
        ("grpo", {"std": "batch"}),
        ("grpo", {"std": "batch", "ddof": 0}),
        ("grpo", {"std": "none"}),
        ("rloo", {}),
        ("mc_grpo", {}),
        ("passk", {}),
        ("gdpo", {"weights": [1.0, 0.5]}),
    ],
)
def test_batched_equals_flattened_shuffled_reference(name, kw):
    B, G = 4, 5
    gen = torch.Generator().manual_seed(0)
    multi = name == "gdpo"
    r = torch.rand((B, G, 2) if multi else (B, G), generator=gen, dtype=F64)
    perm = torch.randperm(B * G, generator=gen).tolist()
    flat_all = r.reshape(B * G, -1).tolist() if multi else r.reshape(-1).tolist()  # sample b*G + g
    flat = [flat_all[p] for p in perm]
    uid = [p // G for p in perm]
    expected = [0.0] * (B * G)
    for i, a in zip(perm, _flat_reference(name, kw, flat, uid)):
        expected[i] = a  # back to [B, G] order
    assert_close(compute(name, r, **kw).reshape(-1).double(), t(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {}),
        ("grpo", {"std": "none"}),
        ("rloo", {}),
        ("mc_grpo", {}),
        ("passk", {}),
        ("winrate", {}),
        ("gdpo", {"batch_norm": False}),
        ("asymmetric", {"pos_scale": 0.5, "neg_scale": 2.0}),
    ],
)
def test_group_local_estimators_treat_each_row_alone(name, kw):
    x = _random_input(name)
    adv = compute(name, x, **kw)
    for b in range(x.shape[0]):
        assert_close(compute(name, x[b : b + 1], **kw), adv[b : b + 1])


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {"std": "batch"}),
        ("gdpo", {}),
        ("asymmetric", {"accuracy_gate": 1.0}),
    ],
)
def test_batch_coupled_options_do_depend_on_other_rows(name, kw):
    # the row-by-row check above can fail: these options use statistics of the whole batch
    x = _random_input(name)
    assert not torch.allclose(compute(name, x[:1], **kw), compute(name, x, **kw)[:1])


def _random_input(name: str, B: int = 3, G: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    kind = ADVANTAGES.meta(name)["input"]
    if kind == "pairwise":
        P = torch.triu(torch.randint(0, 3, (B, G, G), generator=gen).double() / 2, 1)
        return P + torch.tril(1 - P.transpose(1, 2), -1)
    return torch.rand((B, G, 2) if kind == "multi" else (B, G), generator=gen, dtype=F64)


# ---------------------------------------------------------------- MC-GRPO authors' non-zero rescale (arXiv:2601.22582)


def test_mc_grpo_rescale_nonzero_golden():
    # [[3,1,2,2,9]]: sorted 1 2 2 3 9 -> median 2; centred [1,-1,0,0,7]; |dev| sorted 0 0 1 1 7 -> MAD 1
    # 3 of 5 samples differ from the median -> x 5/3: [5/3, -5/3, 0, 0, 35/3] / (1 + 1e-3); pivot = index 2
    r = t([[3, 1, 2, 2, 9]])
    k = 5 / 3 / 1.001
    assert_close(compute("mc_grpo", r, rescale_nonzero=True).double(), t([[k, -k, 0, 0, 7 * k]]))
    assert loss_mask("mc_grpo", r, rescale_nonzero=True).tolist() == [[True, True, False, True, True]]
    # binary [[1,0,0]]: median 0, MAD 0 -> 1 / 1e-3 = 1000; one non-zero of 3 -> x 3 = 3000
    assert_close(compute("mc_grpo", t([[1, 0, 0]]), rescale_nonzero=True).double(), t([[3000.0, 0, 0]]))
    # scale="none": [1,-1,0,0,7] x 5/3 exactly
    assert_close(
        compute("mc_grpo", r, scale="none", rescale_nonzero=True).double(), t([[5 / 3, -5 / 3, 0, 0, 35 / 3]])
    )
    with pytest.raises(ValueError, match="rescale_nonzero"):
        compute("mc_grpo", r, rescale_nonzero=1)


# ---------------------------------------------------------------- KL with a mask (joschu.net/blog/kl-approx.html)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp", [None, 10.0])
def test_kl_mask_zeroes_value_and_gradient_of_garbage(kind, clamp):
    # unmasked element: logp 0, ref ln 2 -> d = ln 2: k1 = -ln 2, k2 = (ln 2)^2 / 2, k3 = 2 - ln 2 - 1 = 1 - ln 2
    # d k/d logp there: k1 -> 1, k2 -> -(ref - logp) = -ln 2, k3 -> 1 - e^d = -1
    ln2 = math.log(2)
    value = {"k1": -ln2, "k2": ln2**2 / 2, "k3": 1 - ln2}[kind]
    grad = {"k1": 1.0, "k2": -ln2, "k3": -1.0}[kind]
    logp = t([[0.0, float("-inf")], [float("nan"), 5.0]]).requires_grad_()
    ref = t([[ln2, 0.0], [0.0, float("nan")]])
    mask = torch.tensor([[True, False], [False, False]])  # row 1 fully masked
    out = kl(logp, ref, kind, mask=mask, clamp=clamp)
    assert_close(out, t([[value, 0.0], [0.0, 0.0]]))
    for mode in MODES:
        (g,) = torch.autograd.grad(aggregate(out, mask, mode, norm_len=2), logp, retain_graph=True)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    out.sum().backward()
    assert_close(logp.grad, t([[grad, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"mask \(1, 2\) != logp \(2, 2\)"):
        kl(logp, ref, kind, mask=mask[:1])


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_plus_kl_two_micro_batches_equal_one_batch(mode):
    # loss + beta * k3 aggregated with the global denominator: the sum of two micro-batch gradients is the
    # one-batch gradient, with padding that holds -inf and a fully masked row
    n, k, beta = 6, 4, 0.05
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(n, k, generator=gen, dtype=F64) * 0.1
    ref = old + torch.randn(n, k, generator=gen, dtype=F64) * 0.2
    base = old + torch.randn(n, k, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(n, generator=gen, dtype=F64)
    mask = torch.arange(k)[None, :] < torch.tensor([4, 1, 0, 3, 2, 4])[:, None]  # row 2 fully masked
    base = torch.where(mask, base, float("-inf"))

    def objective(logp, sl, denom):
        lm, _ = policy_loss(logp, old[sl], adv[sl], mask[sl], clip_low=0.2, clip_high=0.28)
        lm = lm + beta * kl(logp, ref[sl], "k3", mask=mask[sl])
        return aggregate(lm, mask[sl], mode, norm_len=k, denom=denom)

    full = base.clone().requires_grad_()
    value = objective(full, slice(None), denominator(mask, mode, norm_len=k))
    value.backward()
    micro = base.clone().requires_grad_()
    denom = denominator(mask, mode, norm_len=k)
    total = sum(_backward(objective(micro[sl], sl, denom)) for sl in (slice(0, 2), slice(2, 6)))
    assert_close(total, value.detach())
    assert torch.isfinite(full.grad).all()
    assert_close(micro.grad, full.grad)


def _backward(value: torch.Tensor) -> torch.Tensor:
    value.backward()
    return value.detach()


# ---------------------------------------------------------------- the issue's signatures and unknown names


def test_signatures_named_by_the_issue():
    kw_only = inspect.Parameter.KEYWORD_ONLY
    grpo = inspect.signature(ADVANTAGES.get("grpo")).parameters
    assert {"std", "eps", "ddof"} <= set(grpo) and grpo["std"].default == "group"
    assert "weights" in inspect.signature(ADVANTAGES.get("gdpo")).parameters
    p = inspect.signature(policy_loss).parameters
    assert list(p)[:4] == ["logp", "old_logp", "adv", "mask"]
    assert all(p[a].kind is kw_only for a in ("clip_low", "clip_high", "dual_clip", "level"))
    assert p["dual_clip"].default is None and p["level"].default == "token"
    p = inspect.signature(aggregate).parameters
    assert list(p)[:3] == ["loss", "mask", "mode"] and p["norm_len"].kind is kw_only and p["norm_len"].default is None
    assert list(inspect.signature(kl).parameters)[:3] == ["logp", "ref_logp", "kind"]
    assert {"grpo", "rloo", "mc_grpo", "gdpo", "winrate", "asymmetric"} <= set(A.names())
    assert {"clipped", "reg_grpo"} <= set(losses.names())
    assert {"vade", "mmr1_vas"} <= set(sampling.names())


@pytest.mark.parametrize(
    "call, choices",
    [
        (lambda: compute("nope", torch.zeros(1, 2)), "grpo"),
        (lambda: loss_mask("nope", torch.zeros(1, 2)), "mc_grpo"),
        (lambda: losses.compute("nope", *[torch.zeros(1, 1)] * 2, torch.zeros(1), torch.ones(1, 1)), "reg_grpo"),
        (lambda: aggregate(torch.zeros(1, 1), torch.ones(1, 1), "nope"), "token_mean"),
        (lambda: denominator(torch.ones(1, 1), "nope"), "seq_mean_token_sum_norm"),
        (lambda: kl(torch.zeros(1, 1), torch.zeros(1, 1), "nope"), "k3"),
        (lambda: sampling.make_sampler("nope", 3), "vade"),
    ],
)
def test_every_unknown_name_lists_the_choices(call, choices):
    with pytest.raises(ValueError, match=rf"unknown .*'nope'.*choose from: .*{choices}"):
        call()


# ---------------------------------------------------------------- docs/maths.md documents every core name


def _core_names() -> dict[str, list[str]]:
    def own(reg) -> list[str]:  # pipelines register more names into the same registries; those live elsewhere
        return [n for n in reg.names() if reg.get(n).__module__.startswith("mmgrpo.")]

    return {
        "advantage": own(ADVANTAGES),
        "loss": own(losses.POLICY_LOSSES),
        "aggregation": own(losses.AGGREGATIONS),
        "kl": own(losses.KL),
        "sampler": own(sampling.SAMPLERS),
    }


def test_docs_core_maths_has_formula_and_paper_for_every_core_name():
    section = MATHS_DOC.read_text()
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    names = _core_names()
    assert all(names.values())
    for kind, group in names.items():
        for name in group:
            hits = [r for r in rows if re.search(rf"`{name}`", r)]
            assert hits, f"docs/maths.md has no table row for {kind} {name!r}"
            cells = [c.strip() for c in hits[0].strip("|").split("|")]
            assert len(cells) >= 3 and all(cells), f"{kind} {name!r}: formula or paper cell empty: {hits[0]}"
