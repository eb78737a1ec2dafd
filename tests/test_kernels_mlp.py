"""Neuron-sparse MLP ops (CPU: the C kernel and the torch path) against a float64 dense masked reference."""
from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dejavu_compile.kernels import (
    ACTIVATIONS,
    prepare_gated_mlp_weights,
    prepare_mlp_weights,
    prepared_overhead,
    sparse_gated_mlp,
    sparse_gated_mlp_torch,
    sparse_mlp,
    sparse_mlp_torch,
    torch_impl,
)
from dejavu_compile.kernels.cpu import native
from tests.kernel_reference import assert_close, mlp_cases, mlp_problem, mlp_reference

torch.set_num_threads(1)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _nan_out(p):
    return torch.full((p["x"].shape[0], p["w_down_t"].shape[1]), float("nan"), dtype=p["x"].dtype)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mlp_cases(), dtype=st.sampled_from(DTYPES), activation=st.sampled_from(ACTIVATIONS),
       stacked=st.booleans(), small_chunks=st.booleans(), use_native=st.booleans())
def test_sparse_gated_mlp_matches_masked_dense(case, dtype, activation, stacked, small_chunks, use_native, poison):
    # small_chunks: several gather chunks even on small shapes; use_native=False: the torch path in fp32 too
    with mock.patch.object(torch_impl, "CHUNK_BYTES", 1 if small_chunks else torch_impl.CHUNK_BYTES), \
            mock.patch.dict(native._STATE, enabled=use_native and native._STATE["enabled"]):
        _check_gated(case, dtype, activation, stacked)


def _check_gated(case, dtype, activation, stacked):
    p = mlp_problem(dtype=dtype, gated=True, **case)
    ref, bound = mlp_reference(p, activation, gated=True)
    wg, wu = p["w_gate"], p["w_up"]
    if stacked:  # the (F, 2, d) layout of prepare_gated_mlp_weights: one gather for both
        prep = prepare_gated_mlp_weights(wg, wu, p["w_down_t"].t())
        wg, wu = prep["w_gate"], prep["w_up"]
        assert torch_impl.stacked_rows(wg, wu) is not None
    out = sparse_gated_mlp_torch(p["x"], wg, wu, p["w_down_t"], p["idx"], activation,
                                 p["b_gate"], p["b_up"], p["b_down"], out=_nan_out(p))
    assert_close(out, ref, bound, dtype, "torch path")
    op_out = sparse_gated_mlp(p["x"], wg, wu, p["w_down_t"], p["idx"], activation,
                              b_gate=p["b_gate"], b_up=p["b_up"], b_down=p["b_down"])
    assert_close(op_out, ref, bound, dtype, "custom op")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mlp_cases(), dtype=st.sampled_from(DTYPES), activation=st.sampled_from(ACTIVATIONS),
       use_native=st.booleans())
def test_sparse_mlp_matches_masked_dense(case, dtype, activation, use_native, poison):
    with mock.patch.dict(native._STATE, enabled=use_native and native._STATE["enabled"]):
        _check_plain(case, dtype, activation)


