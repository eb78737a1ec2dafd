"""The output head's int8 screen: dejavu::cpu_screened_linear against its two parts (the int8 GEMV's
estimates and cpu_linear's exact outputs), the head_screen pass in whole decode graphs (equal to the
masked simulation, exact on its candidates, dense where it cannot run), and the plan setting."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.compiler.explain import matched_blocks
from dejavu_compile.compiler.passes.head_screen import output_head
from dejavu_compile.compiler.passes.runner import dejavu_op_nodes
from dejavu_compile.kernels import int8_linear
from dejavu_compile.kernels.cpu import native
from dejavu_compile.kernels.int8 import quantize_rows_int8
from dejavu_compile.plan.sparsity_plan import (
    HEAD_CANDIDATES,
    HEAD_MIN_ROWS,
    PlanEntry,
    SparsityPlan,
    default_head_candidates,
    model_fingerprint,
)
from dejavu_compile.testing.tiny import tiny_model

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")
VOCAB = HEAD_MIN_ROWS  # the smallest head calibrate() screens by default


def _screen_problem(seed, lead, d, n, bias):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, generator=g) / d ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    q, scale = quantize_rows_int8(w)
    return torch.randn(*lead, d, generator=g), w, b, q, scale


@settings(max_examples=120, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (1, 1), (2, 1), (8, 1)]), d=st.integers(1, 140), n=st.integers(1, 300),
       share=st.floats(0.0, 1.0), bias=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_cpu_screened_linear_is_exact_on_the_top_k_of_its_estimates(lead, d, n, share, bias, threads, seed, dtype):
    """Every output is the int8 estimate (dejavu::int8_linear of x's fp32 values, plus the bias, in
    fp32, rounded once to x's dtype) except the k highest estimates of each row, which are exactly
    cpu_linear's outputs (the same dot product, bit for bit), in fp32, bf16 and fp16. The op
    allocates its output in C++; comparing every element catches any left unwritten."""
    x, w, b, q, scale = _screen_problem(seed, lead, d, n, bias)
    x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
    k = max(1, round(share * n))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_screened_linear(x, w, q, scale, k, b)
        exact = torch.ops.dejavu.cpu_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    estimate = int8_linear(x.reshape(-1, d).float(), q, scale).reshape(out.shape)
    if b is not None:
        estimate = estimate + b.float()
    assert out.shape == (*lead, n) and out.dtype == dtype
    threshold = estimate.topk(k, dim=-1).values[..., -1:]  # each row's k-th highest estimate
    above, below = estimate > threshold, estimate < threshold
    estimate = estimate.to(dtype)
    assert torch.equal(out[above], exact[above])
    assert torch.equal(out[below], estimate[below])
    tied = ~(above | below)  # the k-th estimate itself (and its ties): either value
    assert ((out[tied] == exact[tied]) | (out[tied] == estimate[tied])).all()
    taken = (out == exact) & (exact != estimate)
    assert (taken.sum(-1) <= k).all()


def test_cpu_screened_linear_nan_input_and_bad_input():
    x, w, b, q, scale = _screen_problem(0, (2,), 16, 40, True)
    x[1, 3] = float("nan")
    out = torch.ops.dejavu.cpu_screened_linear(x, w, q, scale, 5, b)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()  # as the dense product: all NaN
    bad = {
        "k must be in": (x, w, q, scale, 0, b),
        "k must be in ": (x, w, q, scale, 41, b),
        "w_int8 must be": (x, w, q.float(), scale, 5, b),
        "w_int8 must be ": (x, w, q[:30], scale, 5, b),
        "scale must be": (x, w, q, scale[:30], 5, b),
        "x must be float32": (x.double(), w, q, scale, 5, b),
        "b must be": (x, w, q, scale, 5, b[:30]),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=message.strip()):
            torch.ops.dejavu.cpu_screened_linear(*args)


def test_cpu_screened_linear_opcheck():
    x, w, b, q, scale = _screen_problem(1, (2, 1), 32, 64, False)
    torch.library.opcheck(torch.ops.dejavu.cpu_screened_linear.default, (x, w, q, scale, 8, b))


def _decode(model, options, tokens=1):
    """Logits of one forward through the backend (inner eager), eager's, and the report."""
    reports = []
    ids = torch.randint(3, 100, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="dejavu", options={"inner": "eager", "on_report": reports.append,
                                                                  **options})
        actual = compiled(ids, use_cache=False).logits
    torch._dynamo.reset()
    (report,) = reports
    return actual, expected, report


def _head_plan(model, k=16):
    """Every block dense: the head is all the plan changes."""
    entries = {}
    for b in matched_blocks(model):
        total = b.intermediate_size if b.kind == "mlp" else b.num_heads
        entries[(b.layer, b.kind)] = PlanEntry(b.layer, b.kind, total, total)
    plan = SparsityPlan(entries, model_fingerprint(model), {"method": "dense"})
    plan.head_candidates = k
    return plan


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("llama", torch.bfloat16)],
                         ids=["llama", "gpt2", "llama-bf16"])
