"""MiniLM sentence embedding vs Hugging Face BertModel, and `multihead inspect` wall time.

Run:  .venv/bin/python -m benchmarks.minilm            (about 2 minutes on a 2-core CPU)

The corpus: 256 real English texts of 8 to 128 tokens, drawn (seeded) from the paragraphs
of the Python standard library's module docstrings, so anyone can rebuild it offline. The
peer is what Hugging Face users write: `BertModel` (attn_implementation="sdpa") on batches
of 32 in the given order, padded to the longest, then mean pooling and normalization. Both
produce the same embeddings (checked); throughput is texts per second, same run.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import random
import re
import subprocess
import sys
import time

import torch

from benchmarks.core import machine, timeit
from multihead.models import default_model_dir, load


def corpus(model, n: int = 256, lo: int = 8, hi: int = 128, seed: int = 0) -> list[str]:
    """``n`` docstring paragraphs of ``lo``..``hi`` tokens, seeded sample."""
    paragraphs = set()
    for mod in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")):
        if mod in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "test"):
            continue
        try:
            doc = importlib.import_module(mod).__doc__ or ""
        except Exception:  # noqa: BLE001 (optional stdlib parts may be missing)
            continue
        for p in re.split(r"\n\s*\n", doc):
            text = " ".join(p.split())
            if re.search(r"[a-z]{3,} [a-z]{3,} [a-z]{3,}", text) and not text.startswith(">>>"):
                paragraphs.add(text)
    sized = [p for p in sorted(paragraphs) if lo <= len(model.tokenize(p).ids) <= hi]
    random.Random(seed).shuffle(sized)
    if len(sized) < n:
        raise RuntimeError(f"only {len(sized)} paragraphs of {lo}..{hi} tokens found")
    return sized[:n]


def hf_embed(hf, tokenizer, texts, batch: int = 32) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding="longest", truncation=True, max_length=256,
                        return_tensors="pt")
        h = hf(**enc).last_hidden_state                                     # (b, S, E)
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)                 # (b, S, 1)
        out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def main() -> None:
    from transformers import AutoTokenizer, BertModel
    model = load()
    texts = corpus(model)
    lengths = [len(model.tokenize(t).ids) for t in texts]
    hf = BertModel.from_pretrained(str(default_model_dir()), attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    with torch.inference_mode():
        ours, theirs = model.embed(texts), hf_embed(hf, tok, texts)
        max_diff = float((ours - theirs).abs().max())
        t_ours = timeit(lambda: model.embed(texts), reps=5)
        t_hf = timeit(lambda: hf_embed(hf, tok, texts), reps=5)
    padded = sum(max(lengths[i:i + 32]) * len(lengths[i:i + 32]) for i in range(0, 256, 32))

    cmd = [sys.executable, "-m", "multihead.cli.main", "inspect"]
    subprocess.run(cmd, capture_output=True, check=True)                # warm the file cache
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        walls.append(time.perf_counter() - t)
    t_torch = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        t_torch.append(time.perf_counter() - t)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    result = {
        "machine": machine(),
        "texts": len(texts), "tokens": sum(lengths), "min_len": min(lengths),
        "max_len": max(lengths), "mean_len": sum(lengths) / len(lengths),
        "hf_padded_tokens": padded,
        "ours_s": t_ours, "hf_s": t_hf, "ours_texts_per_s": len(texts) / t_ours,
        "hf_texts_per_s": len(texts) / t_hf, "speedup": t_hf / t_ours,
        "max_abs_diff": max_diff, "target": ">= 1.8x",
        "inspect_wall_s_median": med(walls), "inspect_wall_s_all": walls,
        "import_torch_s_median": med(t_torch), "inspect_target": "< 3 s",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
