"""Tests for mmgrpo.sampling: zero-variance filter and prompt samplers (uniform, VADE, MMR1 VAS).

Expected values are worked out by hand in the comments; nothing here is copied from running the code.
"""

import io
import json

import numpy as np
import pytest
import torch

from mmgrpo import sampling
from mmgrpo.sampling import group_keep_mask, make_sampler, zero_std_fraction

SAMPLER_NAMES = ["uniform", "vade", "mmr1_vas"]


# ---------------------------------------------------------------- zero-variance filter


def test_keep_mask_binary():
    # DAPO (arXiv:2503.14476): all-correct and all-wrong groups give zero advantage and are dropped
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    assert group_keep_mask(r).tolist() == [False, False, True, True]
    assert zero_std_fraction(r) == pytest.approx(0.5)  # 2 of 4 groups


def test_keep_mask_continuous_is_spread_based():
    # mean 0.5 but no spread -> dropped; mean 0.9 with spread -> kept (a mean filter in (0.01, 0.99) does the reverse)
    r = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.95, 0.85], [0.999, 1.0, 1.0]], dtype=torch.float64)
    assert group_keep_mask(r).tolist() == [False, True, True]


def test_keep_mask_tolerance():
    # spread 1e-3 vs atol: kept iff 1e-3 > atol + rtol * max|r| = atol + 0 (rtol=0)
    r = torch.tensor([[0.300, 0.301], [0.3, 0.3]], dtype=torch.float64)
    assert group_keep_mask(r, rtol=0.0).tolist() == [True, False]
    assert group_keep_mask(r, atol=2e-3, rtol=0.0).tolist() == [False, False]
    # rtol scales with max|r| = 100: threshold 100 * 1e-6 = 1e-4; spreads 5e-5 (dropped) and 5e-4 (kept)
    big = torch.tensor([[100.0, 100.00005], [100.0, 100.0005]], dtype=torch.float64)
    assert group_keep_mask(big, rtol=1e-6).tolist() == [False, True]
    with pytest.raises(ValueError, match="atol"):
        group_keep_mask(r, atol=-1.0)


def test_keep_mask_below_keeps_flat_groups_under_the_best_reward():
    # NGRPO (arXiv:2509.18851) gives an all-wrong group negative advantages, so with below = max_reward = 1.5
    # (format 0.5 + accuracy 1) only the group flat at 1.5 carries no gradient: rows flat at 0.5 and 0.0 are kept,
    # the varied row is kept as always, the row at 1.5 is dropped (gap 0 is not > 0 + 1e-6 * 1.5)
    r = torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0], [0.5, 1.5, 0.5], [1.5, 1.5, 1.5]], dtype=torch.float64)
    assert group_keep_mask(r, below=1.5).tolist() == [True, True, True, False]
    assert group_keep_mask(r).tolist() == [False, False, True, False]  # below=None: DAPO's filter
    # a flat group at 1.4999999 lies within rtol * |below| = 1.5e-6 of the best reward: treated as at it, dropped
    assert group_keep_mask(torch.tensor([[1.4999999, 1.4999999]], dtype=torch.float64), below=1.5).tolist() == [False]
    assert group_keep_mask(torch.tensor([[1.0], [0.0]]), below=1.0).tolist() == [False, False]  # G = 1 never kept


def test_keep_mask_edge_cases():
    assert group_keep_mask(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]  # G = 1
    # NaN-padded ragged groups: [1, NaN, NaN] has one finite value -> dropped; [0, 1, NaN] varies -> kept
    r = torch.tensor([[1.0, float("nan"), float("nan")], [0.0, 1.0, float("nan")], [1.0, 1.0, float("nan")]])
    assert group_keep_mask(r).tolist() == [False, True, False]
    # multi-reward [B, G, R]: kept when any column varies
    r3 = torch.tensor([[[1.0, 0.2], [1.0, 0.7]], [[1.0, 0.2], [1.0, 0.2]]])
    assert group_keep_mask(r3).tolist() == [True, False]
    assert group_keep_mask(torch.tensor([[1, 0], [1, 1]])).tolist() == [True, False]  # int rewards
    assert zero_std_fraction(torch.zeros(0, 4)) == 0.0
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_keep_mask(torch.zeros(3))


# ---------------------------------------------------------------- samplers: shared contract


def _feed(s, batch, step):
    """Deterministic fake outcomes: prompt i succeeds on sample g iff (i + g + step) % 3 == 0 (G = 4)."""
    r = torch.tensor([[float((i + g + step) % 3 == 0) for g in range(4)] for i in batch])
    s.update(batch, r)


def _run(s, steps, batch_size=4):
    out = []
    for t in range(steps):
        batch = s.sample(batch_size)
        _feed(s, batch, t)
        out.append(batch)
    return out


