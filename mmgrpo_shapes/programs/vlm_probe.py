"""Why a ShapesWorld VLM does or does not look: linear probes of its vision tower's tokens (colour and shape of the
object centred in each cell), the attention mass the answer position puts on the image tokens, the gradient norm
the tower gets from one SFT batch, the completion log-prob with real and blank images, and how well position's cell
digits are read (assets/README.md).

Run: python -m mmgrpo_shapes.programs.vlm_probe assets/shapes-vlm
"""

import argparse

import numpy as np
import torch
from torch import Tensor

from mmgrpo_shapes.dense import cell_targets, tower_tokens
from mmgrpo_shapes.programs import pretrain_vlm as P
from mmgrpo_shapes.programs.tiny_vlm import sft_loss
from mmgrpo_shapes.scenes import BACKGROUND, SHAPES, random_scene


def probe(x: Tensor, y: Tensor, n_fit: int) -> float:
    """Held-out accuracy of an L2-regularised multinomial logistic regression fitted by L-BFGS on the first n_fit."""
    x = (x - x[:n_fit].mean(0)) / (x[:n_fit].std(0) + 1e-6)  # [N, D]
    w = torch.zeros(x.shape[1], int(y.max()) + 1, requires_grad=True)
    b = torch.zeros(int(y.max()) + 1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=300)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[:n_fit] @ w + b, y[:n_fit]) + 1e-3 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return float(((x[n_fit:] @ w + b).argmax(-1) == y[n_fit:]).float().mean())


@torch.no_grad()
def probes(model, processor, n: int = 900, n_fit: int = 600) -> dict[str, float]:
    """Per-token probes on object-centre cells of n random scenes, and the shape of one-object scenes, pooled."""
    rng = np.random.default_rng(0)
    scenes = [random_scene(rng) for _ in range(n)]
    objs = [[vars(o) for o in s.objects] for s in scenes]
    tok = torch.cat(
        [tower_tokens(model, processor, [s.render() for s in scenes[i : i + 50]]) for i in range(0, n, 50)]
    )  # [n * 16, hidden]
    color, shape = map(torch.cat, zip(*[cell_targets(o, 4) for o in objs]))  # [n * 16] each
    obj = color > 0
    fit = obj.clone()
    fit[n_fit * 16 :] = False
    order = torch.cat([fit.nonzero()[:, 0], (obj & ~fit).nonzero()[:, 0]])
    k = int(fit.sum())
    one = [random_scene(rng, n_objects=1) for _ in range(600)]
    pooled = torch.stack([tower_tokens(model, processor, [s.render()]).mean(0) for s in one])  # [600, hidden]
    return {
        "colour": probe(tok[order], color[order] - 1, k),
        "shape": probe(tok[order], shape[order] - 1, k),
        "one-object shape (pooled)": probe(pooled, torch.tensor([SHAPES.index(s.objects[0].shape) for s in one]), 400),
    }


def looking(model, processor, n: int = 64) -> dict[str, object]:
    """Attention on image tokens from the answer position per layer, tower vs rest gradient norms, and the mean
    completion log-prob with real and with blank images, on n train questions."""
    recs = P.records("vqa", "train", n, seed=5)
    tok, encode = processor.tokenizer, P.encoder("vqa", processor)
    inputs, labels = P.collate([P.example("vqa", encode, tok, r) for r in recs], tok.pad_token_id)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(**inputs, output_attentions=True).attentions  # layers x [B, heads, L, L]
    answer, image = tok.convert_tokens_to_ids("<answer>"), model.config.image_token_id
    share = []
    for i in range(n):
        pos = int((inputs["input_ids"][i] == answer).nonzero()[0, 0])
        img = inputs["input_ids"][i, : pos + 1] == image  # [pos + 1]
        share.append([float(a[i, :, pos, : pos + 1][:, img].sum(-1).mean()) for a in att])
    uniform = float(np.mean([16 / (int((inputs["input_ids"][i] == answer).nonzero()[0, 0]) + 1) for i in range(n)]))
    model.train()
    model.zero_grad()
    sft_loss(model, inputs, labels).backward()
    vis = [p for name, p in model.named_parameters() if "visual" in name]
    rest = [p for name, p in model.named_parameters() if "visual" not in name and p.grad is not None]
    norm = {k: float(torch.cat([p.grad.reshape(-1) for p in v]).norm()) for k, v in (("tower", vis), ("rest", rest))}
    model.eval()
    blank = [dict(r, image=np.full_like(r["image"], BACKGROUND)) for r in recs]
    logp = {}
    for name, rs in (("real", recs), ("blank", blank)):
        x, y = P.collate([P.example("vqa", encode, tok, r) for r in rs], tok.pad_token_id)
        with torch.no_grad():
            lp = -torch.nn.functional.cross_entropy(
                model(**x).logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none"
            ).sum(1)  # [n]
        logp[name] = float(lp.mean())
    return {
        "attention on image tokens per layer": np.round(np.mean(share, 0), 3).tolist(),
        "uniform attention share": round(uniform, 3),
        "grad norm": norm,
        "completion log-prob": logp,
    }


@torch.no_grad()
def position_digits(model, processor, n: int = 120) -> dict[str, object]:
    """Teacher-forced read of position's two cell digits ("x gt1 bs3"): per named object, the share of test
    questions whose most likely digit (of 0-3) is the true cell, and the [4, 4] truth x prediction counts."""
    tok, encode = processor.tokenizer, P.encoder("vqa", processor)
    recs = [r for r in P.records("vqa", "test", 10 * n, seed=0) if r["category"] == "position"][:n]
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(4)]
    counts = torch.zeros(2, 4, 4, dtype=torch.long)  # [object, truth, prediction]
    for r in recs:
        ex = P.example("vqa", encode, tok, r)
        x, _ = P.collate([ex], tok.pad_token_id)
        logits = model(**x).logits[0]  # [L, V]
        start, toks = ex["input_ids"].shape[1], tok.convert_ids_to_tokens(ex["completion"].tolist())
        cells = [j for j, t in enumerate(toks[: toks.index("</think>")]) if t.isdigit()]
        for k, j in enumerate(cells[:2]):  # the logits at start + j - 1 predict completion token j
            counts[k, int(toks[j]), int(logits[start + j - 1, digit_ids].argmax())] += 1
    acc = [round(float(c.diagonal().sum() / c.sum()), 3) for c in counts]
    return {"first, second object": acc, "n": len(recs), "truth x prediction": counts.tolist()}


def main(argv: list[str] | None = None) -> None:
    # lazy: transformers is heavy to import; only loading the probed model needs it
    from transformers import AutoModelForImageTextToText, AutoProcessor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="assets/shapes-vlm", help="a saved Qwen2-VL folder (shapes-vlm layout)")
    path = p.parse_args(argv).model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    print("linear probes (held out):", probes(model, processor), flush=True)
    print(looking(model, processor), flush=True)
    print("position's cell digits, teacher-forced:", position_digits(model, processor), flush=True)


if __name__ == "__main__":
    main()
