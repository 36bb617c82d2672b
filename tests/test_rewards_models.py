"""Model rewards built tiny from configs, saved, loaded back through the real loading code, and checked
against independent computations with the underlying libraries; preprocessing against hand-computed values."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import rewards
from rewards import _tiny, rules
from rewards._images import CLIP_MEAN, CLIP_STD, read_frames, resize_crop_normalize, sample_indices

PROMPTS = ["a red cat", "a blue dog", "a red cat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_rewards")
    clip_dir = _tiny.tiny_hf_clip(root / "clip")
    return {
        "clip": clip_dir,
        "head": _tiny.tiny_aesthetic_head(root / "head.pth"),
        "open_clip": _tiny.tiny_open_clip_checkpoint(root / "hps.pt"),
        "ir": _tiny.tiny_blip_imagereward(root / "ir"),
        "ocr": _tiny.tiny_trocr(root / "ocr"),
    }


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return 0.2 + 0.6 * torch.rand(3, 3, 40, 48, generator=g)  # [N, 3, H, W] away from 0/1 so no clamping


def _pil(x: torch.Tensor) -> Image.Image:
    return Image.fromarray((x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


# ---- preprocessing --------------------------------------------------------------------------------------------
def test_resize_crop_normalize_by_hand():
    # 4x6 image, target 4: shorter side already 4 -> no resize; centre crop keeps columns 1..4 ((6-4)//2 = 1)
    x = torch.arange(3 * 4 * 6, dtype=torch.float64).reshape(1, 3, 4, 6) / 100.0
    out = resize_crop_normalize(x, 4)
    # channel 0, row 0, column 1 of the input is 0.01: (0.01 - 0.48145466) / 0.26862954 = -1.75500...
    assert out.shape == (1, 3, 4, 4)
    assert out[0, 0, 0, 0].item() == pytest.approx((0.01 - 0.48145466) / 0.26862954)
    # channel 2, row 3, column 4: index 2*24 + 3*6 + 4 = 70 -> 0.70; (0.70 - 0.40821073) / 0.27577711 = 1.05803...
    assert out[0, 2, 3, 3].item() == pytest.approx((0.70 - 0.40821073) / 0.27577711)
    # bicubic resampling keeps a constant image constant: 0.5 everywhere -> (0.5 - mean_c) / std_c
    const = resize_crop_normalize(torch.full((1, 3, 10, 20), 0.5), 4)
    expect = torch.tensor([(0.5 - m) / s for m, s in zip(CLIP_MEAN, CLIP_STD)]).view(1, 3, 1, 1).expand(1, 3, 4, 4)
    torch.testing.assert_close(const, expect.float(), atol=1e-5, rtol=0)


def test_resize_truncates_the_long_side_like_torchvision():
    # 10x17 to shorter side 4: long side int(4 * 17 / 10) = int(6.8) = 6 (rounding would give 7 and shift the crop);
    # crop columns (6 - 4) // 2 = 1..4. Checked against torchvision's tensor Resize + CenterCrop (HPSv2's transform)
    from torchvision import transforms as T

    x = torch.rand(1, 3, 10, 17, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tv = T.Compose([T.Resize(4, interpolation=T.InterpolationMode.BICUBIC, antialias=True), T.CenterCrop(4)])
    assert T.Resize(4, interpolation=T.InterpolationMode.BICUBIC)(x).shape[-2:] == (4, 6)
    expect = (tv(x) - torch.tensor(CLIP_MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        CLIP_STD, dtype=torch.float64
    ).view(1, 3, 1, 1)
    torch.testing.assert_close(resize_crop_normalize(x, 4, clamp=False), expect)


def test_sample_indices_and_frames():
    assert sample_indices(10, 4) == [0, 3, 6, 9]  # linspace(0, 9, 4) = 0, 3, 6, 9
    assert sample_indices(9, 3) == [0, 4, 8]
    assert sample_indices(2, 5) == [0, 1]
    video = torch.arange(10).float().view(10, 1, 1, 1).expand(10, 3, 2, 2) / 10  # frame t has value t/10
    frames = read_frames(video, 4)
    assert [np.asarray(f)[0, 0, 0] for f in frames] == [0, round(0.3 * 255), round(0.6 * 255), round(0.9 * 255)]


# ---- PickScore (transformers CLIP) ------------------------------------------------------------------------------
def _independent_pickscore(model_dir, pils, prompts, divisor=1.0):
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(model_dir)
    with torch.no_grad():
        pix = proc(images=pils, return_tensors="pt")["pixel_values"]
        tok = proc.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = model.vision_model(pixel_values=pix).pooler_output @ model.visual_projection.weight.T
        txt = model.text_model(**tok).pooler_output @ model.text_projection.weight.T
        cos = (img / img.norm(dim=-1, keepdim=True) * (txt / txt.norm(dim=-1, keepdim=True))).sum(-1)
        return (model.logit_scale.exp() * cos / divisor).float()


def test_pickscore_matches_independent_path(tiny, images):
    pils = [_pil(x) for x in images]
    r = rewards.load("pickscore", model=tiny["clip"], processor=tiny["clip"], divisor=26.0, batch_size=2)
    assert (r.kind, r.input) == ("pointwise", "image") and "/ 26" in r.preprocess
    got = r(pils, PROMPTS)
    torch.testing.assert_close(got, _independent_pickscore(tiny["clip"], pils, PROMPTS, 26.0), atol=1e-5, rtol=1e-5)
    # the same (image, prompt) scores the same alone and inside a batch with a repeated prompt
    torch.testing.assert_close(r(pils[2:], PROMPTS[2:]), got[2:], atol=1e-5, rtol=1e-5)


def test_pickscore_differentiable_gradient(tiny, images):
    r = rewards.load("pickscore", model=tiny["clip"], processor=tiny["clip"], differentiable=True, dtype="float64")
    plain = rewards.load("pickscore", model=tiny["clip"], processor=tiny["clip"])
    x = images.double().clone().requires_grad_(True)
    s = r(x, PROMPTS)  # [N]
    # the torch preprocessing approximates the PIL processor: same scores within resampling differences
    torch.testing.assert_close(s.detach().float(), plain([_pil(i) for i in images], PROMPTS), atol=0.1, rtol=0.05)
    s.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # central finite difference along a random direction d: (f(x + h d) - f(x - h d)) / 2h ~ <grad, d>
    d = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = 1e-4
    with torch.no_grad():
        fd = (r(x + h * d, PROMPTS).sum() - r(x - h * d, PROMPTS).sum()) / (2 * h)
    assert fd.item() == pytest.approx((x.grad * d).sum().item(), rel=1e-3)


# ---- aesthetic (CLIP ViT-L/14 + MLP) --------------------------------------------------------------------------------
def test_aesthetic_matches_independent_path(tiny, images):
    from transformers import CLIPModel, CLIPProcessor

    pils = [_pil(x) for x in images]
    r = rewards.load("aesthetic", model=tiny["clip"], head=tiny["head"])
    assert not r.needs_prompts
    model, proc = CLIPModel.from_pretrained(tiny["clip"]).eval(), CLIPProcessor.from_pretrained(tiny["clip"])
    sd = torch.load(tiny["head"], weights_only=True)
    with torch.no_grad():
        emb = model.vision_model(pixel_values=proc(images=pils, return_tensors="pt")["pixel_values"]).pooler_output
        emb = emb @ model.visual_projection.weight.T
        h = emb / emb.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):  # Linear layers of the head (dropouts are identity at eval)
            h = h @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    torch.testing.assert_close(r(pils), h.squeeze(-1), atol=1e-5, rtol=1e-5)
    # differentiable: float [N, 3, H, W] in, gradient reaches the pixels, scores close to the PIL processor's
    diff = rewards.load("aesthetic", model=tiny["clip"], head=tiny["head"], differentiable=True)
    x = images.clone().requires_grad_(True)
    s = diff(x)
    s.sum().backward()
    assert s.requires_grad and x.grad.abs().sum() > 0
    torch.testing.assert_close(s.detach(), h.squeeze(-1).float(), atol=0.05, rtol=0.05)


# ---- open_clip: HPSv2.1 and CLIP score ------------------------------------------------------------------------------
def test_hps_and_clip_score_match_open_clip(tiny, images):
    import open_clip

    pils = [_pil(x) for x in images]
    hps = rewards.load("hpsv2", model=_tiny.TINY_OPEN_CLIP, checkpoint=tiny["open_clip"])
    cs = rewards.load(
        "clip_score", model=_tiny.TINY_OPEN_CLIP, pretrained=None, checkpoint=tiny["open_clip"], scale=100.0
    )
    from torchvision import transforms as T

    model, _, preprocess = open_clip.create_model_and_transforms(_tiny.TINY_OPEN_CLIP, pretrained=None)
    model.load_state_dict(torch.load(tiny["open_clip"], weights_only=True)["state_dict"])
    model.eval()
    # HPSv2's own open_clip fork: ToTensor first, then Resize/CenterCrop on the float tensor, then Normalize
    hps_tf = T.Compose(
        [
            T.ToTensor(),
            T.Resize(32, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(32),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )
    with torch.no_grad():
        txt = F.normalize(model.encode_text(open_clip.get_tokenizer(_tiny.TINY_OPEN_CLIP)(PROMPTS)), dim=-1)
        img = F.normalize(model.encode_image(torch.stack([preprocess(p) for p in pils])), dim=-1)
        img_hps = F.normalize(model.encode_image(torch.stack([hps_tf(p) for p in pils])), dim=-1)
        expect, expect_hps = (img * txt).sum(-1), (img_hps * txt).sum(-1)
    assert "ToTensor then bicubic tensor resize" in hps.preprocess
    torch.testing.assert_close(hps(pils, PROMPTS), expect_hps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cs(pils, PROMPTS), 100 * expect, atol=1e-3, rtol=1e-5)
    # the paper's CLIP-S = 2.5 * max(cos, 0)
    paper = rewards.load(
        "clip_score",
        model=_tiny.TINY_OPEN_CLIP,
        pretrained=None,
        checkpoint=tiny["open_clip"],
        scale=2.5,
        clamp_zero=True,
    )
    torch.testing.assert_close(paper(pils, PROMPTS), 2.5 * expect.clamp(min=0), atol=1e-5, rtol=1e-5)
    # unit vectors by hand: cos((1,0), (0.6,0.8)) = 0.6 -> 2.5 * 0.6 = 1.5; cos((1,0), (-0.6,0.8)) = -0.6 -> 0
    img, txt = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[0.6, 0.8], [-0.6, 0.8]])
    assert paper.head(img, txt).tolist() == pytest.approx([1.5, 0.0])
    assert cs.head(img, txt).tolist() == pytest.approx([60.0, -60.0])  # scale 100, no clamp
    diff = rewards.load("hpsv2", model=_tiny.TINY_OPEN_CLIP, checkpoint=tiny["open_clip"], differentiable=True)
    x = images.clone().requires_grad_(True)
    diff(x, PROMPTS).sum().backward()
    assert x.grad.abs().sum() > 0


# ---- ImageReward (BLIP) ---------------------------------------------------------------------------------------------
def test_imagereward_batched_matches_independent_loop(tiny, images):
    from torchvision import transforms as T
    from transformers import BertTokenizer, BlipForImageTextRetrieval

    from rewards.imagereward import IR_MEAN, IR_STD

    pils = [_pil(x) for x in images]
    r = rewards.load("imagereward", model=tiny["ir"], batch_size=3)
    got = r(pils, PROMPTS)
    net = BlipForImageTextRetrieval.from_pretrained(tiny["ir"]).eval()
    tok = BertTokenizer.from_pretrained(tiny["ir"])
    head = torch.load(f"{tiny['ir']}/imagereward_head.pt", weights_only=True)
    tf = T.Compose(
        [
            T.Resize(32, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(32),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )
    expect = []
    with torch.no_grad():
        for im, p in zip(pils, PROMPTS):  # one image at a time, as the image-reward package does
            emb = net.vision_model(pixel_values=tf(im)[None]).last_hidden_state
            t = tok(p, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
            h = net.text_encoder(
                input_ids=t["input_ids"], attention_mask=t["attention_mask"], encoder_hidden_states=emb
            ).last_hidden_state[:, 0]
            for i in (0, 2, 4, 6, 7):
                h = h @ head[f"layers.{i}.weight"].T + head[f"layers.{i}.bias"]
            expect.append((h.item() - IR_MEAN) / IR_STD)
    torch.testing.assert_close(got, torch.tensor(expect), atol=1e-4, rtol=1e-4)


def test_imagereward_loads_the_original_checkpoint_format(tmp_path, images):
    # the default load path: THUDM's ImageReward.pt (BLIP timm-ViT + BERT + mlp names) converted onto transformers'
    # BLIP, with every size read from the weights. Width 64 = one 64-wide head, as BLIP's ViT-L (1024 = 16 x 64).
    ir_dir = _tiny.tiny_blip_imagereward(tmp_path / "ir", width=64, text_width=64)
    pt = tmp_path / "ImageReward.pt"
    torch.save(_tiny.original_imagereward_state_dict(ir_dir), pt)
    pils = [_pil(x) for x in images]
    from_pt = rewards.load("imagereward", model=str(pt), tokenizer=ir_dir)
    from_dir = rewards.load("imagereward", model=ir_dir)
    assert from_pt.image_size == 32 and from_pt.vision.config.num_attention_heads == 1
    torch.testing.assert_close(from_pt(pils, PROMPTS), from_dir(pils, PROMPTS), atol=1e-6, rtol=1e-6)
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(rewards.UserError, match="not an ImageReward checkpoint"):
        rewards.load("imagereward", model=str(tmp_path / "other.pt"), tokenizer=ir_dir)


def test_imagereward_original_checkpoint_conversion(tiny):
    from transformers import BlipForImageTextRetrieval

    from rewards.imagereward import convert_original_state_dict

    net = BlipForImageTextRetrieval.from_pretrained(tiny["ir"])
    # hand-written BLIP (timm ViT) names for a few HF keys, as in THUDM's ImageReward.pt
    original = {
        "blip.visual_encoder.cls_token": net.vision_model.embeddings.class_embedding,
        "blip.visual_encoder.pos_embed": net.vision_model.embeddings.position_embedding,
        "blip.visual_encoder.patch_embed.proj.weight": net.vision_model.embeddings.patch_embedding.weight,
        "blip.visual_encoder.blocks.1.attn.qkv.weight": net.vision_model.encoder.layers[1].self_attn.qkv.weight,
        "blip.visual_encoder.blocks.0.attn.proj.bias": net.vision_model.encoder.layers[0].self_attn.projection.bias,
        "blip.visual_encoder.blocks.0.norm2.weight": net.vision_model.encoder.layers[0].layer_norm2.weight,
        "blip.visual_encoder.norm.bias": net.vision_model.post_layernorm.bias,
        "blip.text_encoder.encoder.layer.0.crossattention.self.query.weight": net.text_encoder.encoder.layer[
            0
        ].crossattention.self.query.weight,
        "mlp.layers.0.weight": torch.zeros(1),
    }
    blip, head = convert_original_state_dict(original)
    state = net.state_dict()
    assert set(head) == {"layers.0.weight"}
    assert len(blip) == len(original) - 1
    for key, value in blip.items():
        assert key in state, key
        assert state[key].data_ptr() == value.data_ptr() or torch.equal(state[key], value)


# ---- OCR (TrOCR-style VisionEncoderDecoder) -----------------------------------------------------------------------
def test_ocr_reads_with_generate_and_scores(tiny, images):
    r = rewards.load("ocr", model=tiny["ocr"], max_new_tokens=5)
    # preprocessing by hand: a flat 40x60 image of grey 51 (= 0.2) resized to 32x32 stays flat, (0.2 - 0.5) / 0.5
    assert "resize to 32x32" in r.preprocess
    flat = Image.fromarray(np.full((40, 60, 3), 51, np.uint8))
    pix = r.image_processor(images=[flat], return_tensors="pt")["pixel_values"]
    assert pix.shape == (1, 3, 32, 32)
    torch.testing.assert_close(pix, torch.full((1, 3, 32, 32), -0.6), atol=1e-5, rtol=0)
    o_id = r.tokenizer.convert_tokens_to_ids("o")
    proj = torch.nn.Linear(32, len(r.tokenizer), bias=True)  # force the decoder to emit "o" at every step
    with torch.no_grad():
        proj.weight.zero_()
        proj.bias.fill_(-10.0)
        proj.bias[o_id] = 10.0
    r.model.decoder.output_projection = proj
    assert r.read(images[:1]) == ["ooooo"]
    # 'ooooo' vs 'oops': 2 substitutions + 1 deletion = 3 -> 1 - 3/4 = 0.25; vs 'OOOOO': exact -> 1
    out = r(images[:2], ['a sign that says "OOPS"', 'a sign that says "OOOOO"'])
    assert out.tolist() == [0.25, 1.0]
    assert r(images[:1], ["anything"], texts=["o o o o o"]).tolist() == [1.0]
    # 'ooooo' vs 'ooo': 2 deletions -> 1 - 2/3; Flow-GRPO's substring rule (substring=True) gives 1
    assert r(images[:1], ['says "OOO"']).item() == pytest.approx(1 / 3)
    r.substring = True
    assert r(images[:1], ['says "OOO"']).item() == 1.0
    with pytest.raises(ValueError, match="no quoted text"):
        r(images[:1], ["no quotes here"])
    assert rules.ocr_similarity("ooooo", "oops") == 0.25


# ---- video frames -----------------------------------------------------------------------------------------------
def test_video_frames_reduce_over_sampled_frames():
    # jpeg incompressibility per frame; the video reward is the mean over 3 of the 5 frames (indices 0, 2, 4)
    rng = np.random.default_rng(0)
    video = np.stack([np.full((16, 16, 3), 100, np.uint8)] * 5)  # [T, H, W, 3]
    video[2] = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    frame = rewards.load("jpeg_incompressibility")
    per = frame([video[0], video[2], video[4]])
    vr = rewards.load("video_frames", image_reward="jpeg_incompressibility", num_frames=3)
    assert vr.input == "video"
    assert vr([video, video]).tolist() == pytest.approx([per.mean().item()] * 2)
    vmin = rewards.load("video_frames", image_reward="jpeg_incompressibility", num_frames=3, reduce="min")
    assert vmin([video]).item() == pytest.approx(per.min().item())
    with pytest.raises(ValueError, match="reduce"):
        rewards.load("video_frames", image_reward="jpeg_incompressibility", reduce="median")


@pytest.mark.parametrize("backend", ["decord", "av"])
def test_video_frames_from_a_file(tmp_path, monkeypatch, backend):
    # a 10-frame H.264 file whose frame t is flat grey 20*t; 4 frames at linspace(0, 9, 4) = 0, 3, 6, 9 -> greys
    # 0, 60, 120, 180, mean 90. The image reward is the mean pixel / 255, so the video scores 90/255 (codec error
    # on a flat frame is a few grey levels: tolerance 4/255)
    import sys

    av = pytest.importorskip("av")
    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV build has no libx264 encoder")
    if backend == "decord":
        pytest.importorskip("decord")
    else:
        monkeypatch.setitem(sys.modules, "decord", None)  # import decord raises ImportError: the PyAV fallback
    path = tmp_path / "grey.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=8, options={"qp": "0"})
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv444p"
        for t in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 20 * t, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    from rewards.api import FunctionReward
    from rewards.video import FrameReward

    brightness = FunctionReward(
        lambda s, p: [np.asarray(im, np.float64).mean() / 255 for im in s], name="brightness", input="image"
    )
    r = FrameReward(brightness, num_frames=4, reduce="mean")
    assert r([str(path)]).item() == pytest.approx(90 / 255, abs=4 / 255)
    assert FrameReward(brightness, num_frames=4, reduce="max")([str(path)]).item() == pytest.approx(
        180 / 255, abs=4 / 255
    )


def test_registered_video_model_loads_by_name():
    # a VideoAlign-style model plugs in by name, so RewardSet, the server and the CLI can use it
    from rewards.api import REWARDS
    from rewards.video import VideoModelReward, register_video_model

    def factory(num_frames: int = 3):
        return VideoModelReward(lambda videos, prompts: [len(v) * 1.0 for v in videos], num_frames=num_frames)

    register_video_model("test_frames_seen", factory, range="[0, inf)", paper="test")
    try:
        per, total = rewards.RewardSet([{"name": "test_frames_seen", "weight": 2.0}])(
            [torch.rand(10, 3, 4, 4), torch.rand(2, 3, 4, 4)], ["a", "b"]
        )
        assert rewards.info("test_frames_seen")["input"] == "video"
        assert per.tolist() == [[3.0], [2.0]] and total.tolist() == [6.0, 4.0]  # 3 sampled frames; a 2-frame video
    finally:
        REWARDS._items.pop("test_frames_seen", None)
        REWARDS._meta.pop("test_frames_seen", None)


def test_video_model_hook():
    from rewards.video import VideoModelReward

    seen = {}

    def fn(videos, prompts):
        seen["frames"] = [len(v) for v in videos]
        return [float(len(p)) for p in prompts]

    r = VideoModelReward(fn, num_frames=4)
    assert r([torch.rand(10, 3, 8, 8), torch.rand(2, 3, 8, 8)], ["ab", "abc"]).tolist() == [2.0, 3.0]
    assert seen["frames"] == [4, 2]


# ---- offline errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, kwargs, model_id, kwarg",
    [
        ("pickscore", {}, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "processor"),
        ("pickscore", {"processor": "CLIP_DIR"}, "yuvalkirstain/PickScore_v1", "model"),
        ("imagereward", {}, "THUDM/ImageReward/ImageReward.pt", "model"),
        ("ocr", {}, "microsoft/trocr-base-printed", "model"),
        ("clip_score", {}, "ViT-L-14:openai", "pretrained"),
        ("hpsv2", {}, "xswu/HPSv2/HPS_v2.1_compressed.pt", "checkpoint"),
        ("aesthetic", {}, "trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth", "head"),
        ("aesthetic", {"head": "HEAD_FILE"}, "openai/clip-vit-large-patch14", "processor"),
    ],
)
def test_missing_model_offline_is_one_line(tiny, name, kwargs, model_id, kwarg, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {k: {"CLIP_DIR": tiny["clip"], "HEAD_FILE": tiny["head"]}.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(rewards.UserError) as info:
        rewards.load(name, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and repr(model_id) in msg and "HF_HUB_OFFLINE=1" in msg
    # a single downloaded file (checkpoint, head, ImageReward.pt) is passed as a file path, a model as a directory
    local = "/path/to/" + model_id.rsplit("/", 1)[-1] if model_id.endswith((".pt", ".pth")) else "/path/to/dir"
    assert f'rewards.load({name!r}, {kwarg}="{local}")' in msg and f"--kw {kwarg}={local}" in msg


def test_shapes_geneval_wrapper():
    verifier = pytest.importorskip("mmgrpo_shapes.verifier")
    img = np.zeros((64, 64, 3), np.uint8)
    r = rewards.load("shapes_geneval", mode="strict")
    got = r([img], ["a red circle"])
    expect = verifier.score([img], ["a red circle"], mode="strict")
    assert got.tolist() == pytest.approx(np.asarray(expect, dtype=np.float32).tolist())
