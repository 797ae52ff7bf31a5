"""``model.safetensors``, checked before it is trusted: the header first, then every tensor.

The header (tensor names, dtypes, shapes) is read on its own, never the whole file, and
``config.json`` is checked against it before anything is built: a config claiming a million
layers, or a vocabulary the checkpoint does not hold, fails in microseconds. Only then are
the expected tensors read (with ``safetensors``: nothing is ever unpickled) and checked for
NaN and infinity.

File layout (the safetensors format): 8 bytes, the little-endian length ``n`` of the header;
``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``;
then the tensors' bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch

from ._files import ModelLoadError, first_line, is_library_error, json_kind, show
from .bert import BertConfig

#: the largest header read (the limit the safetensors library itself applies)
HEADER_LIMIT = 100 * 2**20
#: the dtypes a weight may have: safetensors' name -> torch
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64}
#: the most layers loaded: far above any BERT-family model, far below what exhausts memory
MAX_LAYERS = 1024
#: config.json fields that a tensor's shape also states: (field, tensor, dimension)
SIZE_TENSORS = (("vocab_size", "embeddings.word_embeddings.weight", 0),
                ("hidden_size", "embeddings.word_embeddings.weight", 1),
                ("max_position_embeddings", "embeddings.position_embeddings.weight", 0),
                ("type_vocab_size", "embeddings.token_type_embeddings.weight", 0),
                ("intermediate_size", "encoder.layer.0.intermediate.dense.weight", 0))


class TensorInfo(NamedTuple):
    """One tensor as the header describes it: safetensors dtype name (``"F32"``) and shape."""

    dtype: str
    shape: tuple[int, ...]


class _Duplicate(Exception):
    """A name that occurs twice in the header's JSON (``json`` would keep the last silently)."""


def _unique(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)
    return dict(pairs)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors that the safetensors file at ``path`` declares, reading only its header.

    Raises:
        ModelLoadError: the file is too short, its header length exceeds the file, the header
            is not a JSON object, a name occurs twice, or an entry is malformed.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path} is {size} bytes, too short for a safetensors file "
                                     f"(8 bytes of header length, then the header): re-download it")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > HEADER_LIMIT:
                raise ModelLoadError(f"{path}: the header length ({n:,} bytes) is larger than "
                                     f"{'the file' if n > size - 8 else 'safetensors allows'} "
                                     f"({min(size - 8, HEADER_LIMIT):,} bytes): the file is "
                                     f"truncated or not safetensors; re-download or re-export it")
            raw = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except _Duplicate as e:
        raise ModelLoadError(f"{path}: the header holds the name {show(e.args[0])} twice (two "
                             f"tensors of one name): re-export the checkpoint") from None
    except (ValueError, RecursionError) as e:   # includes UnicodeDecodeError and JSONDecodeError
        raise ModelLoadError(f"{path}: the header is not valid UTF-8 JSON ({first_line(e)}): "
                             f"the file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the header must be a JSON object, got {json_kind(header)}: "
                             f"the file is corrupt or not safetensors")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelLoadError(f"{path}: the header's __metadata__ must map names to strings, got "
                             f"{show(meta)}: re-export the checkpoint")
    return {name: _entry(path, name, e, size - 8 - n) for name, e in header.items()}


def _entry(path: Path, name: str, e, data_size: int) -> TensorInfo:
    """Check one header entry: a dtype name, a shape, and offsets inside the data."""
    def bad(what: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: the header entry of tensor {show(name)} {what}: "
                              f"the file is corrupt; re-download or re-export it")

    if not isinstance(e, dict):
        raise bad(f"is {json_kind(e)}, not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"has dtype {show(dtype)}, not a name such as 'F32'")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise bad(f"has shape {show(shape)}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or not offsets[0] <= offsets[1] <= data_size):
        raise bad(f"has data_offsets {show(offsets)}, not [begin, end] within the "
                  f"{data_size:,} bytes of data")
    if dtype in FLOAT_DTYPES:
        need = 0 if 0 in shape else FLOAT_DTYPES[dtype].itemsize
        for s in shape:             # stop early: a hostile shape list makes a huge product slow
            if need > data_size:
                break
            need *= s
        if offsets[1] - offsets[0] != need:
            raise bad(f"has shape {show(shape)} ({dtype}) but data_offsets "
                      f"{offsets} span {offsets[1] - offsets[0]:,} bytes")
    return TensorInfo(dtype, tuple(shape))


