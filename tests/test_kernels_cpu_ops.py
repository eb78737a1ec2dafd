"""The backend's C++ CPU decode ops (kernels/cpu/cpu_ops.cpp): dejavu::cpu_sparse_mlp against a float64
dense masked reference, dejavu::cpu_glu_int8_topk and dejavu::cpu_glu_int8_mlp against float64
values of the dequantized weights."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dejavu_compile.kernels import ACTIVATIONS, int8_linear
from dejavu_compile.kernels.cpu import native
from tests.kernel_reference import (
    RTOL,
    act64,
    act_slope,
    assert_close,
    int8_rows,
    mlp_cases,
    mlp_problem,
    mlp_reference,
    rounding_to,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")


def sparse_mlp_op(p, activation, gated, stacked=False):
    w_a, w_b = (p["w_gate"], p["w_up"]) if gated else (p["w_up"], None)
    if stacked and gated:
        both = torch.stack([w_a, w_b], dim=1)  # rows 2d apart, as prepare_gated_mlp_weights lays them out
        w_a, w_b = both[:, 0], both[:, 1]
    b_a, b_b = (p["b_gate"], p["b_up"]) if gated else (p["b_up"], None)
    return torch.ops.dejavu.cpu_sparse_mlp(p["x"], w_a, w_b, p["w_down_t"], p["idx"], activation, b_a, b_b,
                                           p["b_down"])


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def assert_rounded_close(out, ref, bound, dtype, what):
    """The op sums in fp32 from the weights' exact values and rounds once to `dtype`: fp32's
    tolerance on the magnitude bound, plus half a unit of `dtype` on the result."""
    assert out.dtype == dtype, (what, out.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten buffer?)"
    fp32 = RTOL[torch.float32] * bound
    tol = fp32 + rounding_to(dtype, ref, fp32)
    err = (out.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what} {dtype}: error {err.max().item():.3g} exceeds tolerance (ratio {worst:.3g})"


@settings(max_examples=150, deadline=None)
@given(case=mlp_cases(), activation=st.sampled_from(ACTIVATIONS), gated=st.booleans(), stacked=st.booleans(),
       d_out=st.one_of(st.none(), st.integers(1, 90)), threads=st.sampled_from([1, 2, 3]), dtype=DTYPES)
def test_cpu_sparse_mlp_matches_masked_dense(case, activation, gated, stacked, d_out, threads, dtype):
    """One neuron to all, shared and per-row idx, biases, a down width unlike d, stacked rows, 1-3
    threads, fp32, bf16 and fp16 weights (against float64 of the same values). The op allocates its
    output inside C++, so a NaN-poisoned buffer cannot be handed in: the reference comparison
    catches any element left unwritten."""
    p = mlp_problem(dtype=dtype, gated=gated, d_out=d_out, **case)
    ref, bound = mlp_reference(p, activation, gated=gated)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = sparse_mlp_op(p, activation, gated, stacked)
    finally:
        torch.set_num_threads(before)
    assert_rounded_close(out, ref, bound, dtype, "cpu_sparse_mlp")


def int8_problem(seed, batch, d, n):
    g = torch.Generator().manual_seed(seed)
    wg, wu = torch.randn(n, d, generator=g) / d ** 0.5, torch.randn(n, d, generator=g) / d ** 0.5
    rows, scales = int8_rows(wg, wu)
    return torch.randn(batch, d, generator=g), rows, scales


def int8_scores64(x, w_int8, scale, activation):
    """|act(g) * u| in float64 from the dequantized int8 weights and the exact x."""
    h = x.double() @ (w_int8.double() * scale.double()[:, None]).T
    n = w_int8.shape[0] // 2
    return (act64(h[:, :n], activation) * h[:, n:]).abs()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 8), d=st.integers(1, 200), n=st.integers(1, 150),
       share=st.floats(0.0, 1.0), activation=st.sampled_from(ACTIVATIONS), threads=st.sampled_from([1, 2, 3]))
def test_cpu_glu_int8_topk_keeps_the_top_scores(seed, batch, d, n, share, activation, threads):
    """d and F off every vector width (the kernel's tails), odd F (its last pair), k from 1 to F:
    ids ascending, distinct, in range, and no neuron left out scores clearly above one kept."""
    _check_int8_topk(seed, batch, d, n, share, activation, threads)


def _check_int8_topk(seed, batch, d, n, share, activation, threads):
    x, w_int8, scale = int8_problem(seed, batch, d, n)
    k = max(1, round(share * n))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        idx = torch.ops.dejavu.cpu_glu_int8_topk(x, w_int8, scale, k, activation)
    finally:
        torch.set_num_threads(before)
    assert idx.shape == (batch, k) and idx.dtype == torch.int64
    assert bool((idx[:, 1:] > idx[:, :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < n
    scores = int8_scores64(x, w_int8, scale, activation)
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    lowest_kept = scores.masked_fill(~kept, float("inf")).min(1).values
    highest_left = scores.masked_fill(kept, -float("inf")).max(1).values
    # x is quantized to int16 inside the op: scores agree to ~1e-4 of the largest
    tol = 1e-3 * scores.max(1).values + 1e-12
    assert bool((highest_left <= lowest_kept + tol).all()), (highest_left - lowest_kept).max()


def int8_values64(x, w_int8, scale, activation):
    """act(g) * u in float64 from the dequantized int8 weights and the exact x (signed)."""
    h = x.double() @ (w_int8.double() * scale.double()[:, None]).T
    n = w_int8.shape[0] // 2
    return act64(h[:, :n], activation) * h[:, n:]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 8), d=st.integers(1, 200), n=st.integers(1, 150),
       d_out=st.integers(1, 90), share=st.floats(0.0, 1.0), activation=st.sampled_from(ACTIVATIONS),
       bias=st.booleans(), threads=st.sampled_from([1, 2, 3]), x_dtype=DTYPES, rows_dtype=DTYPES)
@example(seed=1214, batch=3, d=1, n=44, d_out=1, share=0.0, activation="silu", bias=False, threads=1,
         x_dtype=torch.float16, rows_dtype=torch.float32)  # an fp16 result below the subnormals' spacing
def test_cpu_glu_int8_mlp_sums_the_predictors_values(seed, batch, d, n, d_out, share, activation, bias, threads,
                                                     x_dtype, rows_dtype):
    """The block from the int8 predictor's own values: it keeps what cpu_glu_int8_topk keeps (the
    same scores), and its output is sum over kept j of act(g~_j) * u~_j * w_down_t[j] (+ b_down),
    against float64 on the op's ids; k from 1 to F, down widths unlike d (every vector tail), 1-3
    threads, x (and the bias, and the result) in fp32, bf16 or fp16, down rows in fp32, bf16 (an
    fp32 model's bf16 copy, or a bf16 model's own) or fp16, against the float64 of their values."""
    _check_int8_mlp(seed, batch, d, n, d_out, share, activation, bias, threads, x_dtype, rows_dtype)


def _check_int8_mlp(seed, batch, d, n, d_out, share, activation, bias, threads, x_dtype=torch.float32,
                    rows_dtype=torch.float32):
    x, w_int8, scale = int8_problem(seed, batch, d, n)
    x = x.to(x_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    w_down_t = torch.randn(n, d_out, generator=g).to(rows_dtype)
    b_down = torch.randn(d_out, generator=g).to(x_dtype) if bias else None
    k = max(1, round(share * n))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, idx = torch.ops.dejavu.cpu_glu_int8_mlp(x, w_int8, scale, w_down_t, k, activation, b_down)
        assert torch.equal(idx, torch.ops.dejavu.cpu_glu_int8_topk(x, w_int8, scale, k, activation))
        # the scores of a half-precision x are those of its fp32 values (the predictor's input cast)
        assert torch.equal(idx, torch.ops.dejavu.cpu_glu_int8_topk(x.float(), w_int8, scale, k, activation))
    finally:
        torch.set_num_threads(before)
    assert out.dtype == x_dtype
    values = int8_values64(x, w_int8, scale, activation)
    kept_ids = torch.zeros_like(values, dtype=torch.bool).scatter_(1, idx, True)
    kept = values * kept_ids
    w = w_down_t.double()
    ref = kept @ w + (0 if b_down is None else b_down.double())
    # x goes to int16 inside the op (rounding <= half a step of max|x| / (2^bits - 1), bits as the
    # kernel picks them), which moves each g and u by at most that times the row's L1 norm; act's
    # slope is at most `slope` there, so act(g) * u moves by at most dh (products of errors included).
    # On top, float32 rounding of the sums.
    bits = min(15, 24 - max(0, (d - 1).bit_length()))
    half_step = x.double().abs().amax(1, keepdim=True) / (2 ** bits - 1) / 2
    rows = (w_int8.double() * scale.double()[:, None]).abs().sum(1)
    h = x.double() @ (w_int8.double() * scale.double()[:, None]).T
    err_g, err_u = half_step * rows[:n], half_step * rows[n:]
    g_act = act64(h[:, :n], activation).abs()
    slope = act_slope(h[:, :n].abs() + err_g, activation)
    dh = slope * err_g * (h[:, n:].abs() + err_u) + (g_act + slope * err_g) * err_u
    tol = (1e-4 * (kept.abs() @ w.abs() + (0 if b_down is None else b_down.double().abs()))
           + 2 * (dh * kept_ids) @ w.abs())
    tol = tol + rounding_to(x_dtype, ref, tol)  # a half-precision result: rounded once at the end
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    assert bool((err <= tol + 1e-30).all()), (err / (tol + 1e-30)).max()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_table_activation(activation):
    """Each activation of the table through the three ops on fixed problems (the property tests
    above draw activations at random; this makes each one certain)."""
    for gated in (True, False):
        p = mlp_problem(seed=11, batch=3, d=37, n=64, k=40, dtype=torch.float32, gated=gated, per_row=True,
                        biases=True, d_out=29)
        ref, bound = mlp_reference(p, activation, gated=gated)
        assert_close(sparse_mlp_op(p, activation, gated), ref, bound, torch.float32, f"cpu_sparse_mlp {activation}")
    _check_int8_topk(seed=5, batch=3, d=70, n=51, share=0.4, activation=activation, threads=2)
    _check_int8_mlp(seed=5, batch=3, d=70, n=51, d_out=33, share=0.4, activation=activation, bias=True, threads=2)


def test_int8_scores_agree_with_int8_linear():
    """The fused op and the int8_linear op (calibration, simulation, other lowerings) score with the
    same integer arithmetic: their top-k agree."""
    x, w_int8, scale = int8_problem(7, 4, 96, 300)
    h = int8_linear(x, w_int8, scale)
    scores = (F.silu(h[:, :300]) * h[:, 300:]).abs()
    expected = torch.topk(scores, 120, dim=-1).indices.sort(-1).values
    assert torch.equal(torch.ops.dejavu.cpu_glu_int8_topk(x, w_int8, scale, 120, "silu"), expected)


def test_nan_input_gives_valid_ids():
    """A NaN in x: NaN scores count as the largest (as in torch.topk) and the ids stay valid."""
    x, w_int8, scale = int8_problem(3, 2, 40, 50)
    x[0, 3] = float("nan")
    idx = torch.ops.dejavu.cpu_glu_int8_topk(x, w_int8, scale, 10, "silu")
    assert idx.shape == (2, 10) and int(idx.min()) >= 0 and int(idx.max()) < 50
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_opcheck_and_inside_compile():
    p = mlp_problem(seed=1, batch=2, d=24, n=40, k=9, dtype=torch.float32, gated=True, per_row=True, biases=True)
    x, w_int8, scale = int8_problem(2, 2, 24, 40)
    mlp_args = (p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "gelu", p["b_gate"], p["b_up"], p["b_down"])
    torch.library.opcheck(torch.ops.dejavu.cpu_sparse_mlp.default, mlp_args)
    torch.library.opcheck(torch.ops.dejavu.cpu_glu_int8_topk.default, (x, w_int8, scale, 11, "silu"))
    torch.library.opcheck(torch.ops.dejavu.cpu_glu_int8_mlp.default,
                          (x, w_int8, scale, p["w_down_t"], 11, "silu", p["b_down"]))

    def step(x):
        idx = torch.ops.dejavu.cpu_glu_int8_topk(x, w_int8, scale, 11, "silu")
        return torch.ops.dejavu.cpu_sparse_mlp(x, p["w_gate"], p["w_up"], p["w_down_t"], idx, "silu") * 2 + 1

    def block(x):
        out, idx = torch.ops.dejavu.cpu_glu_int8_mlp(x, w_int8, scale, p["w_down_t"], 11, "gelu", p["b_down"])
        return out * 2 + 1, idx

    for fn in (step, block):
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)


def test_bad_input_is_a_clear_error():
    p = mlp_problem(seed=4, batch=1, d=16, n=20, k=5, dtype=torch.float32, gated=True, per_row=False, biases=False)
    op = torch.ops.dejavu.cpu_sparse_mlp
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(p["x"].double(), p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu")
    with pytest.raises(RuntimeError, match="w_a must be Half, got Float"):  # one dtype per call
        op(p["x"].half(), p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu")
    with pytest.raises(RuntimeError, match="b_down must be Float, got BFloat16"):
        op(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu", None, None, p["w_down_t"][0].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        op(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], torch.tensor([0, 20]), "silu")
    with pytest.raises(RuntimeError, match="int64"):
        op(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"].int(), "silu")
    with pytest.raises(RuntimeError, match="w_b must be"):
        op(p["x"], p["w_gate"], p["w_up"][:, :8], p["w_down_t"], p["idx"], "silu")
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        op(p["x"], p["w_gate"].t().contiguous().t(), p["w_up"], p["w_down_t"], p["idx"], "silu")
    with pytest.raises(RuntimeError, match="activation"):
        op(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "tanh")
    x, w_int8, scale = int8_problem(5, 1, 16, 20)
    topk = torch.ops.dejavu.cpu_glu_int8_topk
    with pytest.raises(RuntimeError, match="k must be"):
        topk(x, w_int8, scale, 21, "silu")
    with pytest.raises(RuntimeError, match="w_int8"):
        topk(x, w_int8.float(), scale, 3, "silu")
    with pytest.raises(RuntimeError, match="scale"):
        topk(x, w_int8, scale[:-1], 3, "silu")
    block = torch.ops.dejavu.cpu_glu_int8_mlp
    with pytest.raises(RuntimeError, match="w_down_t must be"):
        block(x, w_int8, scale, torch.zeros(19, 8), 3, "silu")
    with pytest.raises(RuntimeError, match="w_down_t must be float32, bfloat16 or float16"):
        block(x, w_int8, scale, torch.zeros(20, 8, dtype=torch.float64), 3, "silu")
    with pytest.raises(RuntimeError, match="b_down must be"):
        block(x, w_int8, scale, torch.zeros(20, 8), 3, "silu", torch.zeros(7))
    with pytest.raises(RuntimeError, match="k must be"):
        block(x, w_int8, scale, torch.zeros(20, 8), 0, "silu")


def test_build_failure_warns_once_and_the_backend_keeps_aten(monkeypatch):
    """No C++ compiler: load_ops() is False with one warning naming why; the lowering falls back."""
    from dejavu_compile.compiler.passes.lowering import cpu_lowering as _cpu_lowering

    monkeypatch.setitem(native._OPS, "loaded", False)
    monkeypatch.setitem(native._OPS, "error", None)
    monkeypatch.setattr(native, "_compiler", lambda *a, **k: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert not native.load_ops()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.load_ops()
    weight = torch.zeros(4, 4)
    assert _cpu_lowering({"cpu_lowering": "auto", "inner": "inductor"}, weight) == "decomposed"
    assert _cpu_lowering({"cpu_lowering": "auto", "inner": "eager"}, weight) == "op"
