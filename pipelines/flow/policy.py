"""The flow-model `Policy`: plan-driven SDE rollouts, re-scoring of stored transitions, reference, LoRA weights.

K is the number of trained denoising transitions; their latents ride in `Rollout.extras` (never re-sampled).
"""

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo.errors import UserError
from mmgrpo.types import Rollout
from pipelines.flow import plan as plans
from pipelines.flow import sde, trust
from pipelines.flow.models import FlowModel, FluxModel, denoiser_of
from pipelines.flow.objectives import guard_step_weights, make_objective, noise_aware_weights
from pipelines.flow.sage import equaliser_weights
from pipelines.flow.vgpo import vgpo_step_advantages
from pipelines.flow.weights import FlowWeights


class FlowPolicy(FlowWeights):
    """GRPO policy over a diffusers flow transformer (LoRA adapter or full weights) with a rollout plan.

    Attributes read by the trainer: `k_chunk` (trained steps per backward; None = all K at once) and
    `per_element_metrics` (per step: ratio/k<j> mean, /std, /clip_upper, /clip_lower). With `ratio_norm` or
    `step_weights`, logp() returns aux["loss_kwargs"] (std, mean_sq_dist, weight [n, k]) for algo.loss guard_clipped.
    logp() and ref_logp() run the transformer only on the (sample, step) pairs rollout.mask trains (a tree plan's
    shared edges count once, see `step_advantages`); the other entries hold the old log-prob, detached.
    Samples are pixels for the rewards, or the final latents when no reward needs pixels (`set_reward_inputs`).
    What it trains on is `objective` (objectives.OBJECTIVES: grpo scores the kept transitions with the transition_*
    methods below, nft feeds DiffusionNFT forward-process points); rollout, logp and ref_logp go through it.
    """

    per_element_metrics = True

    @property
    def wants_step_advantages(self) -> bool:
        """Tree plans credit each shared transition with its subtree's reward (BranchGRPO), not the leaf's; G2RPO's
        granularities credit a member's SDE step with the sum over its completions."""
        return (
            self.plan_name == "tree"
            or len(self.plan_kwargs.get("granularities") or (1,)) > 1
            or self.value_anchor is not None
        )

    def __init__(
        self,
        pipe: Any,
        model: FlowModel,
        *,
        num_steps: int,
        sde_kind: str,
        noise_level: float,
        reduce: str,
        plan: str,
        plan_kwargs: dict,
        same_noise: bool,
        lora: bool,
        reference: bool,
        k_chunk: int | None,
        seed: int,
        decode_batch_size: int,
        objective: str = "grpo",
        nft_steps: int = 2,
        ratio_norm: bool = False,
        step_weights: str = "none",
        reward_inputs: Iterable[str] | None = None,
        value_anchor: dict | None = None,
        anchor_every: int = 0,
        trust_step: float = 0.0,
    ):
        self.pipe, self.model, self.transformer = pipe, model, denoiser_of(pipe)
        self.objective = make_objective(objective, nft_steps=nft_steps)
        self.ratio_norm, self.step_weights = ratio_norm, step_weights
        self.value_anchor = None if value_anchor is None else dict(value_anchor)  # VGPO's per-step credit (vgpo.py)
        # SAGE-GRPO's dual trust region (trust.py): the reference moves every anchor_every steps; trust_step weighs
        # the KL to the rollout policy, added to the KL to the reference
        self.anchor, self.trust_step = trust.MovingAnchor(anchor_every), float(trust_step)
        self.num_steps, self.sde_kind, self.noise_level, self.reduce = num_steps, sde_kind, noise_level, reduce
        self.plan_name, self.plan_kwargs, self.same_noise = plan, dict(plan_kwargs), same_noise
        self.lora, self.k_chunk, self.seed, self.decode_batch_size = lora, k_chunk, seed, decode_batch_size
        self.sigmas = model.sigmas(num_steps)  # [T+1]
        # full fine-tuning needs a frozen copy made before any update (and before a checkpoint is loaded)
        self.ref = None
        if reference and not lora:
            self.ref = copy.deepcopy(self.transformer).requires_grad_(False).eval()
        self.use_reference = reference
        self.iteration, self._iteration_fixed = 0, False
        self.last_plan: plans.RolloutPlan | None = None
        self.decode_samples = True
        if reward_inputs is not None:
            self.set_reward_inputs(reward_inputs)

    def set_reward_inputs(self, inputs: Iterable[str]) -> None:
        """The input kinds of the configured rewards: when every one is "latent", rollouts skip the VAE and return
        the final latents as samples ([C, h, w] per image, FLUX unpacked; [C, f, h, w] for video), on the model's
        device in its dtype; the gallery decodes only what it shows."""
        inputs = set(inputs)
        if "latent" in inputs and len(inputs) > 1:
            raise ValueError(
                f"rewards read {sorted(inputs)}: every reward gets the same samples, so latent rewards "
                f"cannot be mixed with pixel ones; wrap the latent model in a reward that decodes, or "
                f"use only latent rewards"
            )
        self.decode_samples = inputs != {"latent"}

    def for_evaluation(self) -> None:
        """Called by `mmgrpo eval` / `sample`: roll out as `python -m pipelines.flow.compare` does (its EVAL_OVERRIDES,
        kept equal by tests/test_flow_eval.py): deterministic ODE (noise 0) through the independent plan with every
        step, objective grpo, one fresh initial noise per sample, whatever the recipe trains with."""
        self.noise_level, self.plan_name, self.plan_kwargs = 0.0, "independent", {"train": "all"}
        self.objective, self.same_noise = make_objective("grpo"), False

    def set_iteration(self, iteration: int) -> None:
        """Tell the policy the training step (moves MixGRPO windows, picks Fast branch points); else it counts calls."""
        self.iteration, self._iteration_fixed = int(iteration), True
        self.anchor.update(self, self.iteration)

    # ---- rollout

    @torch.no_grad()
    def rollout(self, prompts: list[dict[str, Any]], group_size: int, seeds: list[int]) -> Rollout:
        texts = [str(p["prompt"]) for p in prompts]
        cond = self.model.encode(texts)  # [B, ...] per key
        try:
            plan, trained = plans.make_plan(
                self.plan_name,
                num_steps=self.num_steps,
                group_size=group_size,
                sde=self.sde_kind,
                iteration=self.iteration,
                same_noise=self.same_noise,
                seeds=list(seeds),
                **self.plan_kwargs,
            )
        except ValueError as err:  # the group size (known only here) does not fit the plan: say which fields
            raise UserError(
                f"pipeline.kwargs.plan {self.plan_name!r} / plan_kwargs with sample.group_size="
                f"{group_size}: {' '.join(str(err).split())}"
            ) from None
        self.last_plan = plan
        device, dtype = self.model.device, self.model.dtype

        def velocity(x: Tensor, sigma: Tensor, prompt: Tensor) -> Tensor:
            return self.model.velocity(self.transformer, x, sigma, {k: v[prompt] for k, v in cond.items()})

        def step(kind, x, v, s, s_next, **kw):
            if kind == "ode" and self.sde_kind == "ddim":  # a plan's deterministic steps: DDIM with eta = 0
                kind, kw = "ddim", {**kw, "noise_level": 0.0}
            return sde.step(kind, x, v, s, s_next, reduce=self.reduce, **kw)

        res = plans.execute(
            plan,
            seeds=list(seeds),
            shape=self.model.latent_shape(),
            sigmas=self.sigmas,
            trained=self.objective.trained(trained),
            velocity=velocity,
            step=step,
            noise_level=self.noise_level,
            device=device,
            dtype=dtype,
            keep_mean=self.ratio_norm or self.trust_step > 0,
        )
        if not self._iteration_fixed:
            self.iteration += 1
        samples = (
            self.model.decode(res.final, self.decode_batch_size)
            if self.decode_samples
            else self._latent_samples(res.final)
        )
        per_sample = {f"cond_{k}": v.repeat_interleave(group_size, 0) for k, v in cond.items()}
        return self.objective.rollout(self, plan, res, samples, per_sample, group_size, list(seeds))

    def transition_rollout(
        self, plan: plans.RolloutPlan, res: plans.PlanResult, samples: list, cond: dict[str, Tensor], group_size: int
    ) -> Rollout:
        """objective grpo's Rollout: the kept transitions (x_t, x_next, sigmas, step) with their sampling log-probs,
        the mask of the stochastic ones the plan credits, and the per-sample conditioning `cond` ("cond_<key>")."""
        device = self.model.device
        n = res.final.shape[0]
        sig, sig_next = self.sigmas[res.steps], self.sigmas[res.steps + 1]  # [N, K]
        std = sde.step_std(self.sde_kind, sig.reshape(-1), sig_next.reshape(-1), noise_level=self.noise_level)
        mask = (std > 0).view(n, -1) if res.steps.numel() else torch.zeros(n, 0, dtype=torch.bool)  # [N, K]
        if plan.coarse:  # the M granularity leaves of a member share its transitions: only j = 0 trains them
            mask = mask & plans.credited_leaves(plan, n)[:, None]
        path_mask = None
        if plan.edge_credit == "once":  # a shared tree edge trains in one row; step_advantages redoes it after pruning
            path_mask, mask = mask, plans.credit_edges_once(plan, res.steps, mask, group_size)
        extras = {
            "x_t": res.x_t,
            "x_next": res.x_next,
            "sigma": sig.to(device),
            "sigma_next": sig_next.to(device),
            "step": res.steps,
            **cond,
        }
        if path_mask is not None:
            extras["path_mask"] = path_mask  # [N, K] every leaf's whole path, before the edge credit
        if res.mean is not None:
            extras["old_mean"] = res.mean  # [N, K, ...] the rollout policy's means, for the exact RatioNorm
        sde_steps = sum(k != "ode" for k in plan.kinds)
        metrics = {
            "rollout/nfe_per_sample": res.nfe / n,
            "rollout/sde_steps": float(sde_steps),
            "rollout/first_trained_step": float(res.steps.min()) if res.steps.numel() else -1.0,
        }
        return Rollout(samples=samples, old_logp=res.logp.cpu(), mask=mask, extras=extras, metrics=metrics)

    # ---- scoring

    def _score(self, module: nn.Module, rollout: Rollout, idx: Tensor, ks: slice, pos: Tensor | None = None):
        """StepOut of the stored transitions (idx, ks) flattened to [n * k], or of the flat positions `pos` [E] of
        that grid only (the transformer sees just those rows); grad flows through `module`. Returns (out, n, k)."""
        ex = rollout.extras
        x = ex["x_t"][idx][:, ks]  # [n, k, ...]
        n, k = x.shape[:2]
        pos = torch.arange(n * k) if pos is None else pos  # [E]
        pick = lambda t: t.reshape(n * k, *t.shape[2:])[pos.to(t.device)]  # [E, ...]
        rows = pos // k  # [E] the sample of each picked transition
        cond = {key[5:]: v[idx][rows.to(v.device)] for key, v in ex.items() if key.startswith("cond_")}
        sigma, sigma_next = pick(ex["sigma"][idx][:, ks]), pick(ex["sigma_next"][idx][:, ks])  # [E]
        x_t = pick(x)  # [E, ...]
        v = self.model.velocity(module, x_t, sigma, cond)
        return (
            sde.step(
                self.sde_kind,
                x_t,
                v,
                sigma,
                sigma_next,
                noise_level=self.noise_level,
                prev_sample=pick(ex["x_next"][idx][:, ks]),
                reduce=self.reduce,
            ),
            n,
            k,
        )

    def _nothing(self, rollout: Rollout, idx: Tensor, ks: slice):
        """What `_score` returns for an empty list of positions, without calling the model: (out, n, k)."""
        x = rollout.extras["x_t"][idx][:, ks]  # [n, k, ...]
        none = x.reshape(-1, *x.shape[2:])[:0]  # [0, ...]
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)  # logp and std are float32 (sde.step)
        return sde.StepOut(none, empty, none.float(), empty), *x.shape[:2]

    def _trained_positions(self, rollout: Rollout, idx: Tensor, ks: slice) -> tuple[Tensor, bool]:
        """Flat positions [E] of the (sample, step) pairs of idx x ks that rollout.mask trains, and whether the list
        is a stand-in: with nothing trained, one pair is still scored under torch.distributed (FSDP gathers weights
        in every forward, DDP reduces in the last backward, so every rank must run the model); else none is."""
        pos = rollout.mask[idx][:, ks].reshape(-1).nonzero().flatten().cpu()  # [E]
        if pos.numel() or not (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            return pos, False
        return torch.zeros(1, dtype=torch.long), True

    def logp(
        self, model: nn.Module, rollout: Rollout, idx: Tensor, k_slice: slice | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Log-probs [n, k] of the rollout's training inputs through `model` and the aux dict, as the objective
        scores them (grpo: transition_logp; nft: zeros, its loss reads loss_kwargs)."""
        return self.objective.logp(self, model, rollout, idx, k_slice if k_slice is not None else slice(None))

    def transition_logp(
        self, model: nn.Module, rollout: Rollout, idx: Tensor, ks: slice
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Log-probs [n, k] of the stored transitions through `model`; extras["kl"] [n, k] is the exact Gaussian KL
        to the reference once `ref_logp` has run on this rollout (it stores the reference means)."""
        pos, stand_in = self._trained_positions(rollout, idx, ks)  # [E] only these reach the transformer
        out, n, k = self._score(model, rollout, idx, ks, pos) if pos.numel() else self._nothing(rollout, idx, ks)
        old = rollout.old_logp[idx][:, ks].reshape(-1).to(device=out.logp.device, dtype=out.logp.dtype)  # [n * k]
        fill = _Filler(pos, n * k, out.logp.device, stand_in)
        # untrained pairs hold the old log-prob (ratio 1, no grad): the trainer masks them anyway
        logp = fill(old, out.logp)
        if not pos.numel() and not stand_in:
            logp = logp.requires_grad_()  # nothing trained here: a leaf so the trainer's backward still runs
        aux = {}
        ref_mean = rollout.extras.get("ref_mean")
        if ref_mean is not None:
            ref = ref_mean[idx][:, ks].reshape(n * k, *out.mean.shape[1:])[pos.to(ref_mean.device)].to(out.mean)
            aux["kl"] = fill(torch.zeros_like(old), sde.kl_gaussian(out.mean, ref, out.std, self.reduce)).view(n, k)
            if self.trust_step > 0:  # the dual trust region's per-update term: KL to the rollout policy's means
                mu = rollout.extras["old_mean"][idx][:, ks].reshape(n * k, *out.mean.shape[1:])[pos.to(ref.device)]
                aux["kl"] = aux["kl"] + self.trust_step * fill(
                    torch.zeros_like(old), trust.step_kl(out, mu, self.reduce)
                ).view(n, k)
        kw = self._guard_kwargs(out, rollout, idx, ks, n, k, fill)
        if kw:
            aux["loss_kwargs"] = kw
        return logp.view(n, k), aux

    def step_weight_table(self) -> Tensor:
        """[T] loss weight of each denoising step for `step_weights` (guard: GRPO-Guard's 1 / |dt|, arXiv:2510.22319;
        guard_normalized: the same over its mean on the schedule; noise_aware: TempFlow-GRPO's std_t / mean std;
        grad_equalizer: SAGE-GRPO's (std_t / |d mean_t / d v|) over its mean, sage.equaliser_weights)."""
        s, s_next = self.sigmas[:-1].double(), self.sigmas[1:].double()  # [T]
        if self.step_weights == "grad_equalizer":  # SAGE-GRPO: equal expected gradient norm per step
            return equaliser_weights(s, s_next, kind=self.sde_kind, noise_level=self.noise_level)
        if self.step_weights == "noise_aware":
            return noise_aware_weights(s, s_next, kind=self.sde_kind, noise_level=self.noise_level)
        return guard_step_weights(s, s_next, normalize=self.step_weights == "guard_normalized")

    def _guard_kwargs(
        self, out, rollout: Rollout, idx: Tensor, ks: slice, n: int, k: int, fill: "_Filler"
    ) -> dict[str, Tensor]:
        """The guard_clipped loss's per-element inputs [n, k]: std and mean_sq_dist (ratio_norm), weight, k_offset.
        Untrained pairs (not scored) get std 1 and mean_sq_dist 0, constants the loss masks."""
        kw = {}
        if self.ratio_norm:
            old = rollout.extras["old_mean"][idx][:, ks].reshape(n * k, *out.mean.shape[1:])
            old = old[fill.pos.to(old.device)].to(out.mean)  # [E, ...]
            base = torch.ones(n * k, dtype=out.std.dtype, device=out.std.device)  # [n * k]
            kw["std"] = fill(base, out.std).view(n, k)
            kw["mean_sq_dist"] = fill(torch.zeros_like(base), sde._reduce((out.mean - old) ** 2, self.reduce)).view(
                n, k
            )  # grad through mean
        if self.step_weights != "none":
            steps = rollout.extras["step"][idx][:, ks]  # [n, k]
            kw["weight"] = self.step_weight_table()[steps.cpu()].to(out.logp)  # [n, k]
        if kw:
            kw["k_offset"] = ks.start or 0  # guard_clipped then logs its own per-step monitor of r_hat
        return kw

    @torch.no_grad()
    def ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor | None:
        """Reference log-probs [n, K] as the objective scores them (None without a reference or a KL term)."""
        if not self.use_reference:
            return None
        return self.objective.ref_logp(self, rollout, idx)

    @torch.no_grad()
    def transition_ref_logp(self, rollout: Rollout, idx: Tensor) -> Tensor:
        """Reference log-probs [n, K] of the stored transitions: the adapter disabled (LoRA) or the frozen copy
        (full fine-tuning); also stores the reference means in extras["ref_mean"] for logp's KL."""
        ex = rollout.extras
        pos, _ = self._trained_positions(rollout, idx, slice(None))  # [E] untrained pairs need no reference
        if not pos.numel():
            out, n, k = self._nothing(rollout, idx, slice(None))
        elif self.lora and self.anchor.state is not None:  # a moved anchor: its adapter values, swapped in
            with self.anchor.weights(self):
                out, n, k = self._score(self.transformer, rollout, idx, slice(None), pos)
        elif self.lora:
            self.transformer.disable_adapters()
            try:
                out, n, k = self._score(self.transformer, rollout, idx, slice(None), pos)
            finally:
                self.transformer.enable_adapters()
        else:
            out, n, k = self._score(self.ref, rollout, idx, slice(None), pos)
        if "ref_mean" not in ex:
            ex["ref_mean"] = torch.zeros(ex["x_t"].shape, dtype=out.mean.dtype, device=ex["x_t"].device)
        flat = ex["ref_mean"][idx].reshape(n * k, *out.mean.shape[1:])  # [n * k, ...] a copy
        flat[pos.to(flat.device)] = out.mean.to(flat)
        ex["ref_mean"][idx] = flat.view(n, k, *out.mean.shape[1:])
        old = rollout.old_logp[idx].reshape(-1).to(device=out.logp.device, dtype=out.logp.dtype)  # [n * k]
        return _Filler(pos, n * k, out.logp.device, False)(old, out.logp).view(n, k)

    def step_advantages(self, rollout: Rollout, rewards: Tensor) -> Tensor:
        """BranchGRPO per-depth advantages [N, K] for the last rollout's plan from leaf rewards [B, G]; with
        granularities, G2RPO's summed per-granularity advantage of each member on its leaves' rows.

        Rewards are known only now, so rollout.mask is set here from the leaf paths (extras["path_mask"], else the
        rollout's mask): the plan's width_prune turns the pruned leaves' rows False, then edge_credit once keeps
        each distinct edge in the first surviving leaf's row only. The rollout already evaluated every leaf.
        The plan's fusion (mean | prob) fuses rewards up the tree; prob weighs children by their split step's
        sampling log-prob (rollout.old_logp, every leaf's whole path)."""
        if self.last_plan is None:
            raise ValueError("step_advantages needs a rollout first: call rollout() before it")
        plan, steps = self.last_plan, rollout.extras["step"]
        if plan.coarse:
            return plans.granular_step_advantages(plan, rewards, steps.shape[1])
        mask = rollout.extras.get("path_mask", rollout.mask)  # [N, K]
        if plan.width_prune is not None:
            mask = plans.width_prune_mask(plan, rewards.cpu(), mask)  # [N, K]
        if plan.edge_credit == "once":
            mask = plans.credit_edges_once(plan, steps, mask, rewards.shape[1])  # [N, K]
        rollout.mask = mask
        leaf_logp = None
        if plan.fusion == "prob":  # each leaf's path log-probs by step; tree() keeps the split steps fusion needs
            n, t = steps.shape[0], plan.num_steps
            leaf_logp = torch.zeros(n, t).scatter(1, steps.cpu(), rollout.old_logp.float().cpu())  # [N, T]
            leaf_logp = leaf_logp.view(*rewards.shape, t).to(rewards.device)  # [B, G, T]
        if self.value_anchor is not None:  # VGPO: subtree values before / after each step, anchored normalisation
            lp = None if leaf_logp is None else leaf_logp.cpu()
            return vgpo_step_advantages(
                plan,
                rewards.cpu(),
                steps.cpu(),
                fusion=plan.fusion,
                leaf_logp=lp,
                fusion_alpha=plan.fusion_alpha,
                **self.value_anchor,
            ).to(rewards.device)
        return plans.depth_advantages(
            plan, rewards, steps, fusion=plan.fusion, leaf_logp=leaf_logp, alpha=plan.fusion_alpha
        )

    def _latent_samples(self, x: Tensor) -> list[Tensor]:
        """Final latents [N, ...] as reward samples; FLUX's packed [h*w/4, 4C] tokens become [C, h, w]."""
        if isinstance(self.model, FluxModel):
            x = self.pipe._unpack_latents(x, self.model.height, self.model.width, self.pipe.vae_scale_factor)
        return list(x.unbind(0))

    def _pixels(self, samples: list[Tensor]) -> list[Tensor]:
        """Decode latent samples (as `_latent_samples` returns them) to images / videos in [0, 1] on the CPU."""
        x = torch.stack(samples)  # [n, ...]
        if isinstance(self.model, FluxModel):
            x = self.pipe._pack_latents(x, *x.shape)  # [n, h*w/4, 4C]
        return self.model.decode(x, self.decode_batch_size)

    def gallery(self, rollout: Rollout, prompts: list[dict[str, Any]], rewards: Tensor) -> list[dict[str, Any]]:
        """The first two groups: image (or frames) with prompt and reward (decoded here when samples are latents)."""
        g = len(rollout.samples) // len(prompts)
        shown = rollout.samples[: 2 * g]
        if not self.decode_samples:
            shown = self._pixels(shown)
        items = []
        for i, (s, r) in enumerate(zip(shown, rewards.tolist())):
            item = {"prompt": prompts[i // g]["prompt"], "reward": float(r)}
            if s.dim() == 4:  # video [F, 3, H, W]
                item["frames"] = list(s[:: max(1, len(s) // 4)])
            else:
                item["image"] = s
            items.append(item)
        return items


class _Filler:
    """Scatter values computed at flat positions `pos` [E] into a full [size] tensor (a stand-in adds 0 x them)."""

    def __init__(self, pos: Tensor, size: int, device, stand_in: bool):
        self.pos, self.size, self.stand_in = pos, size, stand_in
        self._index = (pos.to(device),)

    def __call__(self, base: Tensor, values: Tensor) -> Tensor:
        """[size]: `base` (detached) where nothing was computed, `values` [E] at pos; grad flows through values."""
        base = base.detach().to(values.dtype)
        if self.stand_in:  # the pair was scored only to keep ranks in step: connect the graph, change no value
            return base + 0 * values.sum()
        return base.index_put(self._index, values)
