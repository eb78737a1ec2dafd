"""Decode-step attention: dejavu::cpu_decode_attention against float64 SDPA on the same stored
values, and the decode_attention pass (which SDPA calls it takes, greedy tokens equal eager's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.compiler.passes.decode_attention import MAX_QUERY_ROWS
from dejavu_compile.compiler.passes.graph_utils import example_value
from dejavu_compile.kernels.cpu import native
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import greedy_through_backend, token_ids
from tests.kernel_reference import RTOL, rounding_to

pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def attention_cases(draw):
    """Shapes of a decode step (and a few prefill-sized ones the op hands to aten), a key/value
    cache that may be a slice of a longer one, and a mask of any broadcast shape."""
    batch, kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rows = draw(st.one_of(st.integers(1, 4), st.just(MAX_QUERY_ROWS + 1)))
    slots, dim = draw(st.integers(1, 70)), draw(st.integers(1, 80))
    full = (batch, kv_heads * group, rows, slots)
    mask_shape = tuple(draw(st.sampled_from([n, 1])) for n in full[:3]) + (slots,)
    mask_shape = mask_shape[draw(st.integers(0, 2)):]  # fewer dimensions (2 at least, as SDPA takes)
    return dict(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, rows=rows, slots=slots, dim=dim,
                spare=draw(st.sampled_from([0, 5])), mask=draw(st.sampled_from(["none", "bool", "additive"])),
                last_kept=draw(st.one_of(st.just(slots - 1), st.integers(0, slots - 1))),
                mask_shape=mask_shape, scale=draw(st.sampled_from([None, 0.3])), q_transposed=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31)))


def attention_problem(c, dtype):
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["batch"], c["heads"], c["rows"], c["dim"], generator=gen).to(dtype)
    if c["q_transposed"]:  # as attention modules hand it over: (B, L, H, D) transposed
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    # a cache with `spare` slots beyond the ones attended: k and v are strided slices of it
    cache = torch.randn(2, c["batch"], c["kv_heads"], c["slots"] + c["spare"], c["dim"], generator=gen).to(dtype)
    k, v = cache[0, :, :, :c["slots"]], cache[1, :, :, :c["slots"]]
    mask = None
    if c["mask"] != "none":
        keep = torch.rand(c["mask_shape"], generator=gen) < 0.7
        # every row attends somewhere (a fully masked row has its own test), and the slots after
        # last_kept are masked out, as a static cache's unused end is
        keep[..., c["last_kept"]] = True
        keep[..., c["last_kept"] + 1:] = False
        mask = keep if c["mask"] == "bool" else torch.zeros(c["mask_shape"]).masked_fill(~keep, float("-inf")).to(
            dtype)
    return q, k, v, mask


def reference(q, k, v, mask, scale):
    """float64 SDPA over the same stored values; grouped heads repeated."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=m64, scale=scale)


@settings(max_examples=150, deadline=None)
@given(case=attention_cases(), dtype=st.sampled_from(DTYPES), threads=st.sampled_from([1, 2, 3]))
def test_decode_attention_matches_float64(case, dtype, threads):
    """Every output is a convex combination of value rows, so fp32 sums are within fp32's tolerance
    of the largest |value|; a half-precision result adds one rounding. More query rows than the
    kernel takes go to aten's SDPA, held to the dtype's own tolerance."""
    q, k, v, mask = attention_problem(case, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_decode_attention(q, k, v, mask, case["scale"])
    finally:
        torch.set_num_threads(before)
    ref = reference(q, k, v, mask, case["scale"])
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (unwritten rows?)"
    scores = (q.double().abs().sum(-1).max() * k.double().abs().max()).item()  # bounds |q.k|
    bound = v.double().abs().max().item() * (1 + scores)
    fp32 = RTOL[torch.float32] * bound
    tol = fp32 + rounding_to(dtype, ref, fp32)
    if case["rows"] > MAX_QUERY_ROWS:  # handed to aten's SDPA, which rounds inside in half precision
        tol = RTOL[dtype] * bound
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"{dtype}: error {err.max().item():.3g} over tolerance ({case})"


def test_decode_attention_masked_rows_and_nans_match_sdpa():
    """A row with every slot masked is zero (as SDPA gives); a NaN in the query or a key is NaN in
    its rows, never hidden; masked slots are not read (a NaN there changes nothing)."""
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 4, 1, 6, dtype=torch.bool)
    mask[0, 1] = False
    mask[0, :, :, 5] = False
    k[0, :, 5], v[0, :, 5] = float("nan"), float("nan")
    out = torch.ops.dejavu.cpu_decode_attention(q, k, v, mask)
    assert torch.equal(out[0, 1], torch.zeros(1, 8))
    ref = reference(q, k[:, :, :5], v[:, :, :5], mask[..., :5], None)
    torch.testing.assert_close(out.double()[:, [0, 2, 3]], ref[:, [0, 2, 3]], rtol=1e-5, atol=1e-6)
    q[0, 2, 0, 0] = float("nan")
    out = torch.ops.dejavu.cpu_decode_attention(q, k, v, mask)
    assert out[0, 2].isnan().all() and not out[0, [0, 3]].isnan().any()


