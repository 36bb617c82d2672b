"""Odd VLM and video inputs built on the fly (issue 16): EXIF orientation, 16-bit and other image modes scaled to 8
bits, images the processor refuses, special tokens in user text, directories as paths, prompts over the model's length.
"""

import json
import warnings

import numpy as np
import pytest
from PIL import Image

from mmgrpo.errors import UserError
from pipelines.vlm.data import MAX_ASPECT_RATIO, check_prompt_lengths, jsonl_records, load_image, prompt_tokens, to_rgb
from pipelines.vlm.policy import SampleSettings, chat_prompt


def _rows(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _png(tmp_path, name, w, h, value=100):
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(tmp_path / name)
    return name


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    # the tiny Qwen2-VL processor alone (the real Qwen2VLProcessor class; no model weights to build)
    from pipelines.vlm.tiny import _processor, qwen_tokenizer

    tok = qwen_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return _processor("qwen2_vl", tok, min_pixels=56**2, max_pixels=112**2)


# ----------------------------------------------------------------------------- pixels


def test_exif_orientation_is_applied(tmp_path):
    # 4 wide x 2 tall, left half red, right half blue, stored with Orientation=6 ("rotate 90 CW to display")
    arr = np.zeros((2, 4, 3), np.uint8)
    arr[:, :2] = (255, 0, 0)
    arr[:, 2:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "r.png", exif=exif.tobytes())
    out = np.asarray(load_image(tmp_path / "r.png"))
    # displayed upright: 2 wide x 4 tall; rotating 90 CW puts the (left) red half on top
    assert out.shape == (4, 2, 3)
    assert (out[:2] == (255, 0, 0)).all() and (out[2:] == (0, 0, 255)).all()


def test_16_bit_png_is_scaled_not_clipped(tmp_path):
    # 16-bit grey 0, 257*128 = 32896, 65535 -> 8-bit 0, 128, 255 (v / 257); clipping would give 0, 255, 255
    Image.fromarray(np.array([[0, 32896, 65535]], np.uint16)).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as im:
        assert im.mode.startswith("I")  # Pillow opens it as I;16 (or I): the mode that used to be clipped
    out = np.asarray(load_image(str(tmp_path / "g16.png")))
    assert out.shape == (1, 3, 3) and out[0, :, 0].tolist() == [0, 128, 255]
    assert (out[..., 0] == out[..., 2]).all()  # grey stays grey


@pytest.mark.parametrize(
    "image, expect",
    [
        (Image.fromarray(np.array([[0, 1000, 65535]], np.int32), mode="I"), [0, 4, 255]),  # 1000 / 257 = 3.9 -> 4
        (Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32), mode="F"), [0, 128, 255]),  # x255: 127.5 -> 128
        # float outside [0, 1]: its min..max onto 0..255: (-1, 1, 3) -> 0, 127.5 -> 128, 255
        (Image.fromarray(np.array([[-1.0, 1.0, 3.0]], np.float32), mode="F"), [0, 128, 255]),
    ],
)
def test_int_and_float_modes_are_scaled(image, expect):
    assert np.asarray(to_rgb(image))[0, :, 0].tolist() == expect


def test_transparency_is_composited_on_white_and_cmyk_converted():
    la = Image.fromarray(np.array([[[0, 0], [0, 255]]], np.uint8), mode="LA")  # a transparent and an opaque black
    assert np.asarray(to_rgb(la))[0].tolist() == [[255, 255, 255], [0, 0, 0]]
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    p.putpixel((1, 0), 1)
    p.info["transparency"] = 0  # palette entry 0 is transparent
    assert np.asarray(to_rgb(p))[0].tolist() == [[255, 255, 255], [10, 20, 30]]
    cmyk = Image.new("CMYK", (1, 1), (0, 255, 255, 0))  # pure red in CMYK
    assert np.asarray(to_rgb(cmyk))[0].tolist() == [[255, 0, 0]]


# ----------------------------------------------------------------------------- records refused at load time


def test_aspect_ratio_limit_is_the_processors(processor):
    # the processor accepts 10x2000 (ratio 200) and refuses 10x2001 (200.1): the load-time check draws the same line
    settings = SampleSettings(instruction=None)
    ok = Image.fromarray(np.zeros((10 * MAX_ASPECT_RATIO, 10, 3), np.uint8))
    bad = Image.fromarray(np.zeros((10 * MAX_ASPECT_RATIO + 1, 10, 3), np.uint8))
    chat, _ = chat_prompt(processor, settings, {"prompt": "q", "image": ok})
    processor(text=[chat], images=[ok], return_tensors="pt")
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(text=[chat], images=[bad], return_tensors="pt")