def _layout(c: BertConfig) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """Every tensor of :class:`BertEncoder`: (our name, the Hugging Face tensors it is made of,
    the shape of each). Q, K and V rows are packed into ``in_proj``, in that order."""
    E, I = c.hidden_size, c.intermediate_size
    rows = [("embeddings.word.weight", ["embeddings.word_embeddings.weight"], (c.vocab_size, E)),
            ("embeddings.position.weight", ["embeddings.position_embeddings.weight"],
             (c.max_position_embeddings, E)),
            ("embeddings.token_type.weight", ["embeddings.token_type_embeddings.weight"],
             (c.type_vocab_size, E)),
            ("embeddings.norm.weight", ["embeddings.LayerNorm.weight"], (E,)),
            ("embeddings.norm.bias", ["embeddings.LayerNorm.bias"], (E,))]
    for i in range(c.num_hidden_layers):
        p, o = f"encoder.layer.{i}.", f"layers.{i}."
        for kind, sq, up, down in (("weight", (E, E), (I, E), (E, I)), ("bias", (E,), (I,), (E,))):
            rows += [(f"{o}attention.in_proj_{kind}",
                      [f"{p}attention.self.{r}.{kind}" for r in ("query", "key", "value")], sq),
                     (f"{o}attention.out_proj.{kind}", [f"{p}attention.output.dense.{kind}"], sq),
                     (f"{o}attention_norm.{kind}", [f"{p}attention.output.LayerNorm.{kind}"], (E,)),
                     (f"{o}intermediate.{kind}", [f"{p}intermediate.dense.{kind}"], up),
                     (f"{o}output.{kind}", [f"{p}output.dense.{kind}"], down),
                     (f"{o}output_norm.{kind}", [f"{p}output.LayerNorm.{kind}"], (E,))]
    return rows