def test_decode_attention_rejects_shapes_that_do_not_fit():
    q, k = torch.randn(1, 3, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="H_kv dividing"):
        torch.ops.dejavu.cpu_decode_attention(q, k, k)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        torch.ops.dejavu.cpu_decode_attention(torch.randn(1, 2, 1, 8), k, k, torch.ones(1, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="must be"):
        torch.ops.dejavu.cpu_decode_attention(q.double(), k.double(), k.double())


def test_decode_attention_opcheck():
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.rand(2, 1, 1, 9) < 0.8
    mask[..., 0] = True
    torch.library.opcheck(torch.ops.dejavu.cpu_decode_attention.default, (q, k, v, mask, 0.25))
    torch.library.opcheck(torch.ops.dejavu.cpu_decode_attention.default, (q, k, v))


def _decode_report(model, tokens=1, options=None):
    reports = []
    ids = torch.randint(3, 100, (1, tokens), generator=torch.Generator().manual_seed(1))
    options = {"inner": "eager", **(options or {}), "on_report": reports.append}
    compiled = torch.compile(model, backend="dejavu", options=options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    (report,) = reports
    return report


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_decode_graph_attention_goes_through_the_kernel(arch):
    model = tiny_model(arch, layers=2)
    assert _decode_report(model).pass_counts["decode_attention"] == model.config.num_hidden_layers


def test_prefill_and_aten_options_keep_sdpa():
    """The op is the default for decode graphs; prefill, attention_lowering="aten" and
    dense_lowering="aten" keep SDPA."""
    model = tiny_model("llama", layers=1)
    assert _decode_report(model).pass_counts["decode_attention"] == 1
    assert _decode_report(model, tokens=MAX_QUERY_ROWS + 1).pass_counts["decode_attention"] == 0
    for options in ({"attention_lowering": "aten"}, {"dense_lowering": "aten"}):
        assert _decode_report(model, options=options).pass_counts["decode_attention"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_decode_with_the_attention_kernel_matches_eager(dtype):
    """Under Inductor's C++ wrapper, over a static cache with grouped-query heads: greedy tokens equal eager's."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=1).to(dtype)
    expected, actual, reports = greedy_through_backend(model, token_ids(tokens=5, seed=2, high=100),
                                                       options={"attention_lowering": "auto"})
    assert torch.equal(actual, expected)
    assert any(r.pass_counts.get("decode_attention", 0) == model.config.num_hidden_layers for r in reports)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_heads_read_the_cache_in_place(kv_heads):
    """repeat_kv's copies drop out: the op takes each key/value head once, the logits stay eager's."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=kv_heads)
    report = _decode_report(model)
    assert report.pass_counts["decode_attention"] == model.config.num_hidden_layers
    ops = [n for n in report.graph.graph.nodes if n.target is torch.ops.dejavu.cpu_decode_attention.default]
    assert len(ops) == model.config.num_hidden_layers
    assert all(example_value(n.args[i]).shape[1] == kv_heads for n in ops for i in (1, 2))
    assert not [n for n in report.graph.graph.nodes  # repeat_kv's (B, H, n_rep, L, D) expansions are gone
                if n.op == "call_method" and n.target == "expand" and example_value(n).dim() == 5]


class _RepeatedHeads(torch.nn.Module):
    """SDPA over keys and values repeated to the query heads, either as repeat_kv does (head h from
    head h // n_rep) or tiled (head h from head h % kv_heads), which shares repeat_kv's ops but not
    its shapes: only the first reads the cache in place, and both must match eager."""

    def __init__(self, tiled: bool):
        super().__init__()
        self.tiled = tiled

    def forward(self, q, k, v, mask):
        b, h, length, d = k.shape
        rep = q.shape[1] // h
        if self.tiled:
            k, v = (t[:, None].expand(b, rep, h, length, d).reshape(b, h * rep, length, d) for t in (k, v))
        else:
            k, v = (t[:, :, None, :, :].expand(b, h, rep, length, d).reshape(b, h * rep, length, d) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("tiled", [False, True])
def test_only_repeat_kv_is_read_in_place(tiled):
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 7, 16, generator=gen), torch.randn(
        1, 2, 7, 16, generator=gen)
    mask = torch.rand(1, 1, 1, 7, generator=gen) < 0.8
    mask[..., -1] = True
    module, reports = _RepeatedHeads(tiled), []
    compiled = torch.compile(module, backend="dejavu", options={"inner": "eager", "attention_lowering": "auto",
                                                                "on_report": reports.append})
    torch.testing.assert_close(compiled(q, k, v, mask), module(q, k, v, mask), rtol=1e-5, atol=1e-5)
    (op,) = [n for n in reports[0].graph.graph.nodes if n.target is torch.ops.dejavu.cpu_decode_attention.default]
    assert example_value(op.args[1]).shape[1] == (4 if tiled else 2)


def test_a_symbolic_cache_length_goes_through_the_kernel():
    """Once Dynamo has seen two cache lengths it compiles the slot count as a symbol (a server whose
    requests allocate caches of different sizes): the op still takes the call, under Inductor, and
    one compiled graph serves every length with eager's values."""
    module, reports = _RepeatedHeads(tiled=False), []
    compiled = torch.compile(module, backend="dejavu", options={"attention_lowering": "auto",
                                                                "on_report": reports.append})
    gen = torch.Generator().manual_seed(5)
    for slots in (7, 12, 20):
        q = torch.randn(1, 4, 1, 16, generator=gen)
        k, v = torch.randn(2, 1, 2, slots, 16, generator=gen)
        mask = torch.rand(1, 1, 1, slots, generator=gen) < 0.8
        mask[..., 0] = True
        torch.testing.assert_close(compiled(q, k, v, mask), module(q, k, v, mask), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert len(reports) == 2  # the first length's graph, then one with a symbolic slot count
    (op,) = [n for n in reports[1].graph.graph.nodes if n.target is torch.ops.dejavu.cpu_decode_attention.default]
    key = example_value(op.args[1])
    assert key.shape[1] == 2 and isinstance(key.shape[2], torch.SymInt)
