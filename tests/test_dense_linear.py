"""Dense decode projections through the GEMV kernel: dejavu::cpu_linear against a float64 reference,
its fallbacks, and the dense_linear pass in whole models (every projection left dense is rewritten at
decode shapes, none in prefill or training graphs, the output equals eager)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.compiler.passes.dense_linear import MAX_ROWS
from dejavu_compile.compiler.passes.runner import dejavu_op_nodes
from dejavu_compile.kernels.cpu import native
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import greedy_through_backend, sparse_plan, token_ids
from tests.kernel_reference import rounding_to

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")
EPS32 = torch.finfo(torch.float32).eps


def _reference(x, w, b, dtype=torch.float32):
    """float64 x @ w.T + b, and a bound on the op's error for it: fp32's summation error (d products
    per output), plus, in bf16 or fp16, the one rounding of the result to that dtype."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    fp32 = 2 * (x.shape[-1] + 2) * EPS32 * scale
    return ref, fp32 + rounding_to(dtype, ref, fp32) + 1e-30


@settings(max_examples=150, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (1, 1), (2, 3), (MAX_ROWS,)]), d=st.integers(1, 140),
       n=st.integers(1, 130), layout=st.sampled_from(["rows", "transposed", "row_stride"]), bias=st.booleans(),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_cpu_linear_matches_float64(lead, d, n, layout, bias, threads, seed, dtype):
    """Both stored layouts (nn.Linear's rows; the transposed storage prepare_model gives down and
    output projections), rows a stride apart, 1 to MAX_ROWS rows, odd sizes that leave vector tails,
    1-3 threads, fp32, bf16 and fp16 (weights read as stored, against float64 of the same values).
    The op allocates its output in C++; comparing every element catches one left unwritten."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g)
    if layout == "rows":
        w = torch.randn(n, d, generator=g)
    elif layout == "transposed":
        w = torch.randn(d, n, generator=g).t()
    else:
        w = torch.randn(n, d + 7, generator=g)[:, 3:3 + d]
    b = torch.randn(n, generator=g) if bias else None
    x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    ref, bound = _reference(x, w, b, dtype)
    assert out.shape == (*lead, n) and out.dtype == dtype
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), (f"max error {err.max().item():.3e}, "
                                        f"bound there {bound.flatten()[err.argmax()]:.3e}")


@settings(max_examples=100, deadline=None)
@given(lead=st.sampled_from([(1,), (2, 3), (MAX_ROWS,)]), d=st.integers(1, 140),
       ns=st.lists(st.integers(1, 70), min_size=1, max_size=4), row_stride=st.booleans(), bias=st.booleans(),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_cpu_linear_cat_is_each_projection_concatenated(lead, d, ns, row_stride, bias, threads, seed, dtype):
    """Sibling projections in one call: within the float64 bound of the concatenated weight, and bit
    for bit the separate cpu_linear calls side by side (parts straddling the threads' shares, rows a
    stride apart, 1-3 threads, each dtype)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g).to(dtype)
    ws = [(torch.randn(n, d + 5, generator=g)[:, 2:2 + d] if row_stride else torch.randn(n, d, generator=g)).to(dtype)
          for n in ns]
    bs = [torch.randn(n, generator=g).to(dtype) for n in ns] if bias else None
    b = torch.cat(bs) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_linear_cat(x, ws, b)
        separate = torch.cat([torch.ops.dejavu.cpu_linear(x, w, bs[i] if bias else None) for i, w in enumerate(ws)], -1)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (*lead, sum(ns)) and out.dtype == dtype
    assert torch.equal(out, separate)
    ref, bound = _reference(x, torch.cat(ws), b, dtype)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), (f"max error {err.max().item():.3e}, "
                                        f"bound there {bound.flatten()[err.argmax()]:.3e}")


