"""Adapters for epsilon-prediction UNet pipelines (Stable Diffusion 1.x/2.x, SDXL) under the flow policy's interface.

The "sigma" the policy passes around is DDIM's alpha_bar_t (sde.ddim_moments); no diffusers scheduler is stepped.
"""

import torch
from torch import Tensor

from pipelines.flow.models import FlowModel


def ddim_schedule(scheduler_config: dict, num_steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """DDIM timesteps [T] and the alpha_bar table [T+1] the policy steps on, plus alphas_cumprod [T_train].

    Paper: DDIM arXiv:2010.02502; the timesteps are diffusers' DDIMScheduler.set_timesteps from the pipeline's own
    scheduler config (SD ships PNDM, SDXL Euler: DDPO and TRL rebuild DDIM from that config the same way).
    Formula: table[i] = alphas_cumprod[t_i] for i < T and table[T] = alphas_cumprod[t_{T-1} - T_train // T] if that
    index is >= 0, else final_alpha_cumprod. Step i runs table[i] -> table[i+1], the alpha_bar the next model call sees,
    so this equals DDIMScheduler.step (prev = t - T_train // T) whenever t_{i+1} = t_i - T_train // T: "leading"
    spacing (SD 1.x, SD 2.x base, SDXL) and "trailing" when T divides T_train. Otherwise DDIMScheduler steps to an
    alpha_bar the next call does not use; here the next call's alpha_bar is the target (no off-grid jump).
    Unlike ddpo-pytorch's and TRL's ddim_step_with_logprob, which clamp prev_timestep to >= 0 before testing it for
    < 0 (so final_alpha_cumprod is never used), the last step goes to final_alpha_cumprod: 1.0 with set_alpha_to_one.
    """
    # lazy: diffusers is heavy to import (seconds); `import pipelines` stays light
    from diffusers import DDIMScheduler

    # the ddim step has no x0 clipping or thresholding: latent models use neither (SD 1.5 ships clip_sample false)
    sched = DDIMScheduler.from_config({**scheduler_config, "clip_sample": False, "thresholding": False})
    if sched.config.prediction_type != "epsilon":
        raise ValueError(
            f"prediction_type={sched.config.prediction_type!r}: the ddim step scores epsilon-prediction "
            f"models (SD 1.x, SDXL base); v-prediction checkpoints (SD 2.x 768) are not supported"
        )
    sched.set_timesteps(num_steps)
    ts = sched.timesteps.long()  # [T]
    acp = sched.alphas_cumprod.float()  # [T_train]
    last = int(ts[-1]) - sched.config.num_train_timesteps // num_steps
    final = acp[last] if last >= 0 else torch.as_tensor(float(sched.final_alpha_cumprod))
    return ts, torch.cat([acp[ts], final.reshape(1).float()]), acp


class UNetModel(FlowModel):
    """Shared UNet plumbing: DDIM alpha_bar table, timestep lookup, VAE decode (latents / scaling_factor)."""

    _acp: Tensor | None = None

    @property
    def denoiser(self):
        return self.pipe.unet

    def sigmas(self, num_steps: int) -> Tensor:
        """[T+1] alpha_bar values for sde "ddim" (see ddim_schedule); rising from ~0 to ~1, not a flow sigma."""
        _, table, self._acp = ddim_schedule(self.pipe.scheduler.config, num_steps)
        return table

    def timestep(self, alpha_bar: Tensor) -> Tensor:
        """The training timestep [M] (long) whose alphas_cumprod equals each alpha_bar [M] (values of the table)."""
        if self._acp is None:
            self._acp = ddim_schedule(self.pipe.scheduler.config, 1)[2]
        acp = self._acp.to(alpha_bar.device)
        return (alpha_bar.float()[:, None] - acp[None, :]).abs().argmin(1)  # [M]

    def latent_shape(self):
        f = getattr(self.pipe, "vae_scale_factor", 8)
        down = 2 ** (len(self.pipe.unet.config.block_out_channels) - 1)
        if self.height % (f * down) or self.width % (f * down):
            raise ValueError(
                f"resolution {self.height}x{self.width} must be a multiple of {f * down} for this UNet "
                f"(VAE factor {f} times {down} UNet downsamplings)"
            )
        return (self.pipe.unet.config.in_channels, self.height // f, self.width // f)

    def _decode_latents(self, x):
        vae = self.pipe.vae
        return vae.decode(x / vae.config.scaling_factor, return_dict=False)[0]


class SDModel(UNetModel):
    """StableDiffusionPipeline (SD 1.x / 2.x base): one CLIP text encoder, UNet2DConditionModel predicting epsilon."""

    def _encode(self, prompts):
        emb, _ = self.pipe.encode_prompt(prompts, self.device, 1, False)
        return {"embeds": emb.to(self.dtype)}

    def forward(self, transformer, x, sigma, cond):
        return transformer(x, self.timestep(sigma), encoder_hidden_states=cond["embeds"], return_dict=False)[0]


class SDXLModel(UNetModel):
    """StableDiffusionXLPipeline: two CLIP encoders (penultimate states concatenated, pooled from the second) and the
    micro-conditioning time ids (H, W, 0, 0, H, W): original size = target size, no crop."""

    def _encode(self, prompts):
        emb, _, pooled, _ = self.pipe.encode_prompt(prompts, device=self.device, do_classifier_free_guidance=False)
        ids = torch.tensor([[self.height, self.width, 0, 0, self.height, self.width]], dtype=self.dtype)
        return {
            "embeds": emb.to(self.dtype),
            "pooled": pooled.to(self.dtype),
            "time_ids": ids.to(self.device).expand(len(prompts), 6),
        }

    def encode(self, prompts):
        """As FlowModel.encode; the empty negative prompt is zeros when the pipeline says so (SDXL's
        force_zeros_for_empty_prompt, what StableDiffusionXLPipeline.__call__ does)."""
        if (
            self.cfg
            and self.negative is None
            and not self.negative_prompt
            and self.pipe.config.get("force_zeros_for_empty_prompt", False)
        ):
            self.negative = {k: torch.zeros_like(v) if k != "time_ids" else v for k, v in self._encode([""]).items()}
        return super().encode(prompts)

    def forward(self, transformer, x, sigma, cond):
        added = {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}
        return transformer(
            x, self.timestep(sigma), encoder_hidden_states=cond["embeds"], added_cond_kwargs=added, return_dict=False
        )[0]


ADAPTERS = {"sd": SDModel, "sdxl": SDXLModel}
