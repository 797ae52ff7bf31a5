"""MiniLM sentence embedding vs Hugging Face BertModel, and `multihead inspect` wall time.

Run:  .venv/bin/python -m benchmarks.minilm            (about 2 minutes on a 2-core CPU)

The corpus: 256 real English texts of 8 to 128 tokens, drawn (seeded) from the paragraphs
of the Python standard library's module docstrings, so anyone can rebuild it offline. The
peer is what Hugging Face users write: `BertModel` (attn_implementation="sdpa") on batches
of 32 in the given order, padded to the longest, then mean pooling and normalization. Both
produce the same embeddings (checked); throughput is texts per second, same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from benchmarks import no_options
from benchmarks.core import machine, timeit
from multihead.bench.corpus import corpus
from multihead.bench.peers import hf_embed
from multihead.models import default_model_dir, load


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
    no_options(__doc__)
    main()
