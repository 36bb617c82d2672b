"""VLM policy on tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL: real processor round trip, exact first ratio, seeded rollouts,
stop handling, data errors naming the row, LoRA state round trip, and the offline-model error."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import pipelines.vlm  # noqa: F401  registers "vlm" until pipelines/__init__ imports it
from mmgrpo.errors import UserError
from mmgrpo.plugins import PIPELINES
from pipelines.vlm.build import build_vlm
from pipelines.vlm.data import jsonl_records
from pipelines.vlm.tiny import SPECIALS, TAGS, tiny_model_dir

MODELS = ["tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl", "tiny-random-qwen3-vl"]
CLASSES = {
    "tiny-random-qwen2-vl": "Qwen2VL",
    "tiny-random-qwen2.5-vl": "Qwen2_5_VL",
    "tiny-random-qwen3-vl": "Qwen3VL",
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_models"))


def _task(cache, model="tiny-random-qwen2-vl", **kw):
    kw = {"train_size": 4, "eval_size": 2, "max_new_tokens": 10, **kw}
    return build_vlm(seed=0, device=CPU, model=model, cache_dir=cache, **kw)


@pytest.mark.parametrize("name", MODELS)
def test_tiny_model_loads_with_real_classes(cache, name):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_model_dir(name, cache)
    proc = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert (
        type(proc).__name__ == f"{CLASSES[name]}Processor" and type(model.config).__name__ == f"{CLASSES[name]}Config"
    )
    tok = proc.tokenizer
    assert len(tok) == 256 + len(SPECIALS) + len(TAGS)
    assert tok.decode(tok("héllo <answer>2</answer>")["input_ids"]) == "héllo <answer>2</answer>"
    assert len(tok("</answer>")["input_ids"]) == 1
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>\n<|im_start|>assistant\n"
    enc = proc(text=[text], images=[Image.new("RGB", (32, 32))], return_tensors="pt")
    # 32x32 is resized up to min_pixels 56x56 (Qwen3-VL: 64x64): 4x4 patches of 14 (16), merged 2x2 -> 4 image tokens
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 4
    assert tuple(enc["image_grid_thw"][0].tolist()) == (1, 4, 4)


@pytest.mark.parametrize("name", MODELS)
def test_first_ratio_is_exactly_one_and_matches_generation(cache, name):
    task = _task(cache, name, check_logp=True)
    pol = task.policy
    ro = pol.rollout(task.train_data[:2], 3, [11, 12])
    assert ro.old_logp.shape == ro.mask.shape and ro.mask[:, 0].all()
    logp, aux = pol.logp(task.module, ro, torch.arange(6))
    ratio = torch.exp(logp - ro.old_logp)[ro.mask]
    assert torch.equal(ratio, torch.ones_like(ratio))  # same forward, same batch: bit-identical
    # generation-time log-probs (KV-cached decoding) agree with the recomputed full forward
    assert (ro.extras["gen_logp"] - logp.detach())[ro.mask].abs().max() < 1e-5
    assert (aux["entropy"] >= 0).all()
    # a different micro-batch split (one group, then a partial group) still gives ratio 1 within 1e-5
    part = pol.logp(task.module, ro, torch.tensor([4, 1]))[0]
    assert (part - ro.old_logp[[4, 1]])[ro.mask[[4, 1]]].abs().max() < 1e-5


def test_rollouts_are_seeded_per_prompt(cache):
    task = _task(cache)
    pol = task.policy
    a = pol.rollout(task.train_data[:2], 4, [5, 6])
    b = pol.rollout(task.train_data[1:2], 4, [6])  # prompt 1 alone, as on another rank
    k = b.old_logp.shape[1]
    assert torch.equal(a.extras["completion_ids"][4:, :k], b.extras["completion_ids"])
    assert a.samples[4:] == b.samples
    c = pol.rollout(task.train_data[:2], 4, [5, 7])
    assert c.samples[:4] == a.samples[:4] and c.samples[4:] != a.samples[4:]
    assert a.extras["reward_fields"]["lengths"] == a.mask.sum(1).tolist()


def test_mask_ends_at_stop_string_and_eos(cache):
    from pipelines.vlm.policy import _StopTracker

    tok = _task(cache).policy.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ans = tok.convert_tokens_to_ids("</answer>")
    x = tok("ab")["input_ids"]
    stops = _StopTracker(len(x), [eos], ("</answer>", "STOP"), tok)
    rows = [x + tok("c")["input_ids"], x + [eos], x + [ans], x + tok("S")["input_ids"]]
    stops(torch.tensor(rows))
    rows = [r + tok("T")["input_ids"] for r in rows]
    stops(torch.tensor(rows))
    rows = [r + tok("OP")["input_ids"] for r in rows]
    done = stops(torch.tensor([r[: len(x) + 2] + tok("O")["input_ids"] for r in rows]))
    # row 0 "cTO": running; row 1 eos at 1; row 2 "</answer>" token at 1; row 3 "STO": running
    assert stops.done_at.tolist() == [-1, 1, 1, -1] and done.tolist() == [False, True, True, False]
    stops(torch.tensor([r[: len(x) + 3] + tok("P")["input_ids"] for r in rows]))
    assert stops.done_at.tolist() == [-1, 1, 1, 4]  # "STOP" completes at the 4th token, split over 4 tokens


def test_vision_placeholders_are_never_sampled(cache):
    task = _task(cache, max_new_tokens=24)
    ids = set(task.module.suppress_ids)
    assert len(ids) == 4
    ro = task.policy.rollout(task.train_data[:4], 8, [1, 2, 3, 4])
    assert not torch.isin(ro.extras["completion_ids"][ro.mask], torch.tensor(sorted(ids))).any()


def test_lora_state_round_trip(cache):
    task = _task(cache, lora_rank=4)
    pol = task.policy
    state = pol.state_dict()
    assert state and all("lora_" in k for k in state)
    n_train = sum(p.numel() for p in pol.trainable_parameters())
    assert n_train == sum(v.numel() for v in state.values())
    assert not any("visual" in k for k in state)
    noisy = {k: v + torch.randn_like(v) for k, v in state.items()}
    pol.load_state_dict(noisy)
    assert all(torch.equal(pol.state_dict()[k], noisy[k]) for k in state)
    with pytest.raises(ValueError, match="do not match"):
        pol.load_state_dict({k: v for k, v in list(state.items())[1:]})
    # reference = adapter disabled: with non-zero B the policy differs from the reference
    ro = pol.rollout(task.train_data[:1], 2, [0])
    assert (pol.ref_logp(ro, torch.arange(2)) - ro.old_logp)[ro.mask].abs().max() > 1e-4


def test_lora_export_loads_with_peft(cache, tmp_path):
    """The checkpoint's export/ is a peft adapter folder: PeftModel.from_pretrained on the base model gives the
    trained adapter (the same tensors); full fine-tuning exports nothing (its safetensors suffice)."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForImageTextToText

    task = _task(cache, lora_rank=4)
    pol = task.policy
    pol.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in pol.state_dict().items()})
    pol.export(tmp_path)
    assert (tmp_path / "adapter_config.json").exists() and (tmp_path / "adapter_model.safetensors").exists()
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir("tiny-random-qwen2-vl", cache))
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, tmp_path))
    trained = pol.state_dict()
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)
    full = tmp_path / "full"
    full.mkdir()
    _task(cache).policy.export(full)
    assert not any(full.iterdir())


