"""Parameter, memory and FLOP counts of attention layers (seed 003's "Parameter Count Analysis").

For one layer with model width d, h query heads, h_kv K/V heads, head dims d_k and d_v:

    params = d·(h·d_k) + d·(h_kv·d_k) + d·(h_kv·d_v) + (h·d_v)·d   (W_Q, W_K, W_V, W_O)
           + h·d_k + h_kv·d_k + h_kv·d_v + d                        (biases, if any)

which is 4d² (+ 4d) for multi-head attention with d_k = d / h: independent of h.
Every count is checked against ``sum(p.numel())`` of a real :class:`MultiHeadAttention`
built on the meta device (no memory, no time).

FLOPs are counted the FlashAttention way: 2 per multiply-add; the attention core costs
``4·h·S_q·S_k·d_k`` forward (QKᵀ and PV), half of it under a causal mask.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .._args import positive_int

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp64": torch.float64}


@dataclass(frozen=True)
class AttentionShape:
    """An attention configuration: widths, heads, layers (and where the numbers come from)."""

    d_model: int
    heads: int
    kv_heads: int | None = None
    head_dim: int | None = None
    layers: int = 1
    bias: bool = True
    name: str = ""
    source: str = ""

    def __post_init__(self):
        for f in ("d_model", "heads", "layers", "kv_heads", "head_dim"):
            v = getattr(self, f)
            if v is None and f in ("kv_heads", "head_dim"):                # (the defaults)
                continue
            object.__setattr__(self, f, positive_int(f, v))                # (frozen: set once)
        if self.head_dim is None and self.d_model % self.heads:
            kv = self.kv_heads or 1                                        # (heads must fit it too)
            divisors = [d for d in range(kv, self.d_model + 1, kv) if self.d_model % d == 0][:12]
            fix = (f"try heads in {divisors}, or pass head_dim" if divisors else
                   f"no multiple of kv_heads ({kv}) divides it, so pass head_dim")
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads}) "
                             f"when head_dim is not given: {fix}")
        if self.heads % self.hkv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.hkv}): try "
                             f"kv_heads in {[d for d in range(1, self.heads + 1) if self.heads % d == 0]}")

    @property
    def hkv(self) -> int:
        """K/V heads (``heads`` when not given: MHA)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dk(self) -> int:
        """Per-head width (``d_model / heads`` when not given)."""
        return self.d_model // self.heads if self.head_dim is None else self.head_dim

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"MQA"`` or ``"GQA-<kv heads>"``."""
        return "MHA" if self.hkv == self.heads else "MQA" if self.hkv == 1 else f"GQA-{self.hkv}"

    def with_kv_heads(self, kv: int) -> "AttentionShape":
        """The same model with ``kv`` K/V heads (MHA, GQA or MQA variants)."""
        return AttentionShape(**{**asdict(self), "kv_heads": kv})


#: seed 003's table of configurations (d_model, heads, d_k, layers), plus LLaMA-2-70B's GQA
PRESETS = {
    "transformer-base": AttentionShape(512, 8, layers=6, name="Transformer (base)",
                                       source="Vaswani et al. 2017; seed 003"),
    "gpt2-small": AttentionShape(768, 12, layers=12, name="GPT-2 (Small)", source="seed 003"),
    "gpt2-medium": AttentionShape(1024, 16, layers=24, name="GPT-2 (Medium)", source="seed 003"),
    "gpt3-175b": AttentionShape(12288, 96, layers=96, name="GPT-3 (175B)", source="seed 003"),
    "llama-7b": AttentionShape(4096, 32, layers=32, bias=False, name="LLaMA-7B", source="seed 003"),
    "llama-65b": AttentionShape(8192, 64, layers=80, bias=False, name="LLaMA-65B",
                                source="seed 003"),
    "llama2-70b": AttentionShape(8192, 64, kv_heads=8, layers=80, bias=False, name="LLaMA-2-70B",
                                 source="seed 003 (8-group GQA)"),
}


def preset(name: str) -> AttentionShape:
    """A named configuration; unknown names list the known ones.

    Example:
        >>> preset("gpt2-small").dk
        64
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str, one of {', '.join(PRESETS)}; got "
                        f"{type(name).__name__}")
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


