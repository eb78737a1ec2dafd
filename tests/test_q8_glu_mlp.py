"""dejavu::cpu_q8_glu_mlp, a gated MLP of int8 projections chosen and valued by its own gate and up:
the kept ids against the top k of the dense int8 block's |act(g) * u|, the output against float64 of
the dequantized weights with the other neurons masked, the down weight read from its own int8 values
and scales transposed."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile import activations
from dejavu_compile.compiler.quantize import GROUP_SIZES, dequantize_rows_grouped, quantize_rows_grouped
from dejavu_compile.kernels.cpu import native
from tests.kernel_reference import act64, assert_close, mlp_reference

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")


def _x_as_quantized(x):
    """x as the kernel reads it, in float64: each row rounded to int16 at 15 bits of its max |x|."""
    x32 = x.float()
    m = x32.abs().amax(-1, keepdim=True)
    scale = torch.where(m > 0, torch.tensor(32767.0) / m, torch.zeros_like(m))
    inv = torch.where(m > 0, 1.0 / scale, torch.zeros_like(m))
    return torch.round(x32 * scale).double() * inv.double()


def _problem(seed, batch, d, n, d_out, group, down_group, dtype, bias):
    """The op's arguments for a random block stored as quantize_weights stores it (gate, up (n, d) and
    down (d_out, n) int8 in groups along their inputs), and the dequantized float64 weights."""
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = (torch.randn(n, d, generator=g) / d ** 0.5 for _ in range(2))
    w_down = torch.randn(d_out, n, generator=g) / n ** 0.5
    (q_gate, s_gate), (q_up, s_up) = quantize_rows_grouped(w_gate, group), quantize_rows_grouped(w_up, group)
    q_down, s_down = quantize_rows_grouped(w_down, down_group)
    x = (torch.randn(batch, d, generator=g) * 2).to(dtype)
    b_down = (torch.randn(d_out, generator=g) * 0.1).to(dtype) if bias else None
    args = (x, q_gate, s_gate, q_up, s_up, q_down.t().contiguous(), s_down.t().contiguous())
    weights = dict(w_gate=dequantize_rows_grouped(q_gate, s_gate).double(),
                   w_up=dequantize_rows_grouped(q_up, s_up).double(),
                   w_down_t=dequantize_rows_grouped(q_down, s_down).double().t(), b_down=b_down)
    return args, weights


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 4), groups=st.integers(1, 3), group=st.sampled_from(GROUP_SIZES),
       n_groups=st.integers(1, 3), down_group=st.sampled_from(GROUP_SIZES), d_out_32=st.integers(1, 4),
       k_fraction=st.floats(0.0, 1.0), bias=st.booleans(), activation=st.sampled_from(activations.NAMES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_cpu_q8_glu_mlp_keeps_the_top_k_and_matches_float64(batch, groups, group, n_groups, down_group, d_out_32,
                                                            k_fraction, bias, activation, dtype, threads, seed):
    """Every group size on both sides, 1 .. n kept neurons (counts that are not a multiple of the four
    rows summed per pass, groups with no kept neuron), fp32/bf16/fp16 x, 1-3 threads. The output and
    the ids are allocated in C++: the float64 comparison of every element catches one unwritten."""
    d, n, d_out = groups * group, n_groups * down_group, 32 * d_out_32
    k = max(1, round(k_fraction * n))
    args, w = _problem(seed, batch, d, n, d_out, group, down_group, dtype, bias)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, idx = torch.ops.dejavu.cpu_q8_glu_mlp(*args, k, activation, w["b_down"])
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype and idx.shape == (batch, k)
    assert bool((idx[:, 1:] > idx[:, :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < n  # ascending, unique
    x = _x_as_quantized(args[0])
    h = (act64(x @ w["w_gate"].T, activation) * (x @ w["w_up"].T)).abs()
    kept = torch.zeros_like(h, dtype=torch.bool).scatter(1, idx, True)
    if k < n:  # the kept |h| are the largest, up to the fp32 rounding of the values they were ranked by
        slack = 1e-4 * h.amax(-1) + 1e-6
        assert bool((h.masked_fill(~kept, float("inf")).amin(-1) >= h.masked_fill(kept, 0).amax(-1) - slack).all())
    ref, bound = mlp_reference(dict(x=x, idx=idx, b_up=None, b_gate=None, **w), activation, gated=True)
    assert_close(out, ref, bound, dtype, f"{activation} k={k}/{n}")


def test_every_neuron_kept_is_the_dense_int8_block():
    """k = n: the dense int8 MLP of the same weights (cpu_q8_linear for gate and up, the dequantized
    down weight in float64)."""
    args, w = _problem(4, 2, 128, 96, 64, 64, 32, torch.float32, True)
    x, q_gate, s_gate, q_up, s_up = args[:5]
    out, idx = torch.ops.dejavu.cpu_q8_glu_mlp(*args, 96, "silu", w["b_down"])
    assert torch.equal(idx, torch.arange(96).expand(2, 96))
    h = torch.nn.functional.silu(torch.ops.dejavu.cpu_q8_linear(x, q_gate, s_gate, None)) * \
        torch.ops.dejavu.cpu_q8_linear(x, q_up, s_up, None)
    expected = h.double() @ w["w_down_t"] + w["b_down"].double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_cpu_q8_glu_mlp_opcheck_bad_input_and_nan_rows():
    args, w = _problem(3, 2, 64, 64, 64, 32, 32, torch.float32, True)
    op = torch.ops.dejavu.cpu_q8_glu_mlp
    torch.library.opcheck(op.default, (*args, 9, "silu"), {"b_down": w["b_down"]})
    x, q_gate, s_gate, q_up, s_up, q_down_t, s_down_t = args
    with pytest.raises(RuntimeError, match="q must be contiguous int8"):
        op(x, q_gate.float(), s_gate, q_up, s_up, q_down_t, s_down_t, 9, "silu")
    with pytest.raises(RuntimeError, match="up must have gate's shape"):
        op(x, q_gate, s_gate, q_up[:32].contiguous(), s_up[:32].contiguous(), q_down_t, s_down_t, 9, "silu")
    with pytest.raises(RuntimeError, match="q_down_t must be contiguous int8"):
        op(x, q_gate, s_gate, q_up, s_up, q_down_t[:32].contiguous(), s_down_t, 9, "silu")
    with pytest.raises(RuntimeError, match="s_down_t must be contiguous float32"):
        op(x, q_gate, s_gate, q_up, s_up, q_down_t, s_down_t[:, :32].contiguous(), 9, "silu")
    with pytest.raises(RuntimeError, match="k must be in"):
        op(x, q_gate, s_gate, q_up, s_up, q_down_t, s_down_t, 65, "silu")
    with pytest.raises(RuntimeError, match="activation must be one of"):
        op(x, q_gate, s_gate, q_up, s_up, q_down_t, s_down_t, 9, "tanh")
    x = x.clone()
    x[1, 3] = float("nan")
    out, _ = op(x, q_gate, s_gate, q_up, s_up, q_down_t, s_down_t, 9, "silu")
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