def test_full_finetune_reference_is_a_frozen_copy(cache):
    task = _task(cache)
    pol = task.policy
    assert pol.reference == "copy" and all(not p.requires_grad for p in pol.ref_module.parameters())
    ro = pol.rollout(task.train_data[:1], 2, [0])
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (pol.ref_logp(ro, torch.arange(2)) - ro.old_logp)[ro.mask].abs().max() < 1e-6
    none = _task(cache, reference="none").policy
    with pytest.raises(ValueError, match="kl_coef"):
        none.ref_logp(ro, torch.arange(2))


def _write_jsonl(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_data_errors_name_the_row(tmp_path):
    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "img" / "ok.png")
    (tmp_path / "img" / "bad.png").write_bytes(b"not a png")
    rows = [
        {"image": "img/ok.png", "question": "q1", "answer": "1", "boxes": [1, 2, 3, 4]},
        {"image": "img/missing.png", "question": "q2", "answer": "2", "id": "row-b"},
        {"image": "img/bad.png", "problem": "q3", "solution": "3"},
    ]
    path = _write_jsonl(tmp_path, rows)
    with pytest.raises(UserError, match=r"data.jsonl:2 \(id 'row-b'\): image .*missing.png.* does not exist"):
        jsonl_records(path)
    with pytest.warns(UserWarning, match=r"skipped 2 row\(s\).*line 2"):
        recs = jsonl_records(path, skip_bad_images=True)
    assert len(recs) == 1 and recs[0]["prompt"] == "q1" and recs[0]["answers"] == "1"
    assert recs[0]["boxes"] == [1, 2, 3, 4] and recs[0]["image"] == str(tmp_path / "img" / "ok.png")
    path.write_text(json.dumps(rows[0]) + "\n{broken\n")
    with pytest.raises(UserError, match=r"data.jsonl:2: not valid JSON"):
        jsonl_records(path)
    path.write_text(json.dumps({"image": "img/ok.png", "question": "q"}) + "\n")
    with pytest.raises(UserError, match=r"data.jsonl:1: no answer"):
        jsonl_records(path)