def test_extreme_aspect_ratio_is_refused_naming_the_row_or_skipped(tmp_path):
    path = _rows(
        tmp_path,
        [
            {"image": _png(tmp_path, "ok.png", 8, 8), "question": "q", "answer": "a"},
            {"id": "strip", "image": _png(tmp_path, "s.png", 3, 2000), "question": "q", "answer": "a"},
            {"image": _png(tmp_path, "edge.png", 10, 2000), "question": "q", "answer": "a"},
        ],
    )
    with pytest.raises(
        UserError,
        match=r"data.jsonl:2 \(id 'strip'\): image .*s.png' is 3x2000 pixels: aspect ratio "
        r"667 exceeds the 200 .*skip_bad_images=true",
    ) as info:
        jsonl_records(path)
    assert "\n" not in str(info.value)
    with pytest.warns(UserWarning, match=r"skipped 1 row.*line 2: image .* aspect ratio 667"):
        recs = jsonl_records(path, skip_bad_images=True)
    assert [r["image"].rsplit("/", 1)[1] for r in recs] == ["ok.png", "edge.png"]


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|im_start|>"])
def test_special_tokens_in_the_question_are_refused_or_skipped(tmp_path, token):
    path = _rows(
        tmp_path,
        [{"image": _png(tmp_path, "a.png", 8, 8), "question": f"what is {token} here", "answer": "a", "id": 7}],
    )
    with pytest.raises(
        UserError,
        match=rf"data.jsonl:1 \(id 7\): the question contains the special token "
        rf"'{__import__('re').escape(token)}'",
    ):
        jsonl_records(path)
    with pytest.warns(UserWarning, match="skipped 1 row"):
        assert jsonl_records(path, skip_bad_images=True) == []


