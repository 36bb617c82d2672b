"""A VLM judge for pairwise preference (Pref-GRPO with UnifiedReward-Think, arXiv:2508.20751).

The judge model runs behind an OpenAI-compatible chat endpoint (vLLM or sglang). Each request shows two candidates
(two images, or the frames of video 1 then of video 2, as JPEG q95) and the judging prompt; the reply's
<answer> ("Image 1 is better" / "Image 2 is better") is parsed by rewards.pairwise.parse_preference.
"""

import base64
import io
from typing import Any

from rewards._images import read_frames, to_pil
from rewards.api import REWARDS, Reward
from rewards.client import request_json
from rewards.pairwise import PairwiseReward

# The structure UnifiedReward-Think was trained on: caption in 「」, per-dimension 1-10 scores for both candidates,
# totals, reasoning inside <think>, then exactly one verdict inside <answer>. Wording is ours; pass template= to
# use a judge's own prompt verbatim.
IMAGE_TEMPLATE = """You compare two images generated from the same text caption and decide which one is better.

1. The caption is: 「{prompt}」. Judge both images on these core dimensions:
   - Semantic consistency: how faithfully the content follows the caption.
   - Aesthetics: composition, colour and artistic quality.
   - Authenticity: realism and fine detail.
2. You may add at most two more dimensions when they clearly matter for this caption.
3. For every dimension give Image 1 and Image 2 a score from 1 to 10 with a short rationale, one block per dimension:
   Dimension name:
       Image 1 (x/10) - rationale;
       Image 2 (y/10) - rationale
4. Then sum the scores of each image, writing the sums out:
   Total score:
   Image 1: x+x+x=total
   Image 2: y+y+y=total
5. Put all reasoning and scores inside <think> and </think>.
6. After </think>, write only the verdict inside <answer> and </answer>: either "Image 1 is better" or
   "Image 2 is better". Write nothing outside the <think> and <answer> blocks."""

VIDEO_TEMPLATE = """You compare two videos generated from the same text caption and decide which one is better.
The frames shown come from two videos: the first half of the frames is Video 1, the second half is Video 2.

1. The caption is: 「{prompt}」. Judge both videos on these core dimensions:
   - Semantic consistency: how faithfully the content follows the caption.
   - Temporal coherence: smooth, plausible motion from frame to frame.
   - Authenticity: realism and fine detail.
2. You may add at most two more dimensions when they clearly matter for this caption.
3. For every dimension give Video 1 and Video 2 a score from 1 to 10 with a short rationale, one block per dimension:
   N. Dimension name:
       Video 1 (x/10) - rationale;
       Video 2 (y/10) - rationale
4. Then sum the scores of each video, writing the sums out:
   Total score:
   Video 1: x+x+x=total
   Video 2: y+y+y=total
5. Put all reasoning and scores inside <think> and </think>.
6. After </think>, write only the verdict inside <answer> and </answer>: either "Video 1 is better" or
   "Video 2 is better". Write nothing outside the <think> and <answer> blocks."""


def jpeg_data_url(image: Any, quality: int = 95) -> str:
    """One image as a data URL (JPEG at `quality`, base64), the form OpenAI-compatible servers take inline."""
    buf = io.BytesIO()
    to_pil(image).save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class ChatJudge:
    """`judge(a, b, prompt) -> reply text`: one chat completion comparing candidate a (shown first) with b."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        input: str = "image",
        template: str | None = None,
        num_frames: int = 8,
        token: str | None = None,
        max_tokens: int = 2048,
        temperature: float = 0.0,
        jpeg_quality: int = 95,
        timeout: float = 300.0,
        retries: int = 3,
        backoff: float = 1.0,
    ):
        if input not in ("image", "video"):
            raise ValueError(f"input={input!r} must be 'image' or 'video'")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r} must be the judge's OpenAI-compatible base, e.g. http://127.0.0.1:8080/v1")
        self.template = template or (IMAGE_TEMPLATE if input == "image" else VIDEO_TEMPLATE)
        if "{prompt}" not in self.template:
            raise ValueError("template must contain {prompt} where the generation prompt goes")
        base = url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model, self.input, self.num_frames, self.token = model, input, num_frames, token
        self.max_tokens, self.temperature, self.jpeg_quality = max_tokens, temperature, jpeg_quality
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def _images(self, sample: Any) -> list[str]:
        frames = [sample] if self.input == "image" else read_frames(sample, self.num_frames)
        return [jpeg_data_url(f, self.jpeg_quality) for f in frames]

    def __call__(self, a: Any, b: Any, prompt: str | None) -> str:
        images = self._images(a) + self._images(b)
        content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        content.append({"type": "text", "text": self.template.replace("{prompt}", prompt or "")})
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        reply = request_json(
            "POST",
            self.url,
            payload,
            token=self.token,
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
            what="judge",
        )
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return ""  # an empty or malformed reply is unparsable: the pair counts as a tie (0.5)


@REWARDS.register(
    "pairwise_judge", input="image", kind="groupwise", range="[0, 1]", paper="Pref-GRPO / UnifiedReward-Think"
)
def pairwise_judge(
    *,
    url: str = "http://127.0.0.1:8080/v1",
    model: str = "CodeGoat24/UnifiedReward-Think-qwen3vl-8b",
    input: str = "image",
    template: str | None = None,
    num_frames: int = 8,
    token: str | None = None,
    symmetric: bool = False,
    max_workers: int = 16,
    max_tokens: int = 2048,
    temperature: float = 0.0,
    timeout: float = 300.0,
    retries: int = 3,
) -> Reward:
    """Pref-GRPO win rate judged by a VLM (UnifiedReward-Think-style prompt) on an OpenAI-compatible endpoint."""
    judge = ChatJudge(
        url,
        model,
        input=input,
        template=template,
        num_frames=num_frames,
        token=token,
        max_tokens=max_tokens,
        temperature=temperature,
        timeout=timeout,
        retries=retries,
    )
    return PairwiseReward(
        judge=judge,
        symmetric=symmetric,
        name="pairwise_judge",
        input=input,
        needs_prompts=True,
        max_workers=max_workers,
        preprocess=f"{model} at {judge.url}: both candidates as JPEG q95"
        + (f" ({num_frames} frames each)" if input == "video" else "")
        + ", UnifiedReward-Think prompt; <answer> parsed, tie/unparsable = 0.5; win rate over the other G-1",
    )