def test_jsonl_task_rolls_out_and_scores_answers(cache, tmp_path):
    (tmp_path / "img").mkdir()
    Image.fromarray(np.full((40, 30, 3), 200, np.uint8)).save(tmp_path / "img" / "a.png")
    path = _write_jsonl(tmp_path, [{"image": "img/a.png", "question": "How many?", "answer": "3"}] * 2)
    task = _task(cache, data=str(path), train_size=None)
    assert len(task.train_data) == 2 and task.eval_data == []
    ro = task.policy.rollout(task.train_data, 2, [0, 1])
    assert len(ro.samples) == 4 and all(isinstance(s, str) for s in ro.samples)
    items = task.policy.gallery(ro, task.train_data, torch.zeros(4))
    assert items[0]["prompt"] == "How many?" and "image" in items[0] and items[0]["answer"] == "3"


def test_missing_model_offline_is_one_line_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        build_vlm(seed=0, device=CPU, model="no-such-org/no-such-vlm-xyz", train_size=2, eval_size=1)
    msg = str(err.value)
    assert "\n" not in msg and "no-such-org/no-such-vlm-xyz" in msg and "local directory" in msg


def test_builder_registered_and_kwargs_checked():
    assert "vlm" in PIPELINES
    PIPELINES.check_kwargs("vlm", {"model": "x", "lora_rank": 8}, skip=("seed", "device", "dtype"))
    with pytest.raises(ValueError, match="lora_rnak"):
        PIPELINES.check_kwargs("vlm", {"lora_rnak": 8}, skip=("seed", "device", "dtype"))
    with pytest.raises(UserError, match="temperature"):
        build_vlm(seed=0, device=CPU, temperature=0.0)


