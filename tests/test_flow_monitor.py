"""The per-step over-optimisation monitor (issue 6 item 5): the engine's per-decision ratio mean, std and clip
fractions that flow policies (per_element_metrics = True) get every step; golden values worked by hand."""

import math

import torch

from mmgrpo.trainer import _per_element


def test_per_element_monitor_golden():
    # step 0: ratios 0.7, 1.0, 1.3 -> mean 1.0, population std sqrt((0.09 + 0 + 0.09) / 3) = sqrt(0.06);
    #   with clip 0.2 / 0.28: upper = frac(r > 1.28) = 1/3, lower = frac(r < 0.8) = 1/3
    # step 1: ratios 1.1, 0.9 (third sample masked; its ratio 5 must not count) -> mean 1.0, std 0.1,
    #   upper = frac(r > 1.28) = 0, lower = frac(r < 0.8) = 0
    # step 2: all masked -> flagged absent (weight 0 in the engine's running means, so never logged)
    r = torch.tensor([[0.7, 1.1, 1.0], [1.0, 0.9, 1.0], [1.3, 5.0, 1.0]], dtype=torch.float64)
    old = torch.randn(3, 3, dtype=torch.float64)
    m = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    full = _per_element(old + r.log(), old, m, 4, clip_low=0.2, clip_high=0.28)  # {key: (value, present)}
    out = {k: v for k, (v, present) in full.items() if present}
    assert sorted(full) == sorted(
        f"ratio/k{k}{s}" for k in (4, 5, 6) for s in ("", "/std", "/clip_upper", "/clip_lower")
    )
    assert sorted(out) == sorted(f"ratio/k{k}{s}" for k in (4, 5) for s in ("", "/std", "/clip_upper", "/clip_lower"))
    want = {
        "ratio/k4": 1.0,
        "ratio/k4/std": math.sqrt(0.06),
        "ratio/k4/clip_upper": 1 / 3,
        "ratio/k4/clip_lower": 1 / 3,
        "ratio/k5": 1.0,
        "ratio/k5/std": 0.1,
        "ratio/k5/clip_upper": 0.0,
        "ratio/k5/clip_lower": 0.0,
    }
    for key, val in want.items():
        assert abs(float(out[key]) - val) < 1e-12, (key, float(out[key]), val)


def test_per_element_monitor_uses_the_given_clip_range():
    # ratio 1.1 is inside a 0.2 range but above a 1e-4 range (GRPO-Guard / Flow-GRPO clip ranges are tiny)
    lr = torch.tensor([[math.log(1.1)], [math.log(0.95)]])
    m = torch.ones(2, 1, dtype=torch.bool)
    wide = {k: v for k, (v, _) in _per_element(lr, torch.zeros(2, 1), m, 0).items()}
    tight = {k: v for k, (v, _) in _per_element(lr, torch.zeros(2, 1), m, 0, clip_low=1e-4, clip_high=1e-4).items()}
    assert float(wide["ratio/k0/clip_upper"]) == 0.0 and float(wide["ratio/k0/clip_lower"]) == 0.0
    assert float(tight["ratio/k0/clip_upper"]) == 0.5 and float(tight["ratio/k0/clip_lower"]) == 0.5
