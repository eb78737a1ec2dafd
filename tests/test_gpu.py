"""CUDA only (skipped without a GPU): the ops through torch.library dispatch on CUDA tensors, their
autotuned Triton launch configs, opcheck and Inductor on CUDA, and the backend end to end on a CUDA
model, with and without CUDA graphs (mode="reduce-overhead")."""
from __future__ import annotations

import functools

import pytest
import torch

from dejavu_compile import dejavu_backend
from dejavu_compile.kernels import prepare_gated_mlp_weights, sparse_gated_mlp
from dejavu_compile.testing import describe_difference, greedy_generate
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import AlwaysSparseEntry, sparse_plan, token_ids
from tests.kernel_reference import OPS, assert_close, mlp_problem, mlp_reference
from tests.references import masked_heads_reference_llama, masked_reference_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(args, kwargs):
    def move(v):
        return v.cuda() if isinstance(v, torch.Tensor) else v

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_cuda(name):
    op, samples = OPS[name]
    for args, kwargs in samples():
        torch.library.opcheck(op, *_cuda(args, kwargs))


@pytest.mark.parametrize("name", OPS)
def test_inductor_on_cuda_matches_eager(name):
    op, samples = OPS[name]
    compiled = torch.compile(lambda a, kw: op(*a, **kw) * 2 + 1, fullgraph=True, backend="inductor")
    for args, kwargs in samples():
        args, kwargs = _cuda(args, kwargs)
        torch.testing.assert_close(compiled(args, kwargs), op(*args, **kwargs) * 2 + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 576, 1536, 768), (4, 1000, 2731, 1000), (8, 4096, 11008, 551)])
def test_autotuned_gated_mlp_matches_reference(monkeypatch, shape, dtype):
    """The op on CUDA with autotuning (as the backend and the benchmark run it), layouts as prepared."""
    monkeypatch.setenv("DEJAVU_TRITON_AUTOTUNE", "1")
    batch, d, n, k = shape
    p = mlp_problem(seed=3, batch=batch, d=d, n=n, k=k, dtype=dtype, gated=True, per_row=batch > 1, biases=False)
    ref, bound = mlp_reference(p, "silu", gated=True)
    prep = prepare_gated_mlp_weights(p["w_gate"].cuda(), p["w_up"].cuda(), p["w_down_t"].cuda().t())
    out = sparse_gated_mlp(p["x"].cuda(), prep["w_gate"], prep["w_up"], prep["w_down_t"], p["idx"].cuda(), "silu")
    assert_close(out.cpu(), ref, bound, dtype, "autotuned gated")


def test_idx_range_error_on_cuda():
    p = mlp_problem(seed=4, batch=1, d=16, n=32, k=4, dtype=torch.float32, gated=True, per_row=False, biases=False)
    bad = p["idx"].clone()
    bad[0] = 32
    with pytest.raises(ValueError, match="outside"):
        sparse_gated_mlp(p["x"].cuda(), p["w_gate"].cuda(), p["w_up"].cuda(), p["w_down_t"].cuda(), bad.cuda(), "silu")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_sparse_decode_on_cuda_matches_masked_reference(mode):
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.4)
    model.cuda()
    ids = token_ids(3, 1).cuda()
    expected = masked_reference_llama(model, plan, ids)
    reports = []
    options = {"plan": plan, "strict": True, "on_report": reports.append}
    # torch.compile refuses mode together with options: hand both to the backend itself
    backend = functools.partial(dejavu_backend, mode=mode, options=options)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):  # cudagraph trees record on the second or third call
            got = compiled(ids, use_cache=False).logits
    assert any(r.rewritten for r in reports)
    assert describe_difference("logits", got, expected, rtol=1e-3, atol=1e-3) is None


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_head_sparse_decode_on_cuda_matches_masked_reference(mode):
    model = tiny_model("llama", layers=3)
    model.cuda()
    ids = token_ids(3, 1).cuda()
    only_heads = sparse_plan(model, None, attn_density=0.5)
    expected = masked_heads_reference_llama(model, only_heads, ids)
    reports = []
    backend = functools.partial(dejavu_backend, mode=mode, options={"plan": only_heads, "strict": True,
                                                                    "on_report": reports.append})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            got = compiled(ids, use_cache=False).logits
    assert any("heads" in line for r in reports for line in r.rewritten)
    assert describe_difference("logits", got, expected, rtol=1e-3, atol=1e-3) is None


def test_full_density_generate_on_cuda_is_exact():
    model = tiny_model("llama")
    plan = sparse_plan(model, 1.0, entry_cls=AlwaysSparseEntry, attn_density=1.0)
    model.cuda()
    ids = token_ids().cuda()
    for cache in ("static", "dynamic"):
        reference = greedy_generate(model, ids, 12, cache)
        tokens = greedy_generate(model, ids, 12, cache, {"plan": plan, "strict": True})
        assert describe_difference(f"tokens ({cache})", tokens, reference, 0, 0) is None
