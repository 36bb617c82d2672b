"""The vLLM rollout backend driven through a fake `vllm` module (a test double of the external engine that records
what it is given and returns scripted token ids; vllm itself needs CUDA and is not installed here): prompts,
sampling parameters, merged weights before each rollout, masks, and the errors that name the fix."""

import copy
import os
import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from test_vlm_rollout import _task  # the same tiny-model builder as the hf backend tests

from mmgrpo.errors import UserError
from pipelines.vlm import rollout_vllm
from pipelines.vlm.build import FORMAT_INSTRUCTION


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_vllm_models"))


class FakeLLM:
    """Records its engine arguments, weight loads, cache resets, sleeps and generate calls; returns scripted ids."""

    def __init__(self, **kwargs):
        self.kwargs, self.log = kwargs, []
        model = SimpleNamespace(load_weights=lambda w: self.log.append(("load", {n: t.clone() for n, t in w})))
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=runner))
        FAKE.engines.append(self)

    def reset_prefix_cache(self):
        self.log.append(("reset",))

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self):
        self.log.append(("wake",))

    def generate(self, inputs, sampling_params, use_tqdm=True):
        self.log.append(("generate", inputs, sampling_params))
        outs = []
        for params in sampling_params:
            comps = [
                SimpleNamespace(index=j, token_ids=tuple(FAKE.script[j % len(FAKE.script)])) for j in range(params.n)
            ]
            outs.append(SimpleNamespace(outputs=comps[::-1]))  # any order: the backend sorts by index
        return outs


FAKE = SimpleNamespace(engines=[], script=[])


@pytest.fixture
def fake_vllm(monkeypatch):
    module = ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(rollout_vllm, "check_cuda", lambda device: None)  # the engine is fake; the policy runs on CPU
    # the backend sets the launcher variables vLLM reads (RANK, WORLD_SIZE...); restore them after the test, or a later
    # accelerate run in this process believes it is distributed and waits in a barrier with no process group
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if key not in os.environ or not os.environ[key]:
            monkeypatch.delenv(key)
    FAKE.engines.clear()
    return module


