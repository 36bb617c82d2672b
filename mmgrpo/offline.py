"""Offline assets every package needs for tiny test models: the real CLIP byte-level BPE vocabulary, no hub.

Files only (vocab.json + merges.txt); callers wrap them in the tokenizer class they use.
"""

import gzip
import importlib.util
import json
import os
from pathlib import Path


def _bytes_to_unicode() -> list[str]:
    """The GPT-2/CLIP byte -> printable-unicode table (the 256 base symbols of byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_clip_bpe(out_dir: str | os.PathLike, n_merges: int = 200) -> int:
    """Write the real CLIP BPE (open_clip's bundled merges, the first `n_merges`) as vocab.json + merges.txt.

    Returns the vocabulary size V = 512 byte symbols + merges + 2 specials (bos = V-2, eos = V-1);
    n_merges=0 gives a 514-token byte-level tokenizer.
    """
    merges: list[tuple[str, ...]] = []
    if n_merges:
        spec = importlib.util.find_spec("open_clip")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "write_clip_bpe needs open_clip's bundled vocabulary (pip install open-clip-torch), "
                "or n_merges=0 for a byte-level vocabulary"
            )
        bpe = Path(spec.submodule_search_locations[0]) / "bpe_simple_vocab_16e6.txt.gz"
        with gzip.open(bpe) as f:
            merges = [tuple(m.split()) for m in f.read().decode("utf-8").split("\n")[1 : 1 + n_merges]]
    base = _bytes_to_unicode()
    tokens = base + [b + "</w>" for b in base] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in merges))
    return len(tokens)