def test_hf_dataset_records_name_bad_rows_and_roll_out(cache, tmp_path, monkeypatch):
    """data=hf:NAME[:SPLIT] through a fake `datasets` module (the package is not installed here): decoded, byte and
    path images; bad rows named by split and index, or skipped and counted; splits; missing package; load errors."""
    import io
    import sys
    from types import ModuleType

    from pipelines.vlm.data import hf_records, load_image, load_records

    png = io.BytesIO()
    Image.fromarray(np.full((30, 40, 3), 7, np.uint8)).save(png, format="PNG")
    rows = [
        {"image": Image.fromarray(np.full((32, 32, 3), 200, np.uint8)), "problem": "q0", "answer": 3, "id": "a"},
        {"images": [{"bytes": png.getvalue(), "path": None}], "question": "q1", "solution": "B"},
        {"image": {"bytes": b"junk", "path": None}, "question": "q2", "answer": "x", "id": "bad"},
        {"image": str(tmp_path / "missing.png"), "question": "q3", "answer": "y"},
    ]
    calls = []
    fake = ModuleType("datasets")
    fake.load_dataset = lambda name, split: calls.append((name, split)) or rows
    fake.load_from_disk = lambda path: {"train": rows[:2], "test": rows[:1]}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(UserError, match=r"hf:org/geo \[train\] row 2 \(id 'bad'\): image bytes cannot be read"):
        hf_records("hf:org/geo", split="train")
    with pytest.warns(UserWarning, match=r"hf:org/geo \[train\]: skipped 2 row\(s\).*first: row 2"):
        recs = hf_records("hf:org/geo", split="train", skip_bad_images=True)
    assert calls[-1] == ("org/geo", "train") and [r["prompt"] for r in recs] == ["q0", "q1"]
    assert [r["answers"] for r in recs] == ["3", "B"] and recs[0]["id"] == "a"
    assert np.asarray(load_image(recs[1]["image"])).shape == (30, 40, 3)
    assert (np.asarray(load_image(recs[1]["image"])) == 7).all()
    kw = {"size": None, "seed": 0, "resolution": 32, "question_types": None, "skip_bad_images": True, "field": "f"}
    with pytest.warns(UserWarning, match="skipped 2"):
        load_records("hf:org/geo", split="val", **kw)
    assert calls[-1] == ("org/geo", "validation")  # our val split reads the dataset's validation split
    assert len(load_records("hf:org/geo:test", split="val", **{**kw, "size": 1})) == 1
    assert calls[-1] == ("org/geo", "test")
    assert [r["prompt"] for r in load_records(f"hf:{tmp_path}:test", split="train", **kw)] == ["q0"]  # save_to_disk
    with pytest.raises(UserError, match=r"could not be loaded \(KeyError: 'validation'\).*hf:NAME:SPLIT"):
        load_records(f"hf:{tmp_path}", split="val", **kw)
    # the policy samples from decoded and byte images alike
    with pytest.warns(UserWarning, match="skipped 2"):
        task = _task(cache, data="hf:org/geo", train_size=None, skip_bad_images=True)
    ro = task.policy.rollout(task.train_data, 2, [0, 1])
    assert len(ro.samples) == 4 and ro.mask[:, 0].all()

    def offline(name, split):
        raise ConnectionError(f"offline mode is enabled: {name}")

    fake.load_dataset = offline
    with pytest.raises(UserError) as err:
        hf_records("hf:org/other", split="train")
    assert "\n" not in str(err.value) and "ConnectionError" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(UserError, match="needs the datasets package"):
        hf_records("hf:org/geo", split="train")


def test_flash_attention_on_cpu_is_a_one_line_error_before_loading():
    from mmgrpo.errors import UserError
    from pipelines.vlm.build import check_attn_implementation

    check_attn_implementation("sdpa", "cpu")
    check_attn_implementation("flash_attention_2")  # validation before the device is known checks the name only
    with pytest.raises(UserError, match=r"attn_implementation=flash_attention_2 needs CUDA .*no CUDA device"):
        check_attn_implementation("flash_attention_2", "cpu")


def test_prefix_attention_reaches_the_update_and_bad_values_fail_at_build(cache, monkeypatch):
    import pipelines.vlm.policy as policy_mod

    task = _task(cache, prefix_attention="mask")
    assert task.module.shared and task.module.prefix_attention == "mask"
    seen = []
    real = policy_mod.completion_logp
    monkeypatch.setattr(
        policy_mod, "completion_logp", lambda *a, **kw: seen.append(kw["prefix_attention"]) or real(*a, **kw)
    )
    ro = task.policy.rollout(task.train_data[:1], 2, [0])
    task.policy.logp(task.module, ro, torch.arange(2))
    assert seen and set(seen) == {"mask"}
    with pytest.raises(UserError, match=r"pipeline.kwargs.prefix_attention \('dense'\) must be one of auto, grouped"):
        _task(cache, prefix_attention="dense")
    with pytest.raises(UserError, match=r"prefix_attention=grouped but text attention 'eager'"):
        _task(cache, prefix_attention="grouped", attn_implementation="eager")