def test_decode_head_equals_the_simulation_and_is_exact_on_its_candidates(arch, dtype):
    """The screened decode step's logits equal the masked simulation's (the same int8 estimates, the
    same exact candidates), its top logits are eager's, and the rest moved by the int8 rounding only.
    GPT-2's head is tied to its embedding. In bf16 the simulation's and eager's projections round
    differently from the GEMV kernels (aten in bf16 against fp32 sums rounded once), so the
    comparisons allow bf16's rounding over two layers (2e-2 of the largest logit)."""
    model = tiny_model(arch, layers=2, vocab=VOCAB).to(dtype).eval()
    plan = _head_plan(model)
    actual, expected, report = _decode(model, {"plan": plan})
    simulated, _, sim_report = _decode(model, {"plan": plan, "simulate": True})
    assert report.pass_counts["head_screen"] == 1 and actual.dtype == dtype
    assert torch.ops.dejavu.cpu_screened_linear.default in [n.target for n in dejavu_op_nodes(report.graph)]
    assert any(line.startswith("output head") for line in report.rewritten)
    assert any(line.startswith("output head") for line in sim_report.rewritten)
    scale = expected.abs().max()
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (0.0, 2e-2 * float(scale))
    torch.testing.assert_close(actual, simulated, rtol=rtol, atol=atol)
    top = expected.topk(8, dim=-1).indices  # well inside the 16 candidates
    torch.testing.assert_close(actual.gather(-1, top), expected.gather(-1, top), rtol=rtol, atol=atol)
    assert bool((actual.argmax(-1, keepdim=True) == expected.topk(3, dim=-1).indices).any(-1).all())
    if dtype == torch.float32:
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    moved = (actual - expected).abs().max()
    assert 0 < moved < 0.05 * scale  # the other logits are estimates: different, and close


def test_head_stays_dense_in_prefill_in_float64_and_without_the_setting():
    model = tiny_model("llama", layers=1, vocab=VOCAB).eval()
    _, _, report = _decode(model, {"plan": _head_plan(model)}, tokens=4)  # prefill: decode_shape stops first
    assert "head_screen" not in report.pass_counts
    _, _, report = _decode(model, {"plan": _head_plan(model, 0)})
    assert report.pass_counts["head_screen"] == 0
    _, _, report = _decode(model, {"plan": _head_plan(model, VOCAB)})  # covers every row: nothing to screen
    assert report.pass_counts["head_screen"] == 0
    assert any("covers all" in reason for _, reason in report.match.fallbacks)
    wide = tiny_model("llama", layers=1, vocab=VOCAB).to(torch.float64).eval()  # a dtype the kernels lack
    _, _, report = _decode(wide, {"plan": _head_plan(wide)})
    assert report.pass_counts["head_screen"] == 0
    assert any(where.startswith("output head") and "torch.float64 (the kernels take" in reason
               for where, reason in report.match.fallbacks)


def test_output_head_is_the_projection_onto_the_vocabulary():
    model = tiny_model("llama", layers=1, vocab=VOCAB).eval()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(torch.tensor([[3, 4]]))
        torch._dynamo.reset()
    head = output_head(graphs[0])
    assert head is not None and head.weight_name.endswith("lm_head.weight") and head.out_features == VOCAB


def test_training_free_plan_screens_a_real_vocabulary_only():
    """Option mlp_density: calibrate()'s default head screen, on a head of HEAD_MIN_ROWS rows; a tiny
    vocabulary stays dense."""
    for vocab, screened in ((VOCAB, 1), (128, 0)):
        model = tiny_model("llama", layers=1, vocab=vocab).eval()
        _, _, report = _decode(model, {"mlp_density": 0.5})
        assert report.pass_counts["head_screen"] == screened
        assert report.plan.head_candidates == (HEAD_CANDIDATES if screened else 0)


def test_plan_setting_round_trips_and_is_validated(tmp_path):
    model = tiny_model("llama", layers=1).eval()
    plan = _head_plan(model, 32)
    assert "output head screened (top 32 exact)" in plan.summary()
    loaded = SparsityPlan.load(plan.save(tmp_path / "plan"), model)
    assert loaded.head_candidates == 32
    assert SparsityPlan.dense(model).head_candidates == 0
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="head_candidates"):
            plan.head_candidates = bad
    import json

    meta = json.loads((tmp_path / "plan" / "plan.json").read_text())
    meta["settings"]["head_candidates"] = -3
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="corrupt.*head_candidates"):
        SparsityPlan.load(tmp_path / "plan")
    assert default_head_candidates(None) == 0 and default_head_candidates(HEAD_MIN_ROWS - 1) == 0
    assert default_head_candidates(49152) == HEAD_CANDIDATES