def test_names_and_unknown():
    assert sampling.names() == sorted(SAMPLER_NAMES)
    with pytest.raises(ValueError, match="choose from: mmr1_vas, uniform, vade"):
        make_sampler("vadee", 10)
    with pytest.raises(ValueError, match="takes no keyword 'step_decy'.*did you mean 'step_decay'"):
        make_sampler("vade", 10, step_decy=0.9)
    with pytest.raises(ValueError, match="num_prompts"):
        make_sampler("uniform", 0)
    assert set(sampling.SAMPLERS.describe()) == set(SAMPLER_NAMES)


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_sampler_determinism_and_validity(name):
    a, b, c = (make_sampler(name, 13, seed=s) for s in (7, 7, 8))
    ra, rb, rc = _run(a, 8), _run(b, 8), _run(c, 8)
    assert ra == rb
    assert ra != rc
    for batch in ra:
        assert len(batch) == 4 and len(set(batch)) == 4 and all(0 <= i < 13 for i in batch)
    big = a.sample(30)  # larger than the dataset: it spans a full round of distinct prompts, none more than 3 times
    counts = np.bincount(big, minlength=13)
    assert len(big) == 30 and counts.min() >= 1 and counts.max() <= 3
    assert a.sample(0) == []
    assert all(isinstance(v, float) for v in a.metrics().values())
    assert isinstance(a, sampling.PromptSampler)


