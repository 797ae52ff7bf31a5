"""Small random BERT checkpoints for loader and CLI tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from multihead.models import BertConfig, default_model_dir, expected_tensors


def tiny_checkpoint(path: Path, seed: int = 0, **config) -> Path:
    """A random BERT checkpoint with MiniLM's tokenizer (hidden 32, 2 layers, 4 heads)."""
    src = default_model_dir()
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type="bert", architectures=["BertModel"], vocab_size=30522, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, hidden_act="gelu")
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "tokenizer.json", path / "tokenizer.json")
    g = torch.Generator().manual_seed(seed)
    shapes = expected_tensors(BertConfig.from_dict(cfg))
    from safetensors.torch import save_file
    save_file({n: torch.randn(s, generator=g) * 0.2 for n, s in shapes.items()},
              str(path / "model.safetensors"))
    return path