def formula_params(s: AttentionShape) -> int:
    """Parameters of one attention layer by the formula in the module docstring.

    Example:
        >>> formula_params(AttentionShape(512, 8)) == 4 * 512**2 + 4 * 512
        True
    """
    d, h, hkv, dk = s.d_model, s.heads, s.hkv, s.dk
    weights = d * h * dk + 2 * d * hkv * dk + h * dk * d
    biases = (h * dk + 2 * hkv * dk + d) if s.bias else 0
    return weights + biases


def module_params(s: AttentionShape) -> int:
    """``sum(p.numel())`` of a real :class:`MultiHeadAttention` built on the meta device.

    Example:
        >>> module_params(AttentionShape(4096, 32, kv_heads=8, bias=False)) == 4096 * 4096 * 2 + 2 * 4096 * 1024
        True
    """
    from .._init import skip_init
    from ..modules import MultiHeadAttention
    with skip_init():
        m = MultiHeadAttention(s.d_model, s.heads, num_kv_heads=s.hkv, head_dim=s.dk,
                               bias=s.bias, device="meta")
    return sum(p.numel() for p in m.parameters())


def report(s: AttentionShape, *, seq: int = 2048, batch: int = 1, dtype: str = "bf16",
           causal: bool = True) -> dict:
    """Every count for one configuration at sequence length ``seq`` (JSON-ready).

    Example:
        >>> r = report(preset("llama2-70b"), seq=4096, dtype="bf16")
        >>> r["kv_cache_bytes_per_token"], human_bytes(r["kv_cache_bytes_per_sequence"])
        (327680, '1.2 GiB')
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    seq, batch = positive_int("seq", seq), positive_int("batch", batch)
    nbytes = torch.empty((), dtype=DTYPES[dtype]).element_size()
    p_layer = formula_params(s)
    p_module = module_params(s)
    kv_token_layer = 2 * s.hkv * s.dk * nbytes
    proj_flops_token = 2 * (formula_params(AttentionShape(**{**asdict(s), "bias": False})))
    core = 4 * s.heads * seq * seq * s.dk * (0.5 if causal else 1.0)     # per layer, per sequence
    scores = s.heads * seq * seq * nbytes                                 # per layer, per sequence
    return {
        "config": {**asdict(s), "kv_heads": s.hkv, "head_dim": s.dk, "kind": s.kind},
        "seq": seq, "batch": batch, "dtype": dtype, "causal": causal,
        "params_per_layer": p_layer, "params_per_layer_module": p_module,
        "params_match_module": p_layer == p_module,
        "params_all_layers": p_layer * s.layers,
        "mha_equivalent_params_per_layer": 4 * s.d_model ** 2 + (4 * s.d_model if s.bias else 0),
        "naive_scores_bytes_per_layer_per_sequence": scores,
        "naive_scores_bytes_batch_all_layers_if_kept": scores * batch * s.layers,
        "fused_extra_bytes_per_layer_per_sequence": s.heads * seq * 4,    # fp32 log-sum-exp
        "kv_cache_bytes_per_token_per_layer": kv_token_layer,
        "kv_cache_bytes_per_token": kv_token_layer * s.layers,
        "kv_cache_bytes_per_sequence": kv_token_layer * s.layers * seq,
        "kv_cache_bytes_batch": kv_token_layer * s.layers * seq * batch,
        "flops_per_token_projections": proj_flops_token * s.layers,
        "flops_per_sequence": (proj_flops_token * seq + core) * s.layers,
        "flops_per_token_attention_core_avg": core / seq * s.layers,
    }


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``.

    Example:
        >>> human_bytes(3 * 2**30), human_bytes(2**67)
        ('3.0 GiB', '128.0 EiB')
    """
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
    for unit in units:
        if abs(n) < 1024 or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def human_count(n: float) -> str:
    """``12_582_912 -> '12.58M'``.

    Example:
        >>> human_count(12_582_912), human_count(950), human_count(2.4e17)
        ('12.58M', '950', '240.00P')
    """
    for unit, f in (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12),
                    ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f}{unit}"
    return str(int(n))