@pytest.mark.parametrize("case", ["many rows", "float64", "transposed weight"])
def test_cpu_linear_cat_hands_other_calls_to_aten(case):
    g = torch.Generator().manual_seed(0)
    x, ws, b = torch.randn(2, 40, generator=g), [torch.randn(24, 40, generator=g), torch.randn(8, 40, generator=g)], \
        torch.randn(32, generator=g)
    if case == "many rows":
        x = torch.randn(MAX_ROWS + 1, 40, generator=g)
    elif case == "float64":
        x, ws, b = x.double(), [w.double() for w in ws], b.double()
    else:
        ws[1] = torch.randn(40, 8, generator=g).t()
    expected = torch.cat([F.linear(x, ws[0], b[:24]), F.linear(x, ws[1], b[24:])], -1)
    assert torch.equal(torch.ops.dejavu.cpu_linear_cat(x, ws, b), expected)
    with pytest.raises(RuntimeError, match=r"weights \(n, 40\) expected"):
        torch.ops.dejavu.cpu_linear_cat(x, [ws[0], torch.randn(3, 7)], None)
    torch.library.opcheck(torch.ops.dejavu.cpu_linear_cat.default, (x, ws, b))


SPECIAL_WEIGHTS = {  # signed zeros, subnormals, the extremes: each must widen to its exact value
    torch.float16: [0.0, -0.0, 6e-8, -6e-8, 3e-5, -3e-5, 6.1e-5, 65504.0, -65504.0, 1.0, -2.5],
    torch.bfloat16: [0.0, -0.0, 1e-40, -1e-40, 1.2e-38, -1.2e-38, 3e38, -3e38, 1.0, -2.5],
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_linear_reads_every_half_precision_value_exactly(dtype):
    """Each special value at every position of rows long and short (the vector loop and the scalar
    tail, both layouts), read through a one-hot x: the output is the weight itself, bit for bit."""
    values = torch.tensor(SPECIAL_WEIGHTS[dtype], dtype=dtype)
    for d in (1, 7, 16, 17, 40, 67):
        for j in range(d):
            w = torch.zeros(len(values), d, dtype=dtype)
            w[:, j] = values
            x = torch.zeros(1, d, dtype=dtype)
            x[0, j] = 1.0
            for weight in (w, w.t().contiguous().t()):
                out = torch.ops.dejavu.cpu_linear(x, weight, None)
                assert torch.equal(out[0], values), (dtype, d, j, out[0], values)


@pytest.mark.parametrize("case", ["many rows", "float64", "mixed dtypes", "no unit stride", "empty"])
def test_cpu_linear_hands_other_calls_to_aten(case):
    """Calls the GEMV kernels do not take give exactly what F.linear gives (it is what runs)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    if case == "many rows":
        x = torch.randn(MAX_ROWS + 1, 40, generator=g)
    elif case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    elif case == "mixed dtypes":  # an fp32 bias on bf16 x and w: F.linear's own error
        x, w = x.bfloat16(), w.bfloat16()
        with pytest.raises(RuntimeError) as expected:
            F.linear(x, w, b)
        with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
            torch.ops.dejavu.cpu_linear(x, w, b)
        return
    elif case == "no unit stride":
        w = torch.randn(48, 80, generator=g)[::2, ::2]
    else:
        x = torch.randn(0, 40, generator=g)
    assert torch.equal(torch.ops.dejavu.cpu_linear(x, w, b), F.linear(x, w, b))


def test_cpu_linear_rejects_mismatched_shapes():
    with pytest.raises(RuntimeError, match=r"cpu_linear: x \(\.\.\., 8\) and w \(n, d\) expected"):
        torch.ops.dejavu.cpu_linear(torch.randn(1, 7), torch.randn(4, 8))


def _decode(model, options, tokens=1, training=False):
    """One decode-shaped (or prefill-shaped) forward through the backend: (logits, eager logits,
    report). training: in training mode with gradients on, as a training step runs it."""
    reports = []
    ids = torch.randint(3, 100, (1, tokens), generator=torch.Generator().manual_seed(1))
    model.train(training)
    with torch.set_grad_enabled(training):
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="dejavu", options={**options, "on_report": reports.append})
        actual = compiled(ids, use_cache=False).logits
    torch._dynamo.reset()
    model.eval()
    (report,) = reports
    return actual, expected, report


def _projections(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())


def _projection_ops(graph) -> list:
    """The dejavu op nodes of the graph but the decode attention (pass decode_attention)."""
    return [n for n in dejavu_op_nodes(graph) if n.target is not torch.ops.dejavu.cpu_decode_attention.default]


def _gemv_calls(graph) -> list[int]:
    """Per dejavu GEMV call in the graph, the projections it computes."""
    return [len(n.args[1]) if n.target in (torch.ops.dejavu.cpu_linear_cat.default,
                                           torch.ops.dejavu.cpu_q8_linear_cat.default) else 1
            for n in _projection_ops(graph)]


# Per layer, the projections that share an input: q, k, v (and gate, up) in one call; GPT-2's
# c_attn is one Conv1D already, and its weight's (in, out) storage is read by the single GEMV.
SIBLINGS = {"llama": [3, 1, 2, 1], "opt": [3, 1, 1, 1], "gpt2": [1, 1, 1, 1]}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_decode_graph_projections_all_go_through_the_gemv(arch):
    """No plan: every projection of a decode graph (attention, MLP, output head; GPT-2's Conv1D
    addmm as well) goes through the GEMV, sibling projections of one input in one call, and the
    logits equal eager's; with dense_lowering="unfused", one cpu_linear per projection, the same logits."""
    model = tiny_model(arch, layers=2)
    actual, expected, report = _decode(model, {"inner": "eager"})
    assert report.pass_counts["dense_linear"] == _projections(model)
    assert _gemv_calls(report.graph) == SIBLINGS[arch] * model.config.num_hidden_layers + [1]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    unfused, _, report = _decode(model, {"inner": "eager", "dense_lowering": "unfused"})
    assert [n.target for n in _projection_ops(report.graph)] == [torch.ops.dejavu.cpu_linear.default] * \
        _projections(model)
    assert torch.equal(unfused, actual)


def test_int8_sibling_projections_share_one_call():
    """quantize_weights' int8 projections of one input (q, k, v; gate, up) become one
    cpu_q8_linear_cat call at decode shapes, the logits bit for bit those of separate calls; a
    prefill graph keeps the model's own calls."""
    from dejavu_compile import quantize_weights

    model = tiny_model("llama", layers=2)
    quantize_weights(model)
    actual, expected, report = _decode(model, {"inner": "eager"})
    assert _gemv_calls(report.graph) == [3, 2] * model.config.num_hidden_layers
    assert torch.equal(actual, expected)
    _, _, report = _decode(model, {"inner": "eager"}, MAX_ROWS + 1)
    assert _gemv_calls(report.graph) == []


def test_prefill_training_and_aten_option_keep_the_traced_projections():
    model = tiny_model("llama", layers=1)
    for options, tokens, training in (({}, MAX_ROWS + 1, False), ({}, 1, True), ({"dense_lowering": "aten"}, 1, False)):
        _, _, report = _decode(model, {"inner": "eager", **options}, tokens, training)
        assert report.pass_counts["dense_linear"] == 0 and dejavu_op_nodes(report.graph) == []


def test_sparse_plan_leaves_its_projections_to_the_sparse_ops():
    """With a plan the MLPs go to the sparse op and only the rest to the GEMV."""
    model = tiny_model("llama", layers=2)
    _, _, report = _decode(model, {"inner": "eager", "plan": sparse_plan(model, 0.5), "cpu_lowering": "op"})
    layers = model.config.num_hidden_layers
    assert report.pass_counts["sparse_mlp"] == layers
    assert report.pass_counts["dense_linear"] == _projections(model) - 3 * layers


@pytest.mark.slow
def test_inductor_decode_with_the_gemv_matches_eager():
    """Under Inductor the op is an extern call in the compiled decode step; greedy tokens over a
    static cache equal eager's."""
    model = tiny_model("llama", layers=2)
    expected, actual, reports = greedy_through_backend(model, token_ids(tokens=5, seed=2, high=100))
    assert torch.equal(actual, expected)
    assert any(r.pass_counts.get("dense_linear", 0) == _projections(model) for r in reports)


def test_cpu_decode_graphs_compile_under_inductors_cpp_wrapper(monkeypatch):
    """A graph holding the backend's C++ ops (a CPU decode graph, int8 projections included) reaches
    Inductor with its C++ wrapper on, built apart from the kernels, unless the option inductor_config turns it off; a
    prefill graph keeps Inductor's own settings. (Inductor itself is not run here: the spy returns
    the graph; test_inductor_decode_with_the_gemv_matches_eager decodes through the C++ wrapper.)"""
    import torch._inductor.compile_fx as compile_fx

    seen = []

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append((bool(dejavu_op_nodes(gm)), dict(config_patches or {})))
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", spy)
    model = tiny_model("llama", layers=1)
    cases = (({}, 1), ({"inductor_config": {"cpp_wrapper": False, "size_asserts": False}}, 1), ({}, MAX_ROWS + 1))
    for options, tokens in cases:
        _decode(model, {"inner": "inductor", **options}, tokens)
    (decode_ops, decode), (override_ops, override), (prefill_ops, prefill) = seen
    assert decode_ops and decode == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    assert override_ops and override == {"cpp_wrapper": False, "cpp_wrapper_build_separate": True,
                                         "size_asserts": False}
    assert not prefill_ops and "cpp_wrapper" not in prefill
    # int8 projections the model itself calls (quantize_weights): the decode graph, not the prefill
    from dejavu_compile import quantize_weights

    quantize_weights(model)
    seen.clear()
    for tokens in (1, MAX_ROWS + 1):
        _decode(model, {"inner": "inductor"}, tokens)
    (_, int8_decode), (_, int8_prefill) = seen
    assert int8_decode == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    assert "cpp_wrapper" not in int8_prefill


def test_machine_tuning_is_measured_once_and_cached_beside_the_build(tmp_path):
    """The settings come from the tried choices and are written where the next process reads them
    (a second call with the file present does not measure again: it returns the file's values)."""
    lib = native._load()
    path = tmp_path / "kernels.tuning.json"
    first = native.machine_tuning(lib, path)
    assert (first["mlp_prefetch_rows"], first["mlp_prefetch_bytes"]) in native.MLP_PREFETCH_CHOICES
    assert first["linear_prefetch_rows"] in native.LINEAR_PREFETCH_CHOICES
    assert first["int8_prefetch_rows"] in native.INT8_PREFETCH_CHOICES
    path.write_text('{"mlp_prefetch_rows": 8, "mlp_prefetch_bytes": 1024, "linear_prefetch_rows": 2, '
                    '"int8_prefetch_rows": 4}')
    assert native.machine_tuning(lib, path) == {"mlp_prefetch_rows": 8, "mlp_prefetch_bytes": 1024,
                                                "linear_prefetch_rows": 2, "int8_prefetch_rows": 4}
    # a file from before a setting existed: the value the kernels hold fills it in; measuring left them as they were
    held = native.held_tuning(lib)
    assert held == native.tuning()
    path.write_text('{"mlp_prefetch_rows": 8, "mlp_prefetch_bytes": 1024, "linear_prefetch_rows": 2}')
    assert native.machine_tuning(lib, path)["int8_prefetch_rows"] == held["int8_prefetch_rows"]
    assert native.tuning().keys() == first.keys()
