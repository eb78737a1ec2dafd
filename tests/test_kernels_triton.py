"""Triton kernels under the interpreter (TRITON_INTERPRET=1) on CPU tensors, small shapes.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when
``dejavu_compile.kernels.triton.mlp`` is first imported in the process. So the variable is set here,
before that import; nothing else imports the module on a CPU-only run (the ops import it lazily on
their CUDA path). If it was imported earlier without the variable, the launchers raise and these
tests are skipped with the reason. On a GPU machine the same tests run the compiled kernels on CUDA.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from dejavu_compile.kernels import ACTIVATIONS, prepare_gated_mlp_weights
from dejavu_compile.kernels.triton import mlp as triton_mlp
from tests.kernel_reference import assert_close, mlp_cases, mlp_problem, mlp_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = triton_mlp.interpreted()
pytestmark = pytest.mark.skipif(not CUDA and not INTERPRETED,
                                reason="kernels.triton.mlp was imported before TRITON_INTERPRET=1 was set")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # kernels compute in fp32, so bf16 is right interpreted too
torch.set_num_threads(1)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_interpret_flag_took_effect():
    assert CUDA or INTERPRETED


def _to(p):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


@settings(max_examples=60, **SETTINGS)
@given(case=mlp_cases(max_d=150, max_n=300), dtype=st.sampled_from(DTYPES),
       activation=st.sampled_from(ACTIVATIONS), stacked=st.booleans())
def test_sparse_gated_mlp_triton(case, dtype, activation, stacked, poison):
    p = mlp_problem(dtype=dtype, gated=True, **case)
    ref, bound = mlp_reference(p, activation, gated=True)
    p = _to(p)
    wg, wu = p["w_gate"], p["w_up"]
    if stacked:  # row stride 2d: the kernel reads the views in place
        prep = prepare_gated_mlp_weights(wg, wu, p["w_down_t"].t())
        wg, wu = prep["w_gate"], prep["w_up"]
    out = torch.full((p["x"].shape[0], p["w_down_t"].shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    triton_mlp.sparse_gated_mlp_triton(p["x"], wg, wu, p["w_down_t"], p["idx"], activation,
                                       p["b_gate"], p["b_up"], p["b_down"], out=out)
    assert_close(out, ref, bound, dtype, "triton gated")


@settings(max_examples=40, **SETTINGS)
@given(case=mlp_cases(max_d=150, max_n=300), dtype=st.sampled_from(DTYPES),
       activation=st.sampled_from(ACTIVATIONS))
def test_sparse_mlp_triton(case, dtype, activation, poison):
    p = mlp_problem(dtype=dtype, gated=False, **case)
    ref, bound = mlp_reference(p, activation, gated=False)
    p = _to(p)
    out = triton_mlp.sparse_mlp_triton(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"],
                                       p["idx"], activation)
    assert_close(out, ref, bound, dtype, "triton plain")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_table_activation_triton(activation, poison):
    """Each activation of the table on a fixed problem, gated and plain (the property tests above
    draw activations at random; this makes each one certain)."""
    for gated in (True, False):
        p = mlp_problem(seed=11, batch=3, d=37, n=64, k=40, dtype=torch.float32, gated=gated, per_row=True,
                        biases=True)
        ref, bound = mlp_reference(p, activation, gated=gated)
        p = _to(p)
        if gated:
            out = triton_mlp.sparse_gated_mlp_triton(p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"],
                                                     activation, p["b_gate"], p["b_up"], p["b_down"])
        else:
            out = triton_mlp.sparse_mlp_triton(p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"],
                                               activation)
        assert_close(out, ref, bound, torch.float32, f"triton {activation}")


def test_activation_without_a_case_fails_to_compile():
    """A code _act has no branch for stops the kernel's compile (tl.static_assert), not a silent
    identity."""
    x, w = torch.randn(1, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    rows = torch.tensor([[1, 2]], device=DEVICE)
    with mock.patch.dict(triton_mlp.activations.ACTIVATIONS, unknown=mock.Mock(code=99)), \
            pytest.raises(Exception, match="without a case"):
        triton_mlp.gather_gemv(x, w, None, None, None, rows, "unknown")


def test_triton_rejects_bad_idx_before_launch():
    x, w = torch.randn(1, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    with pytest.raises(ValueError, match="idx"):
        triton_mlp.sparse_gated_mlp_triton(x, w, w, w, torch.tensor([3, 12], device=DEVICE), "silu")


def test_autotune_wrappers_build():
    """The CUDA launch path wraps the kernels in triton.autotune; building it needs no GPU."""
    for name in ("gemv", "rows_sum"):
        tuned = triton_mlp._autotuned(name)
        assert len(tuned.configs) >= 4
