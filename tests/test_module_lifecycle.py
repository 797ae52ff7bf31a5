"""The modules' lifecycle against torch's: deferred init on the meta device, reset_parameters,
load hooks (pre-hooks that convert old checkpoints, post-hooks that forgive keys, a
parent's rule), loads that fail leaving every module as it was (RoPE's note of its
frequencies and lazy modules included), ``assign=True`` of a tensor that cannot be a
parameter, and ``vmap`` over the module."""

import pytest
import torch
from torch import nn

import multihead as mh


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in m.state_dict().values()]


@pytest.mark.parametrize("make", [lambda: mh.MultiHeadAttention(16, 4),
                                  lambda: mh.MultiHeadAttention(16, 4, num_kv_heads=2),
                                  lambda: mh.MultiHeadAttention(16, 4, kdim=8, vdim=8)],
                         ids=["mha", "gqa", "separate"])
def test_reset_parameters_draws_what_construction_draws(make):
    """Every parameter is reset (``out_proj.weight`` was left as it was), in construction's
    order: after the same seed, a reset module equals a built one; a module built on the
    meta device, materialized with ``to_empty`` and reset, equals one too."""
    torch.manual_seed(3)
    built = make()
    other = make()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(123.0)
    torch.manual_seed(3)
    other.reset_parameters()
    assert _same(built, other)
    with torch.device("meta"):
        deferred = make()
    deferred.to_empty(device="cpu")
    torch.manual_seed(3)
    deferred.reset_parameters()
    assert _same(built, deferred)


def test_each_submodule_reset_in_turn_keeps_the_output_bias_zero():
    """FSDP materializes a meta model by calling each module's ``reset_parameters``, the
    parent's before its children's: ``out_proj``'s own reset keeps the bias zero, as the
    module's init leaves it (nn.Linear's would draw it)."""
    with torch.device("meta"):
        m = mh.MultiHeadAttention(16, 4)
    m.to_empty(device="cpu")
    for module in m.modules():
        module.reset_parameters()
    assert torch.equal(m.out_proj.bias, torch.zeros(16))
    assert torch.equal(m.in_proj_bias, torch.zeros(48))
    assert m.out_proj.weight.abs().max() <= 1 / 4       # nn.Linear's bound, 1/sqrt(16)


def test_rope_built_on_meta_serves_after_an_assign_load():
    """A model built on the meta device and loaded with ``assign=True`` (the usual way to
    load a big checkpoint) keeps its RoPE frequencies, which no checkpoint holds, on meta:
    they are the built ones, so rotations at any positions equal a normally built model's."""
    ref = mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(16))
    with torch.device("meta"):
        m = mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(16))
    assert m.rope.inv_freq.is_meta                      # (the default device, as torch's)
    m.load_state_dict(ref.state_dict(), assign=True)
    x = torch.randn(2, 6, 64, dtype=torch.float64)
    ref, m = ref.double(), m.double()
    for positions in (None, torch.arange(6.0) + 0.5, torch.tensor([[-3, 0, 9, 2, 4, 1]] * 2)):
        torch.testing.assert_close(m(x, positions=positions), ref(x, positions=positions),
                                   atol=0, rtol=0)
    m.to(torch.float32)                                 # moves, as before the change
    with torch.device("meta"):
        moved = mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(16))
    moved.load_state_dict(ref.state_dict(), assign=True)
    moved.to("cpu")                                     # (.to/.cuda of a meta buffer fails)
    assert moved.rope.inv_freq.device.type == "cpu" and "written" not in repr(moved.rope)
    torch.testing.assert_close(moved(x, positions=positions), ref(x, positions=positions),
                               atol=0, rtol=0)
    with torch.device("meta"):
        written = mh.RotaryEmbedding(16)
    with torch.no_grad():
        written.inv_freq.mul_(0.5)                      # written, and holds no values
    with pytest.raises(ValueError, match="inv_freq is on the meta device"):
        written(torch.randn(1, 1, 3, 16), torch.arange(3.0) + 0.5)


