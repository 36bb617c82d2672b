"""The tables of assets/README.md's shapes-vlm section: every image-blind VQA predictor per split and question type
next to chance, and a model's greedy test accuracy with real, blank and shuffled images next to those baselines.

Run: python -m mmgrpo_shapes.programs.vqa_report --model assets/shapes-vlm --n 300
     python -m mmgrpo_shapes.programs.vqa_report --model assets/shapes-vlm --reading   # where / position thinks
     python -m mmgrpo_shapes.programs.vqa_report --model assets/shapes-vlm-lists --reading \
         --weights runs/vlm_shapes_vqa_lists/checkpoints/step_00000410/weights.safetensors   # after RL
"""

import argparse

import numpy as np
import torch
from safetensors.torch import load_file

from mmgrpo_shapes.programs.pretrain_vlm import blind_baseline, encoder, evaluate, records, score
from mmgrpo_shapes.programs.tiny_vlm import predict
from mmgrpo_shapes.vqa import TEMPLATE_ANSWERS, extract_answer, question_template
from mmgrpo_shapes.vqa_think import (
    LIST_TYPES,
    answer_follows_cells,
    answer_from_flags,
    answer_from_list,
    list_flags,
    list_marks,
    mark_flag,
    position_think,
    scene_marks,
    think_cells_score,
    think_objects_score,
    where_record,
)


def vqa_chance(split: str = "test", n: int = 300) -> dict[str, float]:
    """Per question type (and "all"), the mean over records of 1 / (number of answers of the record's template):
    the accuracy of guessing uniformly, which balanced data makes the best any image-blind predictor can expect."""
    recs = records("vqa", split, n, seed=0)
    inv = [1 / len(TEMPLATE_ANSWERS[r["category"]][question_template(r["prompt"])]) for r in recs]
    out = {"all": sum(inv) / len(inv)}
    for cat in sorted({r["category"] for r in recs}):
        vals = [v for v, r in zip(inv, recs) if r["category"] == cat]
        out[cat] = sum(vals) / len(vals)
    return out


def blind_report(splits: tuple[str, ...] = ("val", "test"), n: int = 1000, n_train: int = 3000) -> str:
    """A markdown table of every image-blind VQA predictor per split and question type, next to chance."""
    lines = ["| split | type | n | chance | template majority | answer prior per type |", "|---|---|---|---|---|---|"]
    for split in splits:
        chance = vqa_chance(split, n)
        tables = [blind_baseline("vqa", split, n, n_train=n_train, by=by) for by in ("template", "type")]
        for cat in tables[0]:
            lines.append(
                f"| {split} | {cat} | {tables[0][cat]['n']} | {chance[cat]:.3f} | "
                f"{tables[0][cat]['accuracy']:.3f} | {tables[1][cat]['accuracy']:.3f} |"
            )
    return "\n".join(lines)


