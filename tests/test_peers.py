"""Peer cross-checks users can run (`pip install "mmgrpo[peers]"`, then `pytest -m peers`): our group advantage,
clipped loss in every aggregation mode (value and gradient) and KL estimators against the installed verl
(`verl.trainer.ppo.core_algos`) and TRL (`GRPOTrainer._compute_loss`, run on our log-probs) on random inputs.
Each test is skipped, with the reason, when its peer is not importable. The option mapping is in docs/maths.md."""

import importlib
import importlib.metadata
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmgrpo import advantages, losses

pytestmark = pytest.mark.peers
B, G, K = 3, 4, 5
N = B * G
# our aggregation mode <- verl loss_agg_mode
VERL_MODES = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
# our aggregation mode <- TRL loss_type
TRL_MODES = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
}


def _peer(module: str, package: str):
    try:
        return importlib.import_module(module)
    except (ImportError, importlib.metadata.PackageNotFoundError) as err:
        pytest.skip(f"{package} is not importable ({err}); pip install 'mmgrpo[peers]' to run the cross-check")


def _inputs(seed: int = 0):
    """logp, old_logp (ratios on both sides of the clip range), adv [N], ref_logp and a mask with >= 1 token a row."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, K, generator=gen, dtype=torch.float64) * 3  # [N, K]
    old = logp + 0.4 * torch.randn(N, K, generator=gen, dtype=torch.float64)  # [N, K]
    ref = logp + 0.3 * torch.randn(N, K, generator=gen, dtype=torch.float64)  # [N, K]
    adv = torch.randn(N, generator=gen, dtype=torch.float64)  # [N]
    mask = torch.rand(N, K, generator=gen) < 0.7  # [N, K]
    mask[:, 0] = True
    return logp, old, ref, adv, mask


def _ours(logp, old, ref, adv, mask, mode, *, clip_high, dual_clip=None, beta=0.0):
    lp = logp.clone().requires_grad_(True)
    mat, _ = losses.compute("clipped", lp, old, adv, mask, clip_low=0.2, clip_high=clip_high, dual_clip=dual_clip)
    if beta:
        mat = mat + beta * losses.kl(lp, ref, "k3", mask=mask)
    value = losses.aggregate(mat, mask, mode, norm_len=K)
    value.backward()
    return value.detach(), lp.grad


def test_grpo_advantage_equals_verl():
    """verl compute_grpo_outcome_advantage (epsilon 1e-6, torch.std ddof 1; norm_adv_by_std_in_grpo=False is
    std: none) == grpo {std: group, ddof: 1, eps: 1e-6}, broadcast over the response mask."""
    ca = _peer("verl.trainer.ppo.core_algos", "verl")
    _, _, _, _, mask = _inputs()
    scores = torch.rand(B, G, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scores[1] = 0.5  # a flat group: 0 in both
    last = mask.long().cumsum(1).argmax(1)  # [N] the last real token carries the outcome reward
    token_rewards = torch.zeros(N, K).scatter(1, last[:, None], scores.reshape(N, 1).float())  # [N, K]
    index = np.array([b for b in range(B) for _ in range(G)])
    for by_std, std in ((True, "group"), (False, "none")):
        theirs, _ = ca.compute_grpo_outcome_advantage(
            token_rewards, mask.float(), index, epsilon=1e-6, norm_adv_by_std_in_grpo=by_std
        )
        ours = advantages.compute("grpo", scores, std=std, ddof=1, eps=1e-6).reshape(N, 1) * mask  # [N, K]
        torch.testing.assert_close(theirs.float(), ours.float(), rtol=1e-5, atol=1e-6)


class _VerlActor(dict):
    """The fields of verl's ActorConfig that compute_policy_loss_vanilla reads."""

    def __getattr__(self, key):
        return self[key]


@pytest.mark.parametrize("verl_mode", sorted(VERL_MODES))
def test_clipped_loss_value_and_gradient_equal_verl(verl_mode):
    """verl compute_policy_loss_vanilla (clip_ratio_low/high, dual clip clip_ratio_c = 3, always on) == clipped
    {clip_low, clip_high, dual_clip: 3.0}; seq-mean-token-sum-norm's horizon K == our norm_len."""
    ca = _peer("verl.trainer.ppo.core_algos", "verl")
    logp, old, ref, adv, mask = _inputs()
    cfg = _VerlActor(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info={})
    lp = logp.clone().requires_grad_(True)
    theirs, _ = ca.compute_policy_loss_vanilla(
        old, lp, adv[:, None].expand(N, K), mask.double(), loss_agg_mode=verl_mode, config=cfg
    )
    theirs.backward()
    value, grad = _ours(logp, old, ref, adv, mask, VERL_MODES[verl_mode], clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(theirs.detach(), value, rtol=1e-6, atol=1e-9)  # verl adds 1e-8 to token counts
    torch.testing.assert_close(lp.grad, grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("verl_kind,ours,clamp", [("kl", "k1", None), ("mse", "k2", None), ("low_var_kl", "k3", 10.0)])
def test_kl_estimators_equal_verl(verl_kind, ours, clamp):
    """verl kl_penalty kinds kl / mse / low_var_kl == our k1 / k2 / k3 (low_var_kl clamps at +-10: clamp=10)."""
    ca = _peer("verl.trainer.ppo.core_algos", "verl")
    logp, _, ref, _, _ = _inputs()
    ref = ref.clone()
    ref[0, 0] = logp[0, 0] + 15.0  # past verl's +-10 clamp of the k3 estimate
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    theirs = ca.kl_penalty(a, ref, verl_kind)
    mine = losses.kl(b, ref, ours, clamp=clamp)
    torch.testing.assert_close(theirs, mine, rtol=1e-12, atol=1e-12)
    theirs.sum().backward()
    mine.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_self(loss_type: str, beta: float, logp: torch.Tensor):
    """A stand-in for GRPOTrainer with what _compute_loss reads; its forward returns our log-probs."""
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=K,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=_Accelerator(),
    )


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", sorted(TRL_MODES))
def test_clipped_loss_value_and_gradient_equal_trl(loss_type, beta):
    """TRL GRPOTrainer._compute_loss (epsilon / epsilon_high, beta x k3 KL per token) == clipped {clip_low,
    clip_high} + kl_coef x k3 under: grpo -> seq_mean_token_mean, bnpo and dapo (num_items_in_batch = the batch's
    tokens) -> token_mean, dr_grpo -> seq_mean_token_sum_norm with norm_len = max_completion_length (TRL divides by
    every row; rows here are never empty, where our N' counts only non-empty ones)."""
    grpo_trainer = _peer("trl.trainer.grpo_trainer", "trl")
    logp, old, ref, adv, mask = _inputs()
    lp = logp.clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.zeros(N, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(N, 0, dtype=torch.long),
        "completion_ids": torch.zeros(N, K, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().double(),
    }
    theirs = grpo_trainer.GRPOTrainer._compute_loss(_trl_self(loss_type, beta, lp), None, inputs)
    theirs.backward()
    value, grad = _ours(logp, old, ref, adv, mask, TRL_MODES[loss_type], clip_high=0.28, beta=beta)
    torch.testing.assert_close(theirs.detach(), value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, grad, rtol=1e-12, atol=1e-12)
