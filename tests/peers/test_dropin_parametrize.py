"""The drop-in under parametrizations: each parameter is read as often as torch's module reads
it, in the same order, so a parametrization with effects (spectral_norm's power iteration
in training, a random weight dropout) leaves both modules in the same state."""

import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

import multihead as mh

E, H = 16, 4


class _Logged(nn.Module):
    """An identity parametrization that appends its name to ``log`` on every evaluation."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def forward(self, w):
        self.log.append(self.name)
        return w


def _logged(cls, log, *, separate, **kw):
    torch.manual_seed(0)
    m = cls(E, H, kdim=E + 2 if separate else None, vdim=E + 2 if separate else None, **kw)
    names = ["q_proj_weight", "k_proj_weight", "v_proj_weight"] if separate else ["in_proj_weight"]
    for name in names + (["in_proj_bias"] if m.in_proj_bias is not None else []) + (
            ["bias_k", "bias_v"] if m.bias_k is not None else []):
        parametrize.register_parametrization(m, name, _Logged(name, log))
    parametrize.register_parametrization(m.out_proj, "weight", _Logged("out.weight", log))
    if m.out_proj.bias is not None:
        parametrize.register_parametrization(m.out_proj, "bias", _Logged("out.bias", log))
    return m


CASES = list(itertools.product(
    ["self", "cross"], [False, True], ["train", "eval", "eval-nograd"], [None, "bool", "float"],
    [{}, {"bias": False}, {"add_bias_kv": True}, {"separate": True}]))


@pytest.mark.parametrize("attn,batch_first,mode,mask,kw", CASES)
def test_reads_each_parameter_as_torch_does(attn, batch_first, mode, mask, kw):
    kw = dict(kw)
    separate = kw.pop("separate", False)
    logs = []
    for cls in (nn.MultiheadAttention, mh.nn.MultiheadAttention):
        log = []
        m = _logged(cls, log, separate=separate, batch_first=batch_first, **kw)
        m.train(mode == "train")
        shape = (2, 5) if batch_first else (5, 2)                   # (N, L) or (L, N)
        x = torch.randn(*shape, E)
        kv = x if attn == "self" and not separate else torch.randn(*shape, E + 2 * separate)
        am = None if mask is None else torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        if mask == "float":
            am = torch.zeros(5, 5).masked_fill(am, float("-inf"))
        with torch.no_grad() if mode == "eval-nograd" else torch.enable_grad():
            m(x, kv, kv, attn_mask=am, need_weights=False)
        logs.append(log)
    assert logs[0] == logs[1]
    assert len(logs[0]) >= 2                        # (the test logs reads at all)


def test_spectral_norm_trains_as_torch():
    """spectral_norm steps its power iteration on every read in training: the same number of
    reads gives the same u, v, weights and outputs, step after step."""
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, dtype=torch.float64)
    ours = mh.nn.MultiheadAttention(E, H, dtype=torch.float64)
    for m in (t, ours):
        spectral_norm(m, "in_proj_weight")
        spectral_norm(m.out_proj)
    ours.load_state_dict(t.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (t, ours)]
    x = torch.randn(5, 2, E, dtype=torch.float64)
    for _ in range(3):
        outs = []
        for m, opt in zip((t, ours), opts):
            opt.zero_grad()
            out = m(x, x, x)[0]
            out.square().sum().backward()
            opt.step()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(t.state_dict().values(), ours.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


class _DropConnect(nn.Module):
    def forward(self, w):
        return nn.functional.dropout(w, 0.1, self.training)


def test_random_parametrization_draws_as_torch():
    """A weight dropout draws from the RNG on every read: with as many reads, the layer's own
    dropout after it draws the same masks."""
    outs = []
    for ours in (False, True):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.1, dtype=torch.float64)
        if ours:
            layer.self_attn = mh.nn.MultiheadAttention(E, H, dropout=0.1, dtype=torch.float64)
            torch.manual_seed(0)
            layer.load_state_dict(nn.TransformerEncoderLayer(E, H, 32, dropout=0.1,
                                                             dtype=torch.float64).state_dict())
        parametrize.register_parametrization(layer.self_attn, "in_proj_weight", _DropConnect())
        torch.manual_seed(1)
        x = torch.randn(5, 2, E, dtype=torch.float64)
        outs.append(layer.train()(x))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [mh.nn.MultiheadAttention, mh.MultiHeadAttention])
def test_parametrized_layout_mismatch_says_so(cls):
    """A checkpoint of the same sizes whose keys differ only in a parametrization is refused,
    nothing loaded, with the fix for the parametrization (not "build it with other sizes")."""
    plain, param = cls(E, H), cls(E, H)
    torch.nn.utils.parametrizations.weight_norm(param.out_proj)
    for dst, src, says in ((param, plain, "This module parametrizes out_proj.weight"),
                           (plain, param, "The checkpoint parametrizes out_proj.weight")):
        before = {k: v.clone() for k, v in dst.state_dict().items()}
        with torch.no_grad():
            src.out_proj.bias += 1                  # (a load would show)
        with pytest.raises(RuntimeError, match=says) as e:
            dst.load_state_dict(src.state_dict())
        assert "sizes" not in str(e.value)
        for k, v in dst.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("call", ["self", "cross", "separate", "cached", "contributions"])
def test_native_module_reads_each_weight_once(call):
    """MultiHeadAttention has no torch peer: each parametrized tensor runs once per call
    (its checks and its products share the one evaluation)."""
    log = []
    separate = call == "separate"
    m = mh.MultiHeadAttention(E, H, kdim=E + 2 if separate else None,
                              vdim=E + 2 if separate else None)
    for name, _ in list(m.named_parameters()):
        owner, _, local = name.rpartition(".")
        parametrize.register_parametrization(m.get_submodule(owner), local, _Logged(name, log))
    names = sorted(name for name, _ in m.named_parameters())   # (their originals)
    x = torch.randn(2, 3, E)
    context = torch.randn(2, 5, E + 2 if separate else E) if call in ("cross", "separate") else None
    cache = m.make_cache(2, 8) if call == "cached" else None
    log.clear()
    if call == "contributions":
        m.head_contributions(x)
        names = [n for n in names if "out_proj.original" not in n or n.endswith("weight.original")]
    else:
        m(x, context, mask=mh.masks.causal() if context is None else None, cache=cache)
    expected = sorted(n.replace("parametrizations.", "").replace(".original", "") for n in names)
    if call == "contributions":                     # (the bias is not part of a head's write)
        expected.remove("out_proj.bias")
    assert sorted(log) == expected