def test_load_pre_hooks_run_before_the_check_as_in_torch():
    """A pre-hook converting an old layout (here a transposed ``in_proj_weight``) runs
    before our shape check, in the module's own load and in a parent's, as torch's does."""
    sd = dict(nn.MultiheadAttention(16, 4).state_dict())
    old = {**sd, "in_proj_weight": sd["in_proj_weight"].t().contiguous()}

    def untranspose(module, state_dict, prefix, *args):
        state_dict[prefix + "in_proj_weight"] = state_dict[prefix + "in_proj_weight"].t()

    for make in (lambda: nn.MultiheadAttention(16, 4), lambda: mh.nn.MultiheadAttention(16, 4),
                 lambda: mh.MultiHeadAttention(16, 4)):
        m = make()
        m.register_load_state_dict_pre_hook(untranspose)
        m.load_state_dict(old)
        assert torch.equal(m.in_proj_weight, sd["in_proj_weight"])
        outer = nn.Sequential(make())
        outer[0].register_load_state_dict_pre_hook(untranspose)
        mh.load_state_dict(outer, {"0." + k: v for k, v in old.items()})
        assert torch.equal(outer[0].in_proj_weight, sd["in_proj_weight"])


def test_a_post_hook_that_forgives_keys_is_honoured_and_a_refused_load_is_put_back():
    sd = {**nn.MultiheadAttention(16, 4).state_dict(), "step": torch.tensor(7)}
    for make in (lambda: nn.MultiheadAttention(16, 4), lambda: mh.nn.MultiheadAttention(16, 4)):
        m = make()
        m.register_load_state_dict_post_hook(lambda module, keys: keys.unexpected_keys.clear())
        m.load_state_dict(sd)
        assert torch.equal(m.in_proj_weight, sd["in_proj_weight"])
    m = mh.nn.MultiheadAttention(16, 4)
    m.register_load_state_dict_post_hook(lambda module, keys: None)     # forgives nothing
    before = _params(m)
    with pytest.raises(RuntimeError, match=r"unexpected keys \['step'\].*Nothing was loaded"):
        m.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(m)))


class _Versioned(nn.Module):
    """A model whose version 1 checkpoints stored its attention's ``in_proj_weight``
    transposed: its load rule converts them, as torch's modules do for their old
    checkpoints."""
    _version = 2

    def __init__(self):
        super().__init__()
        self.attn = mh.MultiHeadAttention(16, 4)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        key = prefix + "attn.in_proj_weight"
        if local_metadata.get("version", 2) < 2 and key in state_dict:
            state_dict[key] = state_dict[key].t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_parents_rule_for_old_checkpoints_runs_before_our_layers_check():
    new = _Versioned()
    old = new.state_dict()
    old["attn.in_proj_weight"] = old["attn.in_proj_weight"].t().contiguous()
    old._metadata[""]["version"] = 1
    for load in (lambda m: m.load_state_dict(old), lambda m: mh.load_state_dict(m, old)):
        model = _Versioned()
        load(model)
        assert _same(model, new)


def test_a_failed_whole_model_load_leaves_rope_and_lazy_modules_as_they_were():
    """The load's copies are put back only where values changed, so a RoPE's frequencies
    are still the built ones (a write had marked them 'written': kept in the state dict,
    the shared table no longer used); a lazy module that the load materialized is lazy
    again."""
    model = nn.Sequential(nn.LazyLinear(16), mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4)))
    source = nn.Sequential(nn.Linear(8, 16), mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4)))
    keys, rope = list(model.state_dict()), repr(model[1].rope)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        mh.load_state_dict(model, {**source.state_dict(), "extra": torch.zeros(1)})
    assert list(model.state_dict()) == keys and "inv_freq" not in repr(model[1].rope) == rope
    assert model[0].has_uninitialized_params()
    assert model(torch.randn(2, 3, 8)).shape == (2, 3, 16)          # materializes as usual
    mh.load_state_dict(model, source.state_dict())
    assert _same(model, source)


@pytest.mark.parametrize("loader", ["module", "multihead.load_state_dict"])
def test_assign_of_an_integer_tensor_to_a_parameter_is_refused_before_anything_is_assigned(loader):
    m = mh.MultiHeadAttention(16, 4)
    sd = {**mh.MultiHeadAttention(16, 4).state_dict(), "out_proj.bias": torch.zeros(16, dtype=torch.int64)}
    before = _params(m)
    load = m.load_state_dict if loader == "module" else lambda *a, **k: mh.load_state_dict(m, *a, **k)
    with pytest.raises(RuntimeError, match=r"out_proj.bias is torch.int64 in the checkpoint.*"
                                           r"convert it to torch.float32"):
        load(sd, assign=True)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(m)))
    load(sd)                                            # copied: torch converts it
    assert torch.equal(m.out_proj.bias, torch.zeros(16))