def test_a_directory_is_reported_as_a_directory(tmp_path):
    (tmp_path / "imgs").mkdir()
    path = _rows(tmp_path, [{"image": "imgs", "question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"data.jsonl:1: image .*imgs' is a directory, not an image file"):
        jsonl_records(path)


# ----------------------------------------------------------------------------- prompt length


def test_prompt_tokens_match_the_processor(processor):
    settings = SampleSettings(instruction="Answer briefly.")
    for image in (np.zeros((32, 48, 3), np.uint8), np.zeros((70, 20, 3), np.uint8)):
        chat, images = chat_prompt(processor, settings, {"prompt": "how many shapes?", "image": [image, image]})
        n, n_image = prompt_tokens(processor, chat, images)
        enc = processor(text=[chat], images=images, return_tensors="pt")
        assert n == enc["input_ids"].shape[1]
        assert n_image == int((enc["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())


def test_too_long_prompts_are_refused_or_skipped(processor, tmp_path):
    settings = SampleSettings(instruction=None)
    img = np.zeros((28, 28, 3), np.uint8)
    short = {"prompt": "q", "image": img, "_where": "data.jsonl:1"}
    long_ = {"prompt": "word " * 100, "image": img, "_where": "data.jsonl:2 (id 'long')"}

    def count(rec):
        return prompt_tokens(processor, *chat_prompt(processor, settings, rec))

    n_long = count(long_)[0]
    kw = {"positions": 2048, "max_prompt_length": None, "max_new_tokens": 64, "field": "pipeline.kwargs.data"}
    assert check_prompt_lengths([short, long_], count, skip=False, **kw) == [short, long_]
    kw["positions"] = n_long + 63  # one token short of room for max_new_tokens=64
    with pytest.raises(
        UserError,
        match=rf"data.jsonl:2 \(id 'long'\): the prompt is {n_long} tokens \(\d+ of them "
        rf"image tokens\), over .*the model's {n_long + 63} positions minus "
        rf"max_new_tokens 64.*skip_bad_images=true",
    ):
        check_prompt_lengths([short, long_], count, skip=False, **kw)
    kw.update(positions=2048, max_prompt_length=n_long - 1)
    with pytest.raises(UserError, match=rf"over the {n_long - 1} allowed by pipeline.kwargs.max_prompt_length"):
        check_prompt_lengths([short, long_], count, skip=False, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_prompt_lengths([short, long_], count, skip=True, **kw) == [short]
    assert any("skipped 1 record" in str(w.message) for w in caught)
    with pytest.raises(UserError, match="the model can take none of the records"):
        check_prompt_lengths([long_], count, skip=True, **kw)


def test_the_loaded_processors_special_tokens_are_refused(processor):
    # beyond the Qwen tokens checked at load: whatever the loaded processor calls special (a LLaVA-style <image> here)
    from pipelines.vlm.data import model_special_tokens

    assert {"<|image_pad|>", "<|video_pad|>", "<|im_end|>"} <= set(model_special_tokens(processor))
    rec = {"prompt": "<image>\nWhat is shown?", "_where": "llava.jsonl:4 (id 9)"}
    kw = {"positions": None, "max_prompt_length": None, "max_new_tokens": 8, "field": "pipeline.kwargs.data"}
    assert check_prompt_lengths([rec], lambda r: (0, 0), skip=False, **kw) == [rec]
    with pytest.raises(
        UserError,
        match=r"llava.jsonl:4 \(id 9\): the question contains the special token '<image>'.*"
        r"remove it, or set pipeline.kwargs.skip_bad_images=true",
    ):
        check_prompt_lengths([rec], lambda r: (0, 0), skip=False, special_tokens=("<image>",), **kw)


# ----------------------------------------------------------------------------- video records


def test_video_directory_and_special_tokens(tmp_path):
    from pipelines.video.data import jsonl_records as video_records

    (tmp_path / "clips").mkdir()
    path = tmp_path / "v.jsonl"
    path.write_text(json.dumps({"video": "clips", "question": "when?", "spans": [0, 1]}) + "\n")
    with pytest.raises(UserError, match=r"v.jsonl:1: video .*clips' is a directory, not a video file"):
        video_records(path)
    path.write_text(
        json.dumps({"id": "x", "video": "a.mp4", "question": "<|video_pad|> when?", "spans": [0, 1]}) + "\n"
    )
    with pytest.raises(
        UserError, match=r"v.jsonl:1 \(id 'x'\): the question contains the special token '<\|video_pad"
    ):
        video_records(path)
    assert video_records(path, skip_bad_videos=True) == []


def test_special_tokens_in_the_instruction_are_refused():
    from pipelines.vlm.settings import VLMSettings

    kw = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "logp_chunk_tokens": 64, "model_dtype": None}
    VLMSettings(**kw, instruction="Answer in <answer></answer>.", system_prompt=None).check()
    with pytest.raises(
        UserError,
        match=r"pipeline.kwargs.instruction: the instruction contains the special token "
        r"'<\|im_end\|>'",
    ):
        VLMSettings(**kw, instruction="Answer.<|im_end|>", system_prompt=None).check()
    with pytest.raises(UserError, match=r"pipeline.kwargs.max_prompt_length \(0\) must be a whole number"):
        VLMSettings(**kw, max_prompt_length=0).check()


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_video_prompt_tokens_match_the_processor(tmp_path, kind):
    # the count from the video header equals the length of what VideoPolicy.encode really feeds the model
    from types import SimpleNamespace

    from mmgrpo_shapes.video import make_video_set
    from pipelines.video.data import video_prompt_tokens
    from pipelines.video.policy import FrameSettings, VideoPolicy
    from pipelines.vlm.tiny import _processor, qwen_tokenizer

    make_video_set("train", 1, tmp_path / "clips", seed=0, num_frames=16, fps=4, resolution=48, types=("grounding",))
    video = next((tmp_path / "clips").rglob("*.mp4"))
    proc = _processor(kind, qwen_tokenizer(str(tmp_path / "tok")), min_pixels=56**2, max_pixels=112**2)
    for n in (4, 6):
        policy = SimpleNamespace(processor=proc, frames=FrameSettings(num_frames=n), s=SampleSettings(), device="cpu")
        rec = {"video": str(video), "prompt": "When does the red circle move?"}
        ids = VideoPolicy.encode(policy, rec)["input_ids"]  # [1, L]
        video_tokens = int((ids == proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum())
        assert video_prompt_tokens(policy, rec) == (ids.shape[1], video_tokens)
