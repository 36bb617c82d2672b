"""The video pipeline's typed settings (`pipeline.kwargs` of `video`): the vlm pipeline's model settings
(pipelines/vlm/settings.py `ModelSettings`, inherited, nothing re-declared) plus video records, frames and the
method switches (T-GRPO, TempSamp-R1 ground-truth injection, Reg-GRPO augmentation), and the policy's FrameSettings
and MethodSettings, whose defaults the frame and method fields take. No model code here.
"""

from dataclasses import dataclass
from typing import Any

from mmgrpo.errors import UserError
from pipelines.video import methods as vm
from pipelines.video.io import BACKENDS, MODES, STRATEGIES
from pipelines.video.methods import check_template
from pipelines.vlm.settings import ModelSettings, at_least

TEMPORAL = ("none", "generate", "logp_gap")


@dataclass
class FrameSettings:
    """How the video policy chooses and reads frames (io.sample_indices / io.read_frames): the one place their defaults
    live; VideoSettings' frame fields (frame_mode, num_frames, ...) default to these and build.py maps them back."""

    mode: str = "count"
    num_frames: int = 8
    fps: float = 2.0
    token_budget: int = 1024
    pixels_per_frame: int = 128 * 28 * 28
    min_frames: int = 2
    max_frames: int = 64
    strategy: str = "uniform"
    backend: str = "auto"
    cache_dir: str | None = None


@dataclass
class MethodSettings:
    """The video policy's rollout-time method switches (T-GRPO signal, TempSamp ground-truth injection, DeepVideo-R1
    augmentation): the one place their defaults live; VideoSettings' method fields (temporal, augment, ...) default
    to these (its gt_*_template null = these templates) and build.py maps them back."""

    temporal: str = "none"
    """"none" | "generate" (Video-R1: extra rollouts on shuffled frames) | "logp_gap" (re-score, no generation)"""
    temporal_samples: int | None = None
    """shuffled-frame rollouts per group with temporal="generate" (default G // 2, as Video-R1)"""
    inject_ground_truth: bool = False
    span_template: str = vm.SPAN_TEMPLATE
    answer_template: str = vm.ANSWER_TEMPLATE
    augment: bool = False
    augment_reward: Any = "video_task"
    augment_easy_min: float = 0.9
    augment_hard_max: float = 0.0
    augment_noise: float = 40.0