@pytest.mark.parametrize("source, module, fix", [
    (dict(add_bias_kv=True), {}, "load it into multihead.nn.MultiheadAttention"),
    (dict(bias=False), {}, "build the module with bias=False"),
    ({}, dict(bias=False), "build the module with bias=True"),
])
def test_a_torch_checkpoint_of_another_kind_names_the_fix(source, module, fix):
    with pytest.raises(RuntimeError, match=fix):
        mh.MultiHeadAttention(16, 4, **module).load_state_dict(
            nn.MultiheadAttention(16, 4, **source).state_dict())


def test_complex_weights_are_named_before_the_input():
    m = mh.MultiHeadAttention(16, 4)
    with torch.no_grad():
        m.out_proj.weight.data = m.out_proj.weight.to(torch.complex64)
    with pytest.raises(TypeError, match="the module's weights are torch.complex64"):
        m(torch.randn(1, 2, 16, dtype=torch.complex64))


@pytest.mark.filterwarnings("ignore:There is a performance drop")     # (torch's, under vmap)
def test_vmap_over_the_module_and_over_a_transposed_query():
    """The module's query is a transposed view; vmap's tensors have no overlap test (it
    failed inside torch): each slice equals the call on it alone."""
    m = mh.MultiHeadAttention(16, 4).eval()
    x = torch.randn(3, 2, 5, 16, dtype=torch.float64)
    m = m.double()
    out = torch.func.vmap(m)(x)
    torch.testing.assert_close(out, torch.stack([m(xi) for xi in x]))
    q = torch.randn(3, 2, 5, 4, 8, dtype=torch.float64).transpose(-2, -3)   # (3, 2, 4, 5, 8)
    k = v = torch.randn(3, 2, 4, 5, 8, dtype=torch.float64)
    got = torch.func.vmap(lambda a, b, c: mh.attention(a, b, c, mask=mh.masks.causal()))(q, k, v)
    want = torch.stack([mh.attention(a, b, c, mask=mh.masks.causal()) for a, b, c in zip(q, k, v)])
    torch.testing.assert_close(got, want)



def test_a_submodules_pre_hook_runs_before_the_check_too():
    """A pre-hook of ``out_proj`` (renaming an old key) runs when torch's load reaches
    ``out_proj``, after the parent's check of its subtree would have refused the key: the
    check is then torch's, and a refused load is put back."""
    sd = dict(nn.MultiheadAttention(16, 4).state_dict())
    old = {("out_proj.w" if k == "out_proj.weight" else k): v for k, v in sd.items()}

    def rename(module, state_dict, prefix, *args):
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")

    for make in (lambda: nn.MultiheadAttention(16, 4), lambda: mh.nn.MultiheadAttention(16, 4),
                 lambda: mh.MultiHeadAttention(16, 4)):
        m = make()
        m.out_proj.register_load_state_dict_pre_hook(rename)
        m.load_state_dict(old)
        assert torch.equal(m.out_proj.weight, sd["out_proj.weight"])
        outer = nn.Sequential(make())
        outer[0].out_proj.register_load_state_dict_pre_hook(rename)
        mh.load_state_dict(outer, {"0." + k: v for k, v in old.items()})
        assert torch.equal(outer[0].out_proj.weight, sd["out_proj.weight"])
    m = mh.MultiHeadAttention(16, 4)
    m.out_proj.register_load_state_dict_pre_hook(rename)
    before = _params(m)
    with pytest.raises(RuntimeError, match="size mismatch"):
        m.load_state_dict({**old, "in_proj_weight": torch.zeros(3, 16)})
    assert all(torch.equal(a, b) for a, b in zip(before, _params(m)))


class _Unwrapping(nn.Module):
    """A model whose own load_state_dict strips DDP's ``module.`` prefix."""

    def __init__(self):
        super().__init__()
        self.attn = mh.MultiHeadAttention(16, 4)

    def load_state_dict(self, state_dict, *args, **kwargs):
        state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, *args, **kwargs)