@pytest.mark.filterwarnings("ignore:pipeline.kwargs.top_p < 1", "ignore:Passing `min_pixels`:FutureWarning")
def test_vllm_backend_prompts_params_weights_and_masks(cache, fake_vllm):
    task = _task(
        cache,
        rollout_backend="vllm",
        lora_rank=4,
        temperature=0.7,
        top_p=0.9,
        stop=["</answer>", "END"],
        min_pixels=3136,
        max_pixels=12544,
        vllm_gpu_memory_utilization=0.5,
        vllm_max_model_len=512,
        vllm_enable_sleep_mode=True,
        vllm_engine_kwargs={"enforce_eager": True},
    )
    pol, tok = task.policy, task.policy.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    FAKE.script = [
        tok("<think>x</think><answer>1</answer>zz")["input_ids"],  # cut after </answer>
        tok("ab")["input_ids"] + [eos] + tok("cd")["input_ids"],  # cut after EOS
        tok("q")["input_ids"] * 13,  # longer than max_new_tokens=10: truncated to 10
        tok("abEND")["input_ids"] + tok("xy")["input_ids"],
    ]  # multi-token stop string: 5
    records = task.train_data[:2]
    ro = pol.rollout(records, 4, [11, 12])
    (llm,) = FAKE.engines
    assert llm.kwargs == {
        "model": rollout_vllm_model(cache),
        "dtype": "auto",
        "seed": 0,
        "tensor_parallel_size": 1,
        "distributed_executor_backend": "external_launcher",
        "gpu_memory_utilization": 0.5,
        "enable_sleep_mode": True,
        "limit_mm_per_prompt": {"image": 1},
        "max_model_len": 512,
        "mm_processor_kwargs": {"min_pixels": 3136, "max_pixels": 12544},
        "enforce_eager": True,
    }
    assert [e[0] for e in llm.log] == ["wake", "load", "reset", "generate", "sleep"]
    _, inputs, params = llm.log[3]
    for record, inp in zip(records, inputs):
        assert inp["prompt"] == (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{record['prompt']}\n{FORMAT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )
        (image,) = inp["multi_modal_data"]["image"]
        assert np.array_equal(np.asarray(image), record["image"])
    for p, seed in zip(params, [11, 12]):
        assert vars(p) == {
            "n": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "max_tokens": 10,
            "repetition_penalty": 1.0,
            "stop": ["</answer>", "END"],
            "include_stop_str_in_output": True,
            "stop_token_ids": pol.eos_ids,
            "seed": seed,
            "logit_bias": {i: -100.0 for i in pol.module.suppress_ids},
        }
    # the HF path's stop / truncation / mask rule on vLLM's ids
    lens = [len(tok("<think>x</think><answer>1</answer>")["input_ids"]), 3, 10, 5]
    assert ro.extras["lengths"].tolist() == lens * 2
    assert ro.mask.sum(1).tolist() == lens * 2 and ro.mask.shape == (8, 10)
    first = torch.tensor(FAKE.script[0][: lens[0]])
    assert torch.equal(ro.extras["completion_ids"][4, : lens[0]], first)
    assert (ro.extras["completion_ids"][~ro.mask] == tok.pad_token_id).all()
    assert ro.samples[:4] == ["<think>x</think><answer>1</answer>", "ab", "q" * 10, "abEND"]
    assert ro.metrics["rollout/truncated_frac"] == 0.25
    # old log-probs are the training model's own: the first ratio is exactly 1
    logp, _ = pol.logp(task.module, ro, torch.arange(8))
    assert torch.equal(logp[ro.mask], ro.old_logp[ro.mask])


def rollout_vllm_model(cache):
    from pipelines.vlm.tiny import tiny_model_dir

    return tiny_model_dir("tiny-random-qwen2-vl", cache)


def test_vllm_gets_the_current_merged_weights_before_each_rollout(cache, fake_vllm):
    task = _task(cache, rollout_backend="vllm", lora_rank=4, lora_alpha=8)
    pol, hf = task.policy, task.module.hf
    FAKE.script = [[97, 98]]
    base = {n: p.detach().clone() for n, p in hf.get_base_model().named_parameters() if "lora_" not in n}
    pol.rollout(task.train_data[:1], 2, [0])
    with torch.no_grad():  # a "training step": LoRA B leaves zero, so the merged weights move
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p))
    pol.rollout(task.train_data[:1], 2, [1])
    (llm,) = FAKE.engines
    assert [e[0] for e in llm.log] == ["load", "reset", "generate"] * 2
    first, second = llm.log[0][1], llm.log[3][1]
    expected = dict(copy.deepcopy(hf).merge_and_unload().named_parameters(remove_duplicate=False))
    assert set(first) == set(second) == set(expected)  # transformers names: no base_model / base_layer / lora_
    in_peft = {n: n if n in base else ".base_layer.".join(n.rsplit(".", 1)) for n in first}  # q_proj.base_layer.bias
    assert all(torch.equal(first[n], base[in_peft[n]]) for n in first)  # B = 0 at the start: merged = base
    assert max(float((second[n] - expected[n]).abs().max()) for n in expected) < 1e-6  # W + (alpha/r) B A
    moved = [n for n in expected if not torch.equal(second[n], first[n])]
    assert (
        len(moved) == 7 * task.module.hf.get_base_model().config.text_config.num_hidden_layers
    )  # q k v o gate up down


def test_merged_weights_of_full_fine_tuning_are_the_parameters(cache):
    task = _task(cache)
    got = dict(rollout_vllm.merged_weights(task.module.hf))
    want = dict(task.module.hf.named_parameters(remove_duplicate=False))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_vllm_errors_name_the_fix(cache, fake_vllm, monkeypatch):
    with pytest.raises(UserError, match=r"rollout_backend \('sglang'\) must be one of \['hf', 'vllm'\]"):
        _task(cache, rollout_backend="sglang")
    with pytest.raises(UserError, match="check_logp=true .* set check_logp=false"):
        _task(cache, rollout_backend="vllm", check_logp=True)
    with pytest.raises(UserError, match=r"vllm_gpu_memory_utilization \(1.5\) must be in \(0, 1\]"):
        _task(cache, rollout_backend="vllm", vllm_gpu_memory_utilization=1.5)
    with pytest.raises(UserError, match=r"vllm_max_model_len \(8\) must exceed max_new_tokens \(10\)"):
        _task(cache, rollout_backend="vllm", vllm_max_model_len=8)
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed: `import vllm` raises ImportError
    with pytest.raises(UserError, match=r"needs the vllm package .*`pip install mmgrpo\[vllm\]`"):
        _task(cache, rollout_backend="vllm")
    assert FAKE.engines == []  # nothing started an engine


def test_vllm_is_refused_without_cuda(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))  # installed, but this policy runs on the CPU
    with pytest.raises(
        UserError,
        match="rollout_backend=vllm needs a CUDA device, but the policy runs on cpu.*"
        "set pipeline.kwargs.rollout_backend=hf",
    ):
        _task(cache, rollout_backend="vllm")
