"""A kernel backend is one registration: a new sparse-MLP lowering entry takes part in the automatic
choice where its priority says, is accepted by the options, and decodes like the built-in entries."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dejavu_compile.compiler import backend
from dejavu_compile.compiler.passes import lowering
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import decode_logits, int8_plan, token_ids


@pytest.fixture
def registered():
    """Registers entries for one test and removes them after."""
    names = []

    def add(entry):
        names.append(lowering.register_lowering(entry).name)
        return entry

    yield add
    for name in names:
        lowering.unregister_lowering(name)


def torch_copy(name: str, priority: int, calls: list, **kwargs) -> lowering.KernelLowering:
    """The decomposed lowering under another name, counting the blocks it writes."""

    def emit(graph, nodes):
        calls.append(nodes.block.layer)
        return lowering.emit_decomposed(graph, nodes)

    return lowering.KernelLowering(name, ("cpu",), None, lowering.always, emit, priority=priority, **kwargs)


def _decode(model, plan, **options):
    forward = torch.compile(model.forward, backend="dejavu", options={"plan": plan, "inner": "eager", **options})
    ids = token_ids(tokens=5)
    return decode_logits(forward, model, ids, [token_ids(tokens=1, seed=s) for s in (1, 2)])


def test_a_registered_entry_is_chosen_by_its_priority(registered):
    model = tiny_model("llama", layers=2)
    plan = int8_plan(model, density=0.5, values="exact")
    above, below = [], []
    registered(torch_copy("torch_copy_high", 35, above))  # above native (30): wins on CPU
    registered(torch_copy("torch_copy_low", 5, below))  # below op (10): never reached automatically
    weight = model.model.layers[0].mlp.up_proj.weight
    assert lowering.choose_lowering({"inner": "eager"}, weight).name == "torch_copy_high"
    got = _decode(model, plan)
    assert sorted(set(above)) == [0, 1] and below == []
    torch._dynamo.reset()
    reference = _decode(model, plan, lowering="decomposed")
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_a_registered_entry_is_an_option_value_and_can_be_opt_in_only(registered):
    calls = []
    registered(torch_copy("torch_copy_opt_in", 50, calls, automatic=False))
    weight = torch.zeros(4, 4)
    assert lowering.choose_lowering({"inner": "eager"}, weight).name != "torch_copy_opt_in"
    assert lowering.choose_lowering({"lowering": "torch_copy_opt_in"}, weight).name == "torch_copy_opt_in"
    assert lowering.choose_lowering({"cpu_lowering": "torch_copy_opt_in"}, weight).name == "torch_copy_opt_in"
    assert backend.validate_options({"cpu_lowering": "torch_copy_opt_in"})["cpu_lowering"] == "torch_copy_opt_in"
    with pytest.raises(backend.DejavuOptionError, match="cpu_lowering"):
        backend.validate_options({"cpu_lowering": "no_such_entry"})


def test_an_entry_off_its_dtypes_is_passed_over(registered):
    calls = []
    entry = torch_copy("torch_copy_fp64_only", 60, calls)
    registered(dataclasses.replace(entry, dtypes=(torch.float64,)))
    assert lowering.choose_lowering({"inner": "eager"}, torch.zeros(4, 4)).name != "torch_copy_fp64_only"
    assert lowering.choose_lowering({"inner": "eager"}, torch.zeros(4, 4, dtype=torch.float64)).name \
        == "torch_copy_fp64_only"


def test_a_dense_gemv_entry_takes_the_projections_and_its_wrapper_property_decides(registered, monkeypatch):
    """An entry filling the dense GEMV and decode attention roles, above native's priority, takes
    every decode projection and attention (native lowers nothing else here: there is no plan); the
    graph then holds no entry that asks for the C++ wrapper, so Inductor keeps its Python wrapper."""
    import torch._inductor.compile_fx as compile_fx
    import torch.nn.functional as F

    calls, seen = [], []

    def emit_linear(graph, x, weight, bias):
        calls.append(weight.name)
        return graph.call_function(F.linear, (x, weight, bias))

    def emit_decode_attention(graph, q, k, v, attn_mask, scale):
        calls.append("attention")
        return graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                   {"attn_mask": attn_mask, "scale": scale, "enable_gqa": True})

    registered(lowering.KernelLowering("aten_gemv", ("cpu",), None, lowering.always, None, priority=35,
                                       emit_linear=emit_linear, emit_decode_attention=emit_decode_attention))
    assert lowering.dense_kernel("linear", {}, torch.zeros(4, 4)).name == "aten_gemv"
    assert lowering.dense_kernel("screened_head", {}, torch.zeros(4, 4)).name == "native"
    monkeypatch.setattr(compile_fx, "compile_fx",
                        lambda gm, inputs, config_patches=None, **kw: seen.append(dict(config_patches or {}))
                        or gm.forward)
    model = tiny_model("llama", layers=1)
    forward = torch.compile(model.forward, backend="dejavu",
                            options={"inner": "inductor", "attention_lowering": "auto"})
    ids = token_ids(tokens=1)
    with torch.no_grad():
        got = forward(ids, use_cache=False).logits
        want = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want)
    assert len(calls) == 7 + 1 + 1  # q, k, v, o, gate, up, down, the output head and the attention
    assert calls.count("attention") == 1
    assert seen and "cpp_wrapper" not in seen[-1]