def model_report(model: str, split: str = "test", n: int = 300, n_train: int = 3000) -> str:
    """A markdown table of the model's greedy accuracy per question type with real, blank and shuffled images, the
    best image-blind baseline (template majority or type prior, fitted on train) and real - blank."""
    runs = {images: evaluate(model, "vqa", split, n, images=images) for images in ("real", "blank", "shuffled")}
    blind = [blind_baseline("vqa", split, n, n_train=n_train, by=by) for by in ("template", "type")]
    lines = [
        "| type | n | format | accuracy | blank image | shuffled image | image-blind baseline | real - blank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cat, row in runs["real"].items():
        base = max(b[cat]["accuracy"] for b in blind)
        lines.append(
            f"| {cat} | {row['n']} | {row['format']:.3f} | {row['accuracy']:.3f} | "
            f"{runs['blank'][cat]['accuracy']:.3f} | {runs['shuffled'][cat]['accuracy']:.3f} | {base:.3f} | "
            f"{row['accuracy'] - runs['blank'][cat]['accuracy']:+.3f} |"
        )
    return "\n".join(lines)


def reading_report(model: str, split: str = "test", n: int = 120, weights: str | None = None) -> str:
    """Whether the model reads an object's token cell: greedy accuracy on the where questions (`where_record`, seed 0)
    of the first `n` records of `split`; on their position questions, how often its think is exactly `position_think`
    (both cells right), the share of cell marks right (`think_cells_score`) and how often the answer follows the
    think's own two cells (`answer_follows_cells`): reading the cells and comparing them are two steps. With object
    list thinks (pretrain_vlm --list-think), the same for count, existence and arithmetic (`list_line`). `weights`:
    an RL checkpoint's weights.safetensors loaded over `model` (a full fine-tune writes no save_pretrained folder)."""
    # lazy: transformers is heavy to import; only loading a saved model needs it
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor, net = AutoProcessor.from_pretrained(model), AutoModelForImageTextToText.from_pretrained(model)
    if weights:
        net.load_state_dict(load_file(weights), strict=True)
    encode, tok = encoder("vqa", processor), processor.tokenizer
    recs, rng = records("vqa", split, n, seed=0), np.random.default_rng(0)
    where = [w for w in (where_record(r, rng) for r in recs) if w]
    acc = score("vqa", predict(net, encode, tok, where, max_new_tokens=24), where)["all"]["accuracy"]
    pos = [r for r in recs if r["category"] == "position"]
    texts = predict(net, encode, tok, pos, max_new_tokens=24)
    exact = sum(f"<think>{position_think(r)}</think>" in t for t, r in zip(texts, pos)) / max(1, len(pos))
    cells = sum(think_cells_score(t, r["prompt"], r["objects"]) for t, r in zip(texts, pos)) / max(1, len(pos))
    follows = [f for f in map(answer_follows_cells, texts) if f is not None]
    line = (
        f"where questions: accuracy {acc:.3f} (n {len(where)}); position thinks exact {exact:.3f}, cell marks right "
        f"{cells:.3f} (n {len(pos)}), answer follows its cells {sum(follows) / max(1, len(follows)):.3f} "
        f"(n {len(follows)})"
    )
    lists = [r for r in recs if r["category"] in LIST_TYPES]
    texts = predict(net, encode, tok, lists, max_new_tokens=24)
    if not any(list_marks(t) for t in texts):  # a fixed think ("Count them."): nothing to report
        return line
    return f"{line}; {list_line(texts, lists)}"


def list_line(texts: list[str], lists: list[dict]) -> str:
    """Over the count, existence and arithmetic completions `texts` of `lists`: the lists exact, their score
    (`think_objects_score`) and the answers that follow the model's own list (`answer_from_list`); then per type the
    same exact share, how often the model's list implies the right answer, and how often the answer follows it: the
    three steps (read the scene, the list is enough, use it) apart, so a low accuracy says which one fails."""

    def rates(pairs: list[tuple[str, dict]]) -> tuple[float, float, float, float]:
        exact = [list_marks(t) == scene_marks(r["objects"]) for t, r in pairs]
        marks = [think_objects_score(t, r["prompt"], r["objects"]) for t, r in pairs]
        implied = [answer_from_list(r["prompt"], list_marks(t)) for t, r in pairs]
        enough = [a == r["answers"] for a, (_, r) in zip(implied, pairs)]
        follows = [extract_answer(t) == a for a, (t, _) in zip(implied, pairs)]
        return tuple(sum(v) / len(v) for v in (exact, marks, enough, follows))

    pairs = list(zip(texts, lists))
    exact, marks, _, follows = rates(pairs)
    per = []
    for cat in LIST_TYPES:
        sub = [(t, r) for t, r in pairs if r["category"] == cat]
        if sub:
            e, _, enough, f = rates(sub)
            per.append(f"{cat} {e:.3f} / {enough:.3f} / {f:.3f} (n {len(sub)})")
    line = (
        f"object lists exact {exact:.3f}, list score {marks:.3f}, answer follows its list {follows:.3f} "
        f"(n {len(lists)}); per type, list exact / list implies the right answer / answer follows it: {', '.join(per)}"
    )
    if not any(f for t in texts for f in list_flags(t)):
        return line
    # flagged lists (--list-think flags): using the list splits in two, flag each mark, then count the flags
    right = [list_flags(t) == [mark_flag(r["prompt"], m) for m in list_marks(t)] for t, r in pairs]
    counted = [extract_answer(t) == answer_from_flags(r["prompt"], list_flags(t)) for t, r in pairs]
    return f"{line}; flags right for its marks {sum(right) / len(right):.3f}, answer follows its flags {sum(counted) / len(counted):.3f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a save_pretrained folder to score (omit: only the blind table)")
    p.add_argument("--split", default="test", choices=("train", "val", "test"))
    p.add_argument("--n", type=int, default=300, help="questions of --split for the model table")
    p.add_argument("--blind-n", type=int, default=1000, help="questions per split for the blind table")
    p.add_argument("--reading", action="store_true", help="with --model: only the where / position-think line")
    p.add_argument("--reading-n", type=int, default=120, help="records of --split for --reading")
    p.add_argument(
        "--weights", default=None, help="with --reading: an RL checkpoint's weights.safetensors loaded over --model"
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model and args.reading:
        print(reading_report(args.model, args.split, args.reading_n, args.weights), flush=True)
    elif args.model:
        print(model_report(args.model, args.split, args.n), flush=True)
    else:
        print(blind_report(("train", "val", "test"), args.blind_n), flush=True)


if __name__ == "__main__":
    main()