def expected_tensors(c: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a BERT checkpoint must hold (Hugging Face names) and its shape.

    Example:
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                  num_attention_heads=4, intermediate_size=64)
        >>> shapes = expected_tensors(cfg)
        >>> len(shapes), shapes["encoder.layer.1.attention.self.query.weight"]
        (37, (32, 32))
    """
    return {hf: shape for _, parts, shape in _layout(c) for hf in parts}


def check_header(path: Path, header: dict[str, TensorInfo], c: BertConfig, config_path: Path) -> str:
    """Check ``config.json`` against the checkpoint's header, before anything is built.

    The layer count and every size a tensor shape states are compared first (so a per-layer
    list is only ever built for layers the file holds), then every expected tensor's
    presence, shape and dtype; a tensor in the encoder that the layers have not (an adapter,
    a layer after a gap) is refused.

    Returns:
        The prefix of the checkpoint's tensor names: ``"bert."`` (BertForMaskedLM and the
        like) or ``""``.
    """
    prefix = "bert." if not any(n.startswith("embeddings.") for n in header) and any(
        n.startswith("bert.") for n in header) else ""
    layer = re.compile(re.escape(prefix) + r"encoder\.layer\.(\d{1,9})\.")
    indices = {int(m[1]) for n in header if (m := layer.match(n))}
    held = 0
    while held in indices:      # layers 0, 1, ... held - 1 are (at least partly) there
        held += 1
    if c.num_hidden_layers != held:     # fewer would leave the file's last layers unused
        raise ModelLoadError(f"{config_path}: num_hidden_layers is {c.num_hidden_layers}, but {path} "
                             f"holds {held} layer(s){f' (encoder.layer.0 to {held - 1})' if held else ''}"
                             f": set num_hidden_layers to {held}")
    if c.num_hidden_layers > MAX_LAYERS:
        raise ModelLoadError(f"{config_path}: num_hidden_layers is {c.num_hidden_layers}, more than "
                             f"the {MAX_LAYERS} multihead loads (BERT-family models have 2 to 48)")
    for field, name, dim in SIZE_TENSORS:
        info = header.get(prefix + name)
        if info is not None and len(info.shape) == 2 and info.shape[dim] != getattr(c, field):
            raise ModelLoadError(f"{config_path}: {field} is {getattr(c, field)}, but {path} holds "
                                 f"{name} of shape {info.shape}, which implies {field} = "
                                 f"{info.shape[dim]}: use the config.json that came with these weights")
    want = expected_tensors(c)
    missing = [n for n in want if prefix + n not in header]
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} expected tensor(s) missing, e.g. "
                             f"{missing[:3]}: is this a BERT checkpoint for this config.json?")
    extra = sorted(n for n in header if n.startswith(prefix + "encoder.")
                   and n[len(prefix):] not in want)
    if extra:                # (heads and buffers outside the encoder are left, as BertModel)
        raise ModelLoadError(f"{path} holds {len(extra)} tensor(s) in its encoder that "
                             f"config.json's {c.num_hidden_layers}-layer BERT encoder has not, "
                             f"e.g. {extra[:3]}: they would be ignored, and the model would "
                             f"compute something else than the network they belong to; remove "
                             f"them, or load the checkpoint with the code that made it")
    both = [n for n in want if not prefix and "bert." + n in header]
    if both:
        raise ModelLoadError(f"{path} holds both {both[0]} and bert.{both[0]}: which one is meant "
                             f"is ambiguous; keep one of the two")
    for name, shape in want.items():
        info = header[prefix + name]
        if info.shape != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {info.shape}, "
                                 f"config.json implies {shape}")
        check_float(path, name, info)
    return prefix


def check_float(path: Path, name: str, info: TensorInfo) -> None:
    """Refuse a weight the header says is not a float (an integer, a bool, float8, complex).

    Example:
        >>> check_float(Path("m.safetensors"), "w", TensorInfo("BF16", (2, 2)))
        >>> check_float(Path("m.safetensors"), "w", TensorInfo("I32", (2, 2)))
        Traceback (most recent call last):
        ...
        multihead.models._files.ModelLoadError: m.safetensors: tensor w has dtype I32, but weights must be floats (F16, BF16, F32, F64): re-export the checkpoint
    """
    if info.dtype not in FLOAT_DTYPES:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {info.dtype}, but weights must "
                             f"be floats ({', '.join(FLOAT_DTYPES)}): re-export the checkpoint")


def _check_finite(path: Path, name: str, t: torch.Tensor, why: str) -> None:
    """Raise :class:`ModelLoadError` if ``t`` holds a NaN or an infinity, naming the tensor."""
    if torch.isfinite(t.sum()):     # any NaN or inf makes the sum non-finite; 20x faster than
        return                      # isfinite(t).all() (3 ms for all of MiniLM's 22.7M weights)
    finite = torch.isfinite(t)      # the sum is not finite: find out why (it may just overflow)
    if not finite.all():
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ModelLoadError(f"{path}: tensor {name} holds {int((~finite).sum())} non-finite "
                             f"value(s), e.g. {t[where].item()} at index {where}: {why}")


def read_weights(path: Path, c: BertConfig, prefix: str) -> dict[str, torch.Tensor]:
    """The expected tensors of a checkpoint that :func:`check_header` accepted, each checked to
    hold only finite values (NaN or infinity raise :class:`ModelLoadError`)."""
    from safetensors import safe_open
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name, shape in expected_tensors(c).items():
                t = f.get_tensor(prefix + name)
                if tuple(t.shape) != shape:     # the header was read again: it cannot differ
                    raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                                         f"config.json implies {shape}")
                _check_finite(path, name, t, "the checkpoint is corrupt; re-download or re-export it")
                out[name] = t
    except ModelLoadError:
        raise
    except BaseException as e:
        if not is_library_error(e):
            raise
        raise ModelLoadError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                             f"{first_line(e)}): re-download or re-export it") from None
    return out


def to_ours(w: dict[str, torch.Tensor], c: BertConfig, dtype: torch.dtype,
            path: Path) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to :class:`BertEncoder`'s in ``dtype`` (Q, K, V rows packed);
    a value that ``dtype`` cannot hold raises :class:`ModelLoadError`."""
    def convert(name: str) -> torch.Tensor:
        t = w[name].to(dtype)
        if torch.finfo(dtype).max < torch.finfo(w[name].dtype).max:    # e.g. float32 -> float16
            _check_finite(path, name, t, f"{dtype} cannot hold the checkpoint's values; "
                                         f"load with dtype=torch.float32")
        return t

    out = {}
    for ours, parts, _ in _layout(c):
        ts = [convert(p) for p in parts]
        out[ours] = ts[0] if len(ts) == 1 else torch.cat(ts)     # Q;K;V rows stacked
    return out
