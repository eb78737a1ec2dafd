"""dejavu::cpu_q8_sparse_mlp, the neuron-sparse MLP over int8 weights with per-group scales
(quantize_weights' format): against float64 of the dequantized weights with the unselected neurons
masked, and the kept neurons' values against the dense int8 projections (cpu_q8_linear), to the bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile import activations
from dejavu_compile.compiler.quantize import GROUP_SIZES, quantize_rows_grouped
from dejavu_compile.kernels.cpu import native
from tests.kernel_reference import assert_close, mlp_problem, mlp_reference

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")


def _dequantized(q, scales):
    group = q.shape[1] // scales.shape[1]
    return (q.double().reshape(q.shape[0], -1, group) * scales.double()[..., None]).reshape(q.shape)


def _x_as_quantized(x):
    """x as the kernel reads it, in float64: each row rounded to int16 at 15 bits of its max |x|
    (quantize_x_bits: the scale and the rounding in fp32, half to even)."""
    x32 = x.float()
    m = x32.abs().amax(-1, keepdim=True)
    scale = torch.where(m > 0, torch.tensor(32767.0) / m, torch.zeros_like(m))
    inv = torch.where(m > 0, 1.0 / scale, torch.zeros_like(m))
    return torch.round(x32 * scale).double() * inv.double()


def _q8_mlp(seed, batch, groups, group, n, k, groups_out, down_group, dtype, gated, per_row, biases):
    """A random MLP problem quantized as quantize_weights stores it (the down weight transposed,
    (n, d_out), grouped along d_out): the op's arguments, and the float64 problem its result must
    match (the dequantized weights, x as the kernel rounds it)."""
    d, d_out = groups * group, groups_out * down_group
    p = mlp_problem(seed, batch, d, n, k, torch.float64, gated, per_row, biases, d_out=d_out)
    q_up, s_up = quantize_rows_grouped(p["w_up"], group)
    q_down, s_down = quantize_rows_grouped(p["w_down_t"], down_group)
    q_gate, s_gate = quantize_rows_grouped(p["w_gate"], group) if gated else (None, None)
    x = p["x"].to(dtype)
    bias = {key: None if p[key] is None else p[key].to(dtype) for key in ("b_gate", "b_up", "b_down") if key in p}
    if gated:
        args = (x, q_gate, s_gate, q_up, s_up, q_down, s_down, p["idx"])
        kwargs = dict(b_a=bias["b_gate"], b_b=bias["b_up"], b_down=bias["b_down"])
    else:
        args = (x, q_up, s_up, None, None, q_down, s_down, p["idx"])
        kwargs = dict(b_a=bias["b_up"], b_down=bias["b_down"])
    reference = dict(x=_x_as_quantized(x), w_up=_dequantized(q_up, s_up), w_down_t=_dequantized(q_down, s_down),
                     idx=p["idx"], **{key: None if b is None else b.double() for key, b in bias.items()})
    if gated:
        reference["w_gate"] = _dequantized(q_gate, s_gate)
    return args, kwargs, reference


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 5), groups=st.integers(1, 3), group=st.sampled_from(GROUP_SIZES),
       n=st.integers(1, 60), k_fraction=st.floats(0.0, 1.0), groups_out=st.integers(1, 3),
       down_group=st.sampled_from(GROUP_SIZES), gated=st.booleans(), per_row=st.booleans(), biases=st.booleans(),
       activation=st.sampled_from(activations.NAMES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_cpu_q8_sparse_mlp_matches_float64_of_its_weights(batch, groups, group, n, k_fraction, groups_out, down_group,
                                                          gated, per_row, biases, activation, dtype, threads, seed):
    """Shared and per-row ids, 1 .. n kept neurons (a count that is not a multiple of the four rows
    summed per pass included), every group size on both sides, gated and plain, biases, fp32/bf16/fp16
    x, 1-3 threads. The output is allocated in C++: comparing every element catches one unwritten."""
    k = max(1, round(k_fraction * n))
    args, kwargs, reference = _q8_mlp(seed, batch, groups, group, n, k, groups_out, down_group, dtype, gated,
                                      per_row, biases)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_q8_sparse_mlp(*args, activation, **kwargs)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype
    ref, bound = mlp_reference(reference, activation, gated)
    assert_close(out, ref, bound, dtype, f"{'gated' if gated else 'plain'} {activation} k={k}")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), group=st.sampled_from(GROUP_SIZES), down_group=st.sampled_from(GROUP_SIZES),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_kept_neuron_values_are_the_dense_int8_projections_to_the_bit(n, group, down_group, threads, seed):
    """One kept neuron: the op's output is relu(g) * u times its dequantized down row, with g and u
    exactly what cpu_q8_linear gives for the gate and up projections (the same int8 arithmetic; relu
    is exact, so every bit must agree)."""
    args, _, _ = _q8_mlp(seed, 3, 2, group, n, 1, 2, down_group, torch.float32, True, True, False)
    x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx = args
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_q8_sparse_mlp(x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx, "relu")
        g = torch.ops.dejavu.cpu_q8_linear(x, q_gate, s_gate, None)
        u = torch.ops.dejavu.cpu_q8_linear(x, q_up, s_up, None)
    finally:
        torch.set_num_threads(before)
    rows = idx[:, 0]
    h = (torch.relu(g) * u).gather(1, idx)  # (3, 1)
    coefficient = h[:, :, None] * s_down[rows][:, :, None]  # (3, groups_out, 1): h times each group's scale
    expected = (coefficient * q_down[rows].float().reshape(3, s_down.shape[1], -1)).reshape(3, -1)
    assert torch.equal(out, expected)


def test_cpu_q8_sparse_mlp_opcheck_bad_input_and_nan_rows():
    args, kwargs, _ = _q8_mlp(3, 2, 2, 32, 24, 7, 1, 64, torch.float32, True, False, True)
    op = torch.ops.dejavu.cpu_q8_sparse_mlp
    torch.library.opcheck(op.default, (*args, "silu"), kwargs)
    x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx = args
    with pytest.raises(RuntimeError, match="q must be contiguous int8"):
        op(x, q_gate.float(), s_gate, q_up, s_up, q_down, s_down, idx, "silu")
    with pytest.raises(RuntimeError, match="up must have gate's shape"):
        op(x, q_gate, s_gate, q_up[:5].contiguous(), s_up[:5].contiguous(), q_down, s_down, idx, "silu")
    with pytest.raises(RuntimeError, match="q_b and s_b go together"):
        op(x, q_gate, s_gate, q_up, None, q_down, s_down, idx, "silu")
    with pytest.raises(RuntimeError, match="q_down_t must have 24 rows"):
        op(x, q_gate, s_gate, q_up, s_up, q_down[:3].contiguous(), s_down[:3].contiguous(), idx, "silu")
    with pytest.raises(RuntimeError, match="out of range"):
        op(x, q_gate, s_gate, q_up, s_up, q_down, s_down, torch.tensor([0, 24]), "silu")
    with pytest.raises(RuntimeError, match="activation must be one of"):
        op(x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx, "tanh")
    with pytest.raises(RuntimeError, match=r"x \(batch, 64\) expected"):
        op(torch.randn(2, 32), q_gate, s_gate, q_up, s_up, q_down, s_down, idx, "silu")
    x = x.clone()
    x[1, 3] = float("nan")
    out = op(x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx, "silu")
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_sparse_output_equals_the_dense_int8_mlp_when_every_neuron_is_kept():
    """All n neurons kept: the dense int8 MLP (cpu_q8_linear for gate and up, the transposed int8
    down rows summed in float64), the kept neurons' values being exact."""
    args, _, _ = _q8_mlp(5, 2, 3, 64, 50, 50, 2, 32, torch.float32, True, False, False)
    x, q_gate, s_gate, q_up, s_up, q_down, s_down, idx = args
    out = torch.ops.dejavu.cpu_q8_sparse_mlp(x, q_gate, s_gate, q_up, s_up, q_down, s_down, torch.arange(50), "silu")
    h = F.silu(torch.ops.dejavu.cpu_q8_linear(x, q_gate, s_gate, None)) * torch.ops.dejavu.cpu_q8_linear(
        x, q_up, s_up, None)
    expected = h.double() @ _dequantized(q_down, s_down)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