def _check_plain(case, dtype, activation):
    p = mlp_problem(dtype=dtype, gated=False, **case)
    ref, bound = mlp_reference(p, activation, gated=False)
    out = sparse_mlp_torch(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"],
                           activation, out=_nan_out(p))
    assert_close(out, ref, bound, dtype, "torch path")
    op_out = sparse_mlp(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"], activation)
    assert_close(op_out, ref, bound, dtype, "custom op")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("path", ["c", "torch"])
def test_every_table_activation(activation, path, native_calls, poison):
    """Each activation of the table through the C kernel and the torch path on a fixed problem (the
    property tests draw activations at random; this makes each one certain)."""
    if path == "c" and not native.available():
        pytest.skip(f"C kernel unavailable: {native._STATE['error']}")
    case = dict(seed=11, batch=3, d=37, n=64, k=40, per_row=True, biases=True)
    with mock.patch.dict(native._STATE, enabled=path == "c"):
        _check_gated(case, torch.float32, activation, stacked=True)
        _check_plain(case, torch.float32, activation)
    assert len(native_calls) == (4 if path == "c" else 0)  # two calls (function, op) per check


@st.composite
def fused_cases(draw):
    """Sizes >= 2 (dynamic-shape graphs specialise on 1: fewer compiles), per-row and shared idx."""
    n = draw(st.integers(2, 100))
    return dict(seed=draw(st.integers(0, 2**31)), batch=draw(st.integers(1, 8)), d=draw(st.integers(2, 80)),
                n=n, k=draw(st.integers(2, n)), per_row=draw(st.booleans()), biases=draw(st.booleans()))


@pytest.fixture
def fused_on_small_shapes(monkeypatch):
    """Large calls take the Inductor-fused gather; force it on the small test shapes, and fail if
    the chunked path runs where the fused one should."""
    monkeypatch.setattr(torch_impl, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setitem(torch_impl._FUSED, "enabled", True)
    monkeypatch.setitem(native._STATE, "enabled", False)  # the C kernel would take fp32 calls
    chunked = torch_impl.chunked_gather_activate

    def only_shared_batches(x, w_a, w_b, idx, *args):
        assert idx.dim() == 1 and x.shape[0] > 1, "the fused path should have run"
        return chunked(x, w_a, w_b, idx, *args)

    monkeypatch.setattr(torch_impl, "chunked_gather_activate", only_shared_batches)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=fused_cases(), stacked=st.booleans())
def test_fused_cpu_gather_matches_masked_dense(case, stacked, fused_on_small_shapes, poison):
    _check_gated(case, torch.float32, "silu", stacked)


@pytest.mark.parametrize("dtype, gated, activation", [
    (torch.bfloat16, True, "silu"), (torch.float16, True, "gelu_tanh"), (torch.float32, False, "relu"),
    (torch.float32, False, "gelu")])
def test_fused_cpu_gather_dtypes_and_plain_mlp(dtype, gated, activation, fused_on_small_shapes, poison):
    case = dict(seed=7, batch=3, d=40, n=70, k=33, per_row=True, biases=True)
    if gated:
        _check_gated(case, dtype, activation, stacked=True)
        return
    p = mlp_problem(dtype=dtype, gated=False, **case)
    ref, bound = mlp_reference(p, activation, gated=False)
    out = sparse_mlp_torch(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"],
                           activation, out=_nan_out(p))
    assert_close(out, ref, bound, dtype, "fused torch path")


def test_fused_cpu_gather_accepts_parameters_with_grad(fused_on_small_shapes):
    """Called directly on nn.Parameters with autograd on (no torch.no_grad()): still computes."""
    case = dict(seed=4, batch=2, d=16, n=40, k=9, per_row=True, biases=False)
    p = mlp_problem(dtype=torch.float32, gated=True, **case)
    ref, bound = mlp_reference(p, "silu", gated=True)
    params = {n: torch.nn.Parameter(p[n]) for n in ("w_gate", "w_up", "w_down_t")}
    out = sparse_gated_mlp_torch(p["x"], params["w_gate"], params["w_up"], params["w_down_t"], p["idx"], "silu")
    assert_close(out.detach(), ref, bound, torch.float32, "fused path with grad-enabled weights")


def test_fused_cpu_gather_falls_back_when_inductor_fails(monkeypatch):
    """No C++ compiler (or any Inductor failure): one warning, then the chunked path, same result."""
    monkeypatch.setitem(native._STATE, "enabled", False)
    monkeypatch.setattr(torch_impl, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setitem(torch_impl._FUSED, "enabled", True)

    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setitem(torch_impl._FUSED, "fn", broken)
    case = dict(seed=3, batch=2, d=24, n=50, k=20, per_row=True, biases=False)
    p = mlp_problem(dtype=torch.float32, gated=True, **case)
    ref, bound = mlp_reference(p, "silu", gated=True)
    with pytest.warns(RuntimeWarning, match="chunked torch path"):
        out = sparse_gated_mlp_torch(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu")
    assert_close(out, ref, bound, torch.float32, "fallback")
    assert torch_impl._FUSED["enabled"] is False


def test_reference_detects_a_dropped_neuron():
    """The comparison can fail: leaving out one selected neuron is caught."""
    p = mlp_problem(seed=0, batch=2, d=16, n=24, k=12, dtype=torch.float32, gated=True, per_row=False, biases=False)
    ref, bound = mlp_reference(p, "silu", gated=True)
    out = sparse_gated_mlp(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"][:-1], "silu")
    with pytest.raises(AssertionError):
        assert_close(out, ref, bound, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_density_equals_llama_mlp(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=136, hidden_act="silu", num_attention_heads=4,
                      num_key_value_heads=4)
    mlp = LlamaMLP(cfg).to(dtype)
    x = torch.randn(5, 48, dtype=dtype)
    with torch.no_grad():
        dense = mlp(x)
        prep = prepare_gated_mlp_weights(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        out = sparse_gated_mlp(x, prep["w_gate"], prep["w_up"], prep["w_down_t"], torch.arange(136), "silu")
        # the dense path can run from the prepared storage alone
        d = prep["dense"]
        dense_views = F.linear(F.silu(F.linear(x, d["w_gate"])) * F.linear(x, d["w_up"]), d["w_down"])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    scale = dense.abs().max().item()
    assert (out - dense).abs().max().item() <= tol * scale * 4
    assert (dense_views - dense).abs().max().item() <= tol * scale * 4


def test_full_density_equals_plain_linear_mlp():
    torch.manual_seed(1)
    fc, proj = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)
    x = torch.randn(3, 32)
    with torch.no_grad():
        dense = proj(F.gelu(fc(x), approximate="tanh"))
        prep = prepare_mlp_weights(fc.weight, proj.weight, fc.bias, proj.bias)
        out = sparse_mlp(x, prep["w_up"], prep["b_up"], prep["w_down_t"], prep["b_down"], torch.arange(96), "gelu_tanh")
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_prepare_conv1d_layout_and_overhead():
    torch.manual_seed(2)
    c_fc, c_proj = torch.randn(32, 96), torch.randn(96, 32)  # GPT-2 Conv1D weights are (in, out)
    prep = prepare_mlp_weights(c_fc, c_proj, layout="in_out")
    torch.testing.assert_close(prep["w_up"], c_fc.t())
    torch.testing.assert_close(prep["dense"]["w_down"], c_proj.t())
    assert prepared_overhead(prep, [c_fc, c_proj]) == 0.0
    wg, wu, wd = torch.randn(96, 32), torch.randn(96, 32), torch.randn(32, 96)
    prep = prepare_gated_mlp_weights(wg, wu, wd)
    assert prepared_overhead(prep, [wg, wu, wd]) == 0.0
    assert prep["w_gate"].untyped_storage().data_ptr() == prep["w_up"].untyped_storage().data_ptr()


def _args():
    torch.manual_seed(3)
    return dict(x=torch.randn(2, 8), w_gate=torch.randn(10, 8), w_up=torch.randn(10, 8),
                w_down_t=torch.randn(10, 8), idx=torch.tensor([1, 4, 7]), activation="silu")


@pytest.mark.parametrize("change, exc, word", [
    (dict(idx=torch.tensor([1, 10])), ValueError, "idx"),
    (dict(idx=torch.tensor([-1, 2])), ValueError, "idx"),
    (dict(idx=torch.tensor([1, 2], dtype=torch.int32)), TypeError, "idx"),
    (dict(idx=torch.tensor([[1, 2]] * 3)), ValueError, "idx"),
    (dict(idx=torch.zeros(0, dtype=torch.int64)), ValueError, "idx"),
    (dict(w_up=torch.randn(10, 8, dtype=torch.float64)), TypeError, "w_up"),
    (dict(w_up=torch.randn(11, 8)), ValueError, "w_up"),
    (dict(w_gate=torch.randn(10, 9)), ValueError, "w_gate"),
    (dict(w_down_t=torch.randn(8, 10)), ValueError, "w_down_t"),
    (dict(x=torch.randn(8)), ValueError, "x"),
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(b_down=torch.randn(7)), ValueError, "b_down"),
    (dict(w_gate=torch.randn(10, 8, device="meta")), ValueError, "w_gate"),
])
def test_bad_input_raises_clear_error(change, exc, word):
    args = {**_args(), **change}
    for fn in (sparse_gated_mlp, sparse_gated_mlp_torch):
        with pytest.raises(exc, match=word):
            fn(**args)


def test_sparse_mlp_bad_bias():
    a = _args()
    with pytest.raises(ValueError, match="b_up"):
        sparse_mlp(a["x"], a["w_up"], torch.randn(3), a["w_down_t"], None, a["idx"], "relu")


def test_package_imports_and_runs_without_triton():
    """Triton is imported only on the CUDA path: with it missing, the CPU ops still work."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, dejavu_compile.kernels as K\n"
            "x = torch.randn(1, 8); w = torch.randn(10, 8)\n"
            "print(K.sparse_gated_mlp(x, w, w, w, torch.tensor([1, 2]), 'relu').shape)\n"
            "assert 'dejavu_compile.kernels.triton.mlp' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch.Size([1, 8])" in res.stdout


# ---------------------------------------------------------------------------------------------
# the C kernel (cpu/native.py): fp32 CPU calls take it when it builds


needs_native = pytest.mark.skipif(not native.available(), reason=f"C kernel unavailable: {native._STATE['error']}")


@pytest.fixture
def native_calls(monkeypatch):
    """Counts C-kernel calls, so a test fails if the torch path silently ran instead."""
    calls = []
    real = native.sparse_mlp_f32

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "sparse_mlp_f32", spy)
    return calls


@needs_native
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mlp_cases(), activation=st.sampled_from(ACTIVATIONS), gated=st.booleans(), stacked=st.booleans(),
       d_out=st.one_of(st.none(), st.integers(1, 90)), threads=st.sampled_from([1, 2, 3]))
def test_native_kernel_matches_masked_dense(case, activation, gated, stacked, d_out, threads, native_calls, poison):
    """Every shape from one neuron to all, shared and per-row idx, biases, a down width unlike d,
    stacked (strided) gate/up rows, 1-3 threads (the per-thread sums), NaN-poisoned buffers."""
    p = mlp_problem(dtype=torch.float32, gated=gated, d_out=d_out, **case)
    ref, bound = mlp_reference(p, activation, gated=gated)
    calls_before = len(native_calls)  # the fixture lives across Hypothesis examples
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if gated:
            wg, wu = p["w_gate"], p["w_up"]
            if stacked:
                both = torch.stack([wg, wu], dim=1)
                wg, wu = both[:, 0], both[:, 1]
            out = sparse_gated_mlp(p["x"], wg, wu, p["w_down_t"], p["idx"], activation,
                                   b_gate=p["b_gate"], b_up=p["b_up"], b_down=p["b_down"])
        else:
            out = sparse_mlp(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"], activation)
    finally:
        torch.set_num_threads(before)
    assert len(native_calls) == calls_before + 1
    assert_close(out, ref, bound, torch.float32, "C kernel")


@needs_native
def test_native_kernel_reads_shared_idx_expanded_and_writes_given_out(native_calls, poison):
    """A shared idx expanded to (B, k) (stride 0) and a non-contiguous out buffer."""
    p = mlp_problem(seed=5, batch=4, d=33, n=60, k=21, dtype=torch.float32, gated=True, per_row=False, biases=True)
    ref, bound = mlp_reference(p, "gelu", gated=True)
    out = torch.full((p["x"].shape[1], 4), float("nan")).t()  # (4, d) with strides (1, 4)
    sparse_gated_mlp_torch(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"].expand(4, -1), "gelu",
                           p["b_gate"], p["b_up"], p["b_down"], out=out)
    assert len(native_calls) == 1
    assert_close(out, ref, bound, torch.float32, "C kernel into a strided out")


@needs_native
def test_native_kernel_skips_what_it_cannot_read(native_calls):
    """fp16, or weight rows that are not unit-stride, take the torch path (and stay right)."""
    p = mlp_problem(seed=2, batch=2, d=24, n=40, k=10, dtype=torch.float32, gated=True, per_row=True, biases=False)
    ref, bound = mlp_reference(p, "silu", gated=True)
    column_major = p["w_gate"].t().contiguous().t()
    out = sparse_gated_mlp(p["x"], column_major, p["w_up"], p["w_down_t"], p["idx"], "silu")
    assert_close(out, ref, bound, torch.float32, "torch path on a column-major weight")
    half = {k: (v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in p.items()}
    sparse_gated_mlp(half["x"], half["w_gate"], half["w_up"], half["w_down_t"], half["idx"], "silu")
    assert native_calls == []


def test_native_kernel_unavailable_warns_once_and_falls_back(monkeypatch):
    """No C compiler: one warning naming the reason, then the torch path with the same result."""
    monkeypatch.setitem(native._STATE, "lib", None)
    monkeypatch.setitem(native._STATE, "error", None)
    monkeypatch.setitem(native._STATE, "enabled", True)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    p = mlp_problem(seed=3, batch=1, d=20, n=30, k=7, dtype=torch.float32, gated=True, per_row=False, biases=False)
    ref, bound = mlp_reference(p, "silu", gated=True)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        out = sparse_gated_mlp(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu")
    assert_close(out, ref, bound, torch.float32, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls stay quiet
        sparse_gated_mlp(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu")
    assert not native.available()


@needs_native
def test_native_kernel_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    """The library lands under $DEJAVU_CACHE/kernels; a second build with the same key reuses it."""
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setattr(native, "_cpu_key", lambda: "another CPU")
    assert native._build(cc) != first
    monkeypatch.undo()
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    # the activation table's defines are flags: another table (here, one more flag) is another build
    assert native._build(cc, flags=(*native.FLAGS, "-DDEJAVU_UNUSED=1")) != first
    edited = tmp_path / native.SOURCE.name
    edited.write_text(native.SOURCE.read_text() + "\n/* edited */\n")
    assert native._build(cc, source=edited) != first


def _table_flags(extra_name: str = "", extra_code: int = 99) -> tuple:
    """The C build flags, with one more activation in the table when extra_name is given."""
    from dejavu_compile import activations
    entries = " ".join(f"X({a.name}, {a.name.upper()})" for a in activations.BUILTIN)
    codes = [f"-DDEJAVU_ACT_{a.name.upper()}={a.code}" for a in activations.BUILTIN]
    if extra_name:
        entries += f" X({extra_name}, {extra_name.upper()})"
        codes.append(f"-DDEJAVU_ACT_{extra_name.upper()}={extra_code}")
    flags = [f for f in native.FLAGS if not f.startswith("-DDEJAVU_")]
    return (*flags, *codes, f"-DDEJAVU_ACTIVATIONS(X)={entries}")


@needs_native
def test_native_build_needs_a_case_for_every_table_entry(monkeypatch, tmp_path):
    """The C kernel switches on the table's codes: a table entry without a case, or a build without
    the table's defines, is a compile error rather than a silent default."""
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    cc = native._compiler()
    assert native._build(cc, flags=_table_flags()).exists()  # the same table, spelled out here
    with pytest.raises(RuntimeError, match="ACT_ENUM_SWISHY"):
        native._build(cc, flags=_table_flags("swishy"))
    with pytest.raises(RuntimeError, match="c_defines"):
        native._build(cc, flags=tuple(f for f in native.FLAGS if not f.startswith("-DDEJAVU_")))