def test_the_whole_model_load_calls_the_models_own_load_state_dict():
    source = _Unwrapping()
    model = _Unwrapping()
    mh.load_state_dict(model, {"module." + k: v for k, v in source.state_dict().items()})
    assert _same(model, source)


def test_a_failed_load_that_swapped_tensors_puts_their_dtype_back():
    """Under torch's swap mode a load changes a tensor's dtype in place, which copying the
    old values back cannot undo."""
    model = nn.Sequential(nn.Linear(8, 16), mh.MultiHeadAttention(16, 4))
    sd = {**model.state_dict()}
    sd["0.weight"] = sd["0.weight"].bfloat16()
    sd["1.out_proj.weight"] = torch.zeros(16, 8)
    before = _params(model)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="Nothing was loaded"):
            mh.load_state_dict(model, sd, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert model[0].weight.dtype == torch.float32 and isinstance(model[0].weight, nn.Parameter)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_a_load_pre_hook_registered_while_torch_loads_is_kept_and_removable():
    """A hook registered while torch's load copies the tensors (here from a
    ``__torch_function__`` mode; a tensor subclass's copy could do it) is kept, after the
    hooks there were, and its handle removes it: our load used to set the module's hooks
    aside in a dict of their own, and what was registered there was dropped."""
    from torch.overrides import TorchFunctionMode
    for make in (lambda: nn.MultiheadAttention(16, 4), lambda: mh.nn.MultiheadAttention(16, 4),
                 lambda: mh.MultiHeadAttention(16, 4)):
        m = make()
        sd = make().state_dict()
        first = m.register_load_state_dict_pre_hook(lambda *args: None)
        handles = []

        class Registers(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.copy_ and not handles:
                    handles.append(m.register_load_state_dict_pre_hook(lambda *args: None))
                return func(*args, **(kwargs or {}))
        with Registers():
            m.load_state_dict(sd)
        assert handles and list(m._load_state_dict_pre_hooks) == [first.id, handles[0].id]
        handles[0].remove()
        assert list(m._load_state_dict_pre_hooks) == [first.id], type(m)


@pytest.mark.parametrize("base", [nn.MultiheadAttention, mh.nn.MultiheadAttention,
                                  mh.MultiHeadAttention])
def test_a_load_pre_hook_removed_while_torch_loads_stays_removed(base):
    """A hook whose handle is removed while torch's load runs (here from the module's
    set_extra_state) is gone for the next load, as in torch's module."""
    calls = []

    class Removes(base):
        handle = None

        def get_extra_state(self):
            return torch.zeros(1)

        def set_extra_state(self, state):
            if Removes.handle is not None:
                Removes.handle.remove()
                Removes.handle = None
    m, sd = Removes(8, 2), Removes(8, 2).state_dict()
    Removes.handle = m.register_load_state_dict_pre_hook(lambda *args: calls.append(1))
    m.load_state_dict(sd)
    assert calls == [1]
    m.load_state_dict(sd)
    assert calls == [1] and not m._load_state_dict_pre_hooks


@pytest.mark.parametrize("base", [nn.MultiheadAttention, mh.nn.MultiheadAttention,
                                  mh.MultiHeadAttention])
def test_extra_state_of_any_type_loads_and_a_failing_one_loads_nothing(base):
    """A module's extra state is whatever its set_extra_state takes (a dict here), as in
    torch: it loads, where a check of ours refused it as not a tensor. A set_extra_state
    that raises runs after torch has copied the tensors: the module is put back (torch's
    own keeps the copied tensors; ours loads all or nothing)."""
    class Stepped(base):
        step, fail = 0, False

        def get_extra_state(self):
            return {"step": self.step}

        def set_extra_state(self, state):
            if self.fail:
                raise ValueError("refused")
            self.step = state["step"]
    src, m = Stepped(8, 2), Stepped(8, 2)
    src.step = 5
    m.load_state_dict(src.state_dict())
    assert m.step == 5 and torch.equal(m.in_proj_weight, src.in_proj_weight)
    if base is nn.MultiheadAttention:
        return
    m = Stepped(8, 2)
    before = [t.detach().clone() for t in m.parameters()]
    m.fail = True
    with pytest.raises(ValueError, match="refused"):
        m.load_state_dict(src.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and m.step == 0