@dataclass
class VideoSettings(ModelSettings):
    """The video pipeline's `pipeline.kwargs` (`pipeline.name: video`): video-text-to-text GRPO (grounding, QA)."""

    data: str = "shapes_video"
    """training records: shapes_video (ShapesWorld clips), hf:<dataset> or a JSONL file of video records"""
    train_size: int | None = 64
    """training records to use; null = all (shapes_video needs a number)"""
    eval_size: int | None = 16
    """eval records to use; null = all (shapes_video needs a number)"""
    shapes_types: list[str] | None = None
    """ShapesWorld video task types to draw; null = all"""
    shapes_frames: int = 24
    """frames of a ShapesWorld clip"""
    shapes_resolution: int = 64
    """ShapesWorld frame side in pixels"""
    skip_bad_videos: bool = False
    """skip (and count) records whose video is unreadable or whose prompt is too long, instead of stopping"""
    time_prompt: bool = True
    """tell the model each sampled frame's time in seconds"""
    frame_mode: str = FrameSettings.mode
    """how many frames to read: count (num_frames), fps (frame_fps) or budget (token_budget)"""
    num_frames: int = FrameSettings.num_frames
    """frames per video with frame_mode count (>= 1)"""
    frame_fps: float = FrameSettings.fps
    """frames per second with frame_mode fps"""
    token_budget: int = FrameSettings.token_budget
    """video tokens per clip with frame_mode budget"""
    pixels_per_frame: int = FrameSettings.pixels_per_frame
    """pixel area each frame is resized to"""
    min_frames: int = FrameSettings.min_frames
    """fewest frames read (>= 1)"""
    max_frames: int = FrameSettings.max_frames
    """most frames read (>= min_frames)"""
    frame_strategy: str = FrameSettings.strategy
    """which frames: uniform or segment_random (one random frame per equal segment)"""
    video_backend: str = FrameSettings.backend
    """video reader: auto, decord or av"""
    frame_cache: str | None = FrameSettings.cache_dir
    """directory caching decoded frames; null = none"""
    temporal: str = MethodSettings.temporal
    """T-GRPO signal: none, generate (Video-R1: extra rollouts on shuffled frames) or logp_gap (re-score, no
    generation)"""
    temporal_samples: int | None = MethodSettings.temporal_samples
    """shuffled-frame rollouts per group with temporal generate (>= 1); null = G // 2, as Video-R1"""
    inject_ground_truth: bool = MethodSettings.inject_ground_truth
    """TempSamp-R1: put the ground-truth answer in each group (needs spans or answers in every training record)"""
    gt_span_template: str | None = None
    """TempSamp-R1: text of an injected span answer, with {start} and {end}; null = the default template"""
    gt_answer_template: str | None = None
    """TempSamp-R1: text of an injected answer, with {answer}; null = the default template"""
    augment: bool = MethodSettings.augment
    """Reg-GRPO / DeepVideo-R1: difficulty-aware augmentation of too easy or too hard prompts"""
    augment_reward: str | dict = MethodSettings.augment_reward
    """reward that judges a prompt's difficulty for augment: a name or {name, kwargs}"""
    augment_easy_min: float = MethodSettings.augment_easy_min
    """augment: a group mean reward >= this is too easy (the frames are noised)"""
    augment_hard_max: float = MethodSettings.augment_hard_max
    """augment: a group mean reward <= this is too hard"""
    augment_noise: float = MethodSettings.augment_noise
    """augment: pixel noise std on a 0-255 scale (>= 0)"""

    def check(self) -> None:
        """The model settings' checks, then the records, frames and method switches."""
        super().check()
        for key in ("shapes_frames", "shapes_resolution"):
            at_least(self, key, 1)
        at_least(self, "train_size", 1, " records", none_ok=True)
        at_least(self, "eval_size", 0, " records", none_ok=True)
        self._check_frames()
        self._check_methods()

    def _check_frames(self) -> None:
        for key, choices in (("frame_mode", MODES), ("frame_strategy", STRATEGIES), ("video_backend", BACKENDS)):
            if getattr(self, key) not in choices:
                raise UserError(f"pipeline.kwargs.{key} ({getattr(self, key)!r}) must be one of {choices}")
        if self.num_frames < 1 or self.max_frames < self.min_frames or self.min_frames < 1:
            raise UserError(
                f"pipeline.kwargs: need num_frames >= 1 and 1 <= min_frames <= max_frames, got num_frames="
                f"{self.num_frames}, min_frames={self.min_frames}, max_frames={self.max_frames}; e.g. "
                f"pipeline.kwargs.min_frames=2 pipeline.kwargs.max_frames=64"
            )
        for key in ("frame_fps", "token_budget", "pixels_per_frame"):
            if getattr(self, key) <= 0:
                raise UserError(f"pipeline.kwargs.{key} ({getattr(self, key)}) must be > 0")

    def _check_methods(self) -> None:
        if self.temporal not in TEMPORAL:
            raise UserError(
                f"pipeline.kwargs.temporal ({self.temporal!r}) must be one of {TEMPORAL}: 'generate' is "
                f"Video-R1's T-GRPO (extra rollouts on shuffled frames), 'logp_gap' re-scores the same "
                f"completions on shuffled frames (no generation)"
            )
        if self.temporal_samples is not None and self.temporal_samples < 1:
            raise UserError(
                f"pipeline.kwargs.temporal_samples ({self.temporal_samples}) must be >= 1 or null (G // 2)"
            )
        at_least(self, "augment_noise", 0, " (pixel std, 0-255)")
        for name in ("span_template", "answer_template"):
            template = getattr(self, f"gt_{name}")
            if template is not None:
                try:
                    check_template(name, template)
                except ValueError as err:
                    raise UserError(f"pipeline.kwargs.gt_{err}") from None