@pytest.mark.parametrize("name", SAMPLER_NAMES)
@pytest.mark.parametrize("via", ["torch", "json"])
def test_sampler_exact_resume(name, via):
    s = make_sampler(name, 11, seed=3)
    _run(s, 5, batch_size=5)  # crosses uniform's epoch boundary mid-batch at least once
    state = s.state_dict()
    if via == "json":
        state = json.loads(json.dumps(state))
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf)
    resumed = make_sampler(name, 11, seed=999)  # a different seed: everything must come from the state
    resumed.load_state_dict(state)
    assert _run(resumed, 5, batch_size=5) == _run(s, 5, batch_size=5)
    assert resumed.metrics() == s.metrics()
    with pytest.raises(ValueError, match="same name and dataset"):
        make_sampler(name, 12).load_state_dict(state)


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_update_validation(name):
    s = make_sampler(name, 5)
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        s.update([0, 1], torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        s.update([0, 5], torch.ones(2, 2))


# ---------------------------------------------------------------- uniform


def test_uniform_is_epoch_style():
    s = make_sampler("uniform", 10, seed=1)
    batches = [s.sample(4) for _ in range(5)]  # 20 draws = exactly 2 epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert all(len(set(b)) == 4 for b in batches)  # batch 3 straddles the boundary without repeats
    assert s.metrics()["sampler/epoch"] == pytest.approx(2.0)


# ---------------------------------------------------------------- VADE


def test_vade_posterior_update_by_hand():
    # VADE (arXiv:2511.18902), Beta-Bernoulli conjugacy: prior (1, 1), rewards [1, 1, 0, 1] -> (1 + 3, 1 + 1) = (4, 2)
    s = make_sampler("vade", 3, step_decay=0.9, visit_decay=0.5)
    s.update([0], torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    a, b = s.posterior()
    assert (a[0].item(), b[0].item()) == pytest.approx((4.0, 2.0))
    # step 2 touches prompt 1 only; prompt 0's evidence (3, 1) decays once by step_decay: (2.7, 0.9) -> (3.7, 1.9)
    # prompt 1, continuous rewards [0.5, 1.0]: (1 + 1.5, 1 + 0.5) = (2.5, 1.5)
    s.update([1], torch.tensor([[0.5, 1.0]]))
    a, b = s.posterior()
    assert (a[0].item(), b[0].item(), a[1].item(), b[1].item()) == pytest.approx((3.7, 1.9, 2.5, 1.5))
    # step 3 revisits prompt 0 with [0, 0]: evidence (2.7, 0.9) * 0.9 (step) = (2.43, 0.81), * 0.5 (visit)
    # = (1.215, 0.405), + (0 successes, 2 failures) -> (1 + 1.215, 1 + 0.405 + 2) = (2.215, 3.405)
    s.update([0], torch.tensor([[0.0, 0.0]]))
    a, b = s.posterior()
    assert (a[0].item(), b[0].item()) == pytest.approx((2.215, 3.405))
    assert (a[2].item(), b[2].item()) == (1.0, 1.0)  # never seen: the prior
    # a NaN-padded sample is skipped: [1, NaN] adds one success only
    s2 = make_sampler("vade", 1, step_decay=1.0, visit_decay=1.0)
    s2.update([0], torch.tensor([[1.0, float("nan")]]))
    assert [t.item() for t in s2.posterior()] == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        s2.update([0], torch.tensor([[1.5, 0.0]]))
    with pytest.raises(ValueError, match="step_decay"):
        make_sampler("vade", 3, step_decay=0.0)


def test_vade_prefers_uncertain_prompts():
    # prompt 0 ~ p 0.5 (Beta(51, 51)), prompt 1 solved (Beta(101, 1)), prompt 2 unsolvable (Beta(1, 101)):
    # p(1-p) is ~0.25 for prompt 0 but ~0.01 for the others, so batch_size=1 should pick prompt 0 nearly always
    s = make_sampler("vade", 3, seed=0, step_decay=1.0, visit_decay=1.0)
    s.update([0, 1, 2], torch.tensor([[1.0] * 50 + [0.0] * 50, [1.0] * 100, [0.0] * 100]))
    counts = np.bincount([s.sample(1)[0] for _ in range(300)], minlength=3)
    assert counts[0] > 280 and counts[1] < 10 and counts[2] < 10
    # an unseen prompt at the prior Beta(1, 1) still beats a solved one most of the time
    s4 = make_sampler("vade", 2, seed=0, step_decay=1.0, visit_decay=1.0)
    s4.update([0], torch.ones(1, 100))
    counts = np.bincount([s4.sample(1)[0] for _ in range(300)], minlength=2)
    assert counts[1] > 200


def test_vade_step_decay_returns_to_prior():
    s = make_sampler("vade", 2, step_decay=0.5, visit_decay=1.0)
    s.update([0], torch.ones(1, 8))  # evidence (8, 0)
    for _ in range(3):
        s.update([1], torch.zeros(1, 1))
    # three more steps: 8 * 0.5^3 = 1 -> alpha = 1 + 1 = 2
    assert s.posterior()[0][0].item() == pytest.approx(2.0)


# ---------------------------------------------------------------- MMR1 VAS


def test_mmr1_probabilities_by_hand():
    # MMR1 (arXiv:2509.21268): VPS = population variance of the group's rewards (= p(1-p) for binary)
    # prompt 0: [1,0,1,0] p=.5 -> .25 ; prompt 1: [1,1,1,1] -> 0 ; prompt 2: [1,0,0,0] p=.25 -> .1875 ;
    # prompt 3 unseen -> init .25. Sum .6875. q_i = .5 * VPS_i / .6875 + .5 / 4:
    # q0 = .181818 + .125 = .306818 ; q1 = .125 ; q2 = .136364 + .125 = .261364 ; q3 = .306818 (sum 1)
    s = make_sampler("mmr1_vas", 4, seed=0, mixture_ratio=0.5)
    s.update([0, 1, 2], torch.tensor([[1.0, 0, 1, 0], [1.0, 1, 1, 1], [1.0, 0, 0, 0]]))
    q = s.probabilities()
    expected = [0.5 * 0.25 / 0.6875 + 0.125, 0.125, 0.5 * 0.1875 / 0.6875 + 0.125, 0.5 * 0.25 / 0.6875 + 0.125]
    torch.testing.assert_close(q, torch.tensor(expected, dtype=torch.float64))
    # a single draw follows q: 3000 draws, each frequency within 0.03 of q (binomial sd <= 0.0085)
    freq = np.bincount([s.sample(1)[0] for _ in range(3000)], minlength=4) / 3000
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_mmr1_momentum_diversity_and_degenerate():
    # momentum .5: prompt 0 first [1,0] (var .25), then [1,1] (var 0) -> .5 * .25 + .5 * 0 = .125
    # diversity weight .2 with D = [.5]: fresh VPS = 1 * 0 + .2 * .5 = .1 for prompt 1
    s = make_sampler("mmr1_vas", 3, mixture_ratio=1.0, momentum=0.5, diversity_weight=0.2, init_score=0.0)
    s.update([0], torch.tensor([[1.0, 0.0]]), diversity=torch.tensor([0.0]))
    s.update([0, 1], torch.tensor([[1.0, 1.0], [1.0, 1.0]]), diversity=torch.tensor([0.0, 0.5]))
    # VPS = (.125, .1, 0 unseen with init 0) -> q = (.125/.225, .1/.225, 0) with mixture_ratio 1
    torch.testing.assert_close(s.probabilities(), torch.tensor([0.125 / 0.225, 0.1 / 0.225, 0.0], dtype=torch.float64))
    assert sorted(s.sample(3)) == [0, 1, 2]  # the zero-probability prompt is only reached once the others are used
    with pytest.raises(ValueError, match="diversity"):
        s.update([0], torch.ones(1, 2))  # diversity_weight > 0 needs diversity
    # every VPS zero -> uniform
    z = make_sampler("mmr1_vas", 4, mixture_ratio=1.0, init_score=0.0)
    torch.testing.assert_close(z.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))
