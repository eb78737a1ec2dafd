"""dejavu::int8_linear: the int8 predictor's GEMV (the C kernel on CPU fp32, FBGEMM without a compiler,
dequantized matmul elsewhere)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.kernels import int8_linear
from dejavu_compile.kernels.cpu import native
from tests.kernel_reference import int8_rows


def _problem(seed, batch, d, n):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = torch.randn(batch, d, generator=g, dtype=torch.float64)
    rows, scales = int8_rows(w[: n // 2].float(), w[n // 2:].float())
    return x, rows, scales, x @ w.T


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 8), d=st.integers(8, 200), half=st.integers(1, 150),
       use_native=st.booleans())
def test_close_to_the_float64_product(seed, batch, d, half, use_native):
    x, q, scale, ref = _problem(seed, batch, d, 2 * half)
    with mock.patch.dict(native._STATE, enabled=use_native and native._STATE["enabled"]):
        out = int8_linear(x.float(), q, scale)
    assert out.shape == ref.shape and out.dtype == torch.float32
    # int8 weights (per-row) and, on FBGEMM, 7-bit dynamic activations: a few % of the row norm bound
    bound = x.abs().max(1, keepdim=True).values * (q.float().abs() * scale[:, None]).sum(1)[None].double()
    err = (out.double() - ref).abs()
    assert bool((err <= 0.03 * bound + 1e-4).all()), float((err / bound).max())


@pytest.mark.skipif(not native.available(), reason="C kernel unavailable")
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 8), d=st.integers(1, 300), n=st.integers(1, 150))
def test_c_kernel_is_the_dequantized_product(seed, batch, d, n):
    """The C path quantizes only x, to int16 per row: within ~1e-4 of the dequantized weights' product
    (every d and n, including the kernel's vector and row-quad tails)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d, generator=g)
    q = torch.randint(-127, 128, (n, d), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    out = int8_linear(x, q, scale)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    bound = x.abs().max(1, keepdim=True).values.double() * (q.double().abs() * scale.double()[:, None]).sum(1)[None]
    assert bool(((out.double() - ref).abs() <= 2e-4 * bound + 1e-6).all())


def test_fallback_dtype_is_the_exact_dequantized_product():
    x, q, scale, _ = _problem(1, 3, 40, 64)
    out = int8_linear(x, q, scale.double())  # float64: no FBGEMM, the plain product
    torch.testing.assert_close(out, (x @ q.double().T) * scale.double())


def test_opcheck_and_compile():
    x, q, scale, _ = _problem(2, 2, 32, 48)
    torch.library.opcheck(int8_linear, (x.float(), q, scale))
    compiled = torch.compile(lambda a: int8_linear(a, q, scale).abs() + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x.float()), int8_linear(x.float(), q, scale).abs() + 1)


def test_bad_input_is_a_clear_error():
    x, q, scale, _ = _problem(3, 1, 16, 32)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x.float(), q.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        int8_linear(x.float(), q, scale[:-1])
