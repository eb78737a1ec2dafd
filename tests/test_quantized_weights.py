"""int8 weights with per-group scales: the grouping (quantize_rows_grouped), the C++ op
dejavu::cpu_q8_linear against float64 of the dequantized weight, and quantize_weights on whole
models (memory, logits against the float64 dequantized model, compiled decode against eager)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.compiler.quantize import (
    GROUP_SIZES,
    Int8Embedding,
    Int8Linear,
    dequantize_rows_grouped,
    quantize_rows_grouped,
    quantize_weights,
)
from dejavu_compile.kernels.cpu import native
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import token_ids
from tests.kernel_reference import rounding_to

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")
EPS32 = torch.finfo(torch.float32).eps


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 5), group=st.sampled_from(GROUP_SIZES), seed=st.integers(0, 2**16),
       zero_group=st.booleans())
def test_grouped_rows_decode_within_half_a_step(n, groups, group, seed, zero_group):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, groups * group, generator=g) * torch.rand(n, 1, generator=g) * 3
    if zero_group:
        w[0, :group] = 0
    q, scales = quantize_rows_grouped(w, group)
    assert q.dtype == torch.int8 and scales.shape == (n, groups) and int(q.abs().max()) <= 127
    # decoded in float64, so the only rounding beyond half a step is fp32's in w / scale (|w / scale| <= 127)
    decoded = (q.double().reshape(n, groups, group) * scales.double()[..., None]).reshape(n, -1)
    step = scales.double().repeat_interleave(group, dim=1)
    assert bool(((decoded - w.double()).abs() <= step * (0.5 + 128 * EPS32) + 1e-30).all())
    assert bool((q.reshape(n, groups, group).abs().amax(-1)[scales > 0] == 127).all())  # each group's range used
    if zero_group:
        assert scales[0, 0] == 0 and not q[0, :group].any()


def _q8_problem(seed, lead, d, n, bias, dtype, group):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, generator=g) / d ** 0.5
    q, scales = quantize_rows_grouped(w, group)
    x = torch.randn(*lead, d, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, q, scales, b


def _q8_reference(x, q, scales, b, dtype):
    """float64 x @ dequantized(q).T + b, and the op's error bound: x's int16 rounding (half a step
    of max|x| / 32767 per element, times each row's |w|), fp32 sums, and one rounding to dtype."""
    group = q.shape[1] // scales.shape[1]
    w = (q.double().reshape(q.shape[0], -1, group) * scales.double()[..., None]).reshape(q.shape)
    x64 = x.double()
    ref = F.linear(x64, w, None if b is None else b.double())
    magnitude = F.linear(x64.abs(), w.abs(), None if b is None else b.double().abs())
    x_step = x64.abs().amax(-1, keepdim=True) / 32767 / 2
    bound = x_step * w.abs().sum(1) + 2 * (x.shape[-1] + 4) * EPS32 * magnitude
    return ref, bound + rounding_to(dtype, ref, bound) + 1e-30


@settings(max_examples=80, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (1, 1), (2, 5), (40,)]), groups=st.integers(1, 6),
       group=st.sampled_from(GROUP_SIZES), n=st.integers(1, 90), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), threads=st.sampled_from([1, 2, 3]),
       prefetch=st.sampled_from(native.INT8_PREFETCH_CHOICES + (1,)), seed=st.integers(0, 2**16))
def test_cpu_q8_linear_matches_float64_of_its_weight(lead, groups, group, n, bias, dtype, threads, prefetch, seed):
    """Decode and prefill row counts, every group size, widths of 1-6 groups, fp32/bf16/fp16 x, 1-3
    threads, each prefetch distance the machine tuning may pick (rows ahead, up to past the last).
    The op allocates its output in C++: comparing every element catches one left unwritten."""
    x, q, scales, b = _q8_problem(seed, lead, groups * group, n, bias, dtype, group)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    native.apply_tuning(int8_prefetch_rows=prefetch)
    try:
        out = torch.ops.dejavu.cpu_q8_linear(x, q, scales, b)
    finally:
        torch.set_num_threads(before)
        native.apply_tuning()
    ref, bound = _q8_reference(x, q, scales, b, dtype)
    assert out.shape == (*lead, n) and out.dtype == dtype
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3e} (ratio {(err / bound).max().item():.3g})"


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (1, 1), (40,)]), groups=st.integers(1, 4), group=st.sampled_from(GROUP_SIZES),
       ns=st.lists(st.integers(1, 70), min_size=1, max_size=4), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_cpu_q8_linear_cat_is_each_projection_concatenated(lead, groups, group, ns, bias, dtype, threads, seed):
    """Sibling int8 projections in one call (decode rows, and a prefill's 40 rows through the per-weight
    path): within the float64 bound of the concatenated weight, and bit for bit the separate
    cpu_q8_linear calls' outputs side by side, parts whose rows straddle the threads' shares included."""
    d = groups * group
    problems = [_q8_problem(seed + i, lead, d, n, bias, dtype, group) for i, n in enumerate(ns)]
    x = problems[0][0]
    qs, scales = [p[1] for p in problems], [p[2] for p in problems]
    b = torch.cat([p[3] for p in problems]) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.dejavu.cpu_q8_linear_cat(x, qs, scales, b)
        separate = torch.cat([torch.ops.dejavu.cpu_q8_linear(x, q, s, p[3])
                              for q, s, p in zip(qs, scales, problems)], -1)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (*lead, sum(ns)) and out.dtype == dtype
    assert torch.equal(out, separate)
    ref, bound = _q8_reference(x, torch.cat(qs), torch.cat(scales), b, dtype)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3e} (ratio {(err / bound).max().item():.3g})"


def test_cpu_q8_linear_cat_bad_input_and_opcheck():
    x, q, scales, b = _q8_problem(0, (2,), 64, 8, True, torch.float32, 32)
    _, q2, scales2, b2 = _q8_problem(1, (2,), 64, 5, True, torch.float32, 32)
    op = torch.ops.dejavu.cpu_q8_linear_cat
    torch.library.opcheck(op.default, (x, [q, q2], [scales, scales2], torch.cat([b, b2])))
    with pytest.raises(RuntimeError, match="as many scales as weights"):
        op(x, [q, q2], [scales], None)
    _, q64, scales64, _ = _q8_problem(2, (2,), 64, 4, False, torch.float32, 64)
    with pytest.raises(RuntimeError, match="one width and group size"):
        op(x, [q, q64], [scales, scales64], None)
    with pytest.raises(RuntimeError, match=r"b must be \(13\)"):
        op(x, [q, q2], [scales, scales2], b)


def test_apply_tuning_sets_both_libraries_and_restores_the_machine_tuning():
    """The C kernels and the C++ ops each hold the settings: an override reaches both and changes no
    value (a prefetch distance only moves reads earlier); no arguments restore the machine's tuning."""
    native.load_ops()
    lib = native._load()
    x, q, scales, _ = _q8_problem(1, (1,), 256, 300, False, torch.float32, 32)
    tuned = native.tuning()
    expected = torch.ops.dejavu.cpu_q8_linear(x, q, scales, None)
    other = 0 if tuned["int8_prefetch_rows"] else 8
    native.apply_tuning(int8_prefetch_rows=other)
    try:
        for held in (native.held_tuning(lib), native.held_tuning(native._OPS["lib"])):
            assert held == {**tuned, "int8_prefetch_rows": other}
        assert torch.equal(torch.ops.dejavu.cpu_q8_linear(x, q, scales, None), expected)
    finally:
        native.apply_tuning()
    assert native.held_tuning(lib) == native.held_tuning(native._OPS["lib"]) == tuned
    with pytest.raises(ValueError, match="unknown kernel settings"):
        native.apply_tuning(int8_prefetch=4)


def test_cpu_q8_linear_bad_input_and_opcheck():
    x, q, scales, b = _q8_problem(0, (2,), 64, 8, True, torch.float32, 32)
    torch.library.opcheck(torch.ops.dejavu.cpu_q8_linear.default, (x, q, scales, b))
    op = torch.ops.dejavu.cpu_q8_linear
    with pytest.raises(RuntimeError, match="q must be contiguous int8"):
        op(x, q.float(), scales, b)
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        op(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 1), None)
    with pytest.raises(RuntimeError, match="scales must be"):
        op(x, q, scales[:, :1].repeat(1, 3).contiguous(), b)
    with pytest.raises(RuntimeError, match=r"x \(\.\.\., 64\) expected"):
        op(torch.randn(2, 32), q, scales, b)
    with pytest.raises(RuntimeError, match="b must be BFloat16"):
        op(x.bfloat16(), q, scales, b)
    x[1, 5] = float("nan")
    out = op(x, q, scales, b)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()  # a NaN row stays NaN, the others exact


def _dequantized_copy(model):
    """The quantized model with each Int8Linear and Int8Embedding replaced by the float module holding
    its dequantized weight, in float64: the reference its logits must match."""
    reference = copy.deepcopy(model)
    for _, module in list(reference.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(child.dequantized())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(module, child_name, linear)
            elif isinstance(child, Int8Embedding):
                rows = dequantize_rows_grouped(child.qweight, child.scales)
                setattr(module, child_name, torch.nn.Embedding.from_pretrained(rows))
    return reference.double()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("opt", True)])
def test_quantized_model_is_its_dequantized_weights_and_a_quarter_of_the_bytes(arch, tied):
    model = tiny_model(arch, layers=2, tie_word_embeddings=tied)
    fp32 = copy.deepcopy(model)
    modules = dict(model.named_modules())
    linears = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    embeddings = {n for n, m in modules.items() if type(m) is torch.nn.Embedding}
    others = {n for n, m in modules.items() if isinstance(m, torch.nn.Embedding)} - embeddings  # OPT's positions
    replaced = {modules[n].weight.data_ptr(): modules[n].weight for n in linears | embeddings}  # tied: once
    freed = sum(w.nbytes for w in replaced.values())
    added = sum(w.numel() * (1 + 4 / 32) for w in replaced.values())  # int8 and a 4-byte scale per 32
    report = quantize_weights(model)
    assert set(report.quantized) == linears | embeddings and {n for n, _ in report.kept} == others
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for n, m in model.named_modules()
                   if n not in others)
    assert report.bytes_after == report.bytes_before - freed + added
    assert report.bytes_after < 0.3 * report.bytes_before or arch == "opt"  # OPT keeps its float positions
    if tied:  # one int8 copy serves the embedding and the head
        assert model.get_input_embeddings().qweight is model.get_output_embeddings().qweight
    assert "projections" in str(report)
    ids = token_ids(2, 12)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        expected = _dequantized_copy(model)(ids, use_cache=False).logits
        original = fp32(ids, use_cache=False).logits
    scale = float(expected.abs().max())
    assert float((got.double() - expected).abs().max()) < 1e-4 * scale  # x's int16 rounding only
    moved = float((original.double() - expected).abs().max())
    assert 0 < moved < 0.05 * scale  # the int8 rounding moved the logits, a little


def test_quantized_model_compiles_and_decodes_as_eager():
    """Through the dejavu backend (Inductor, its C++ wrapper) and plain Inductor, a decode step and a
    greedy generate() with a static cache give eager's logits and tokens; the graph calls the op."""
    model = tiny_model("llama", layers=2)
    quantize_weights(model)
    ids = token_ids(1, 6)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static",
                                  pad_token_id=0)
        reports = []
        compiled = torch.compile(model.forward, backend="dejavu", options={"on_report": reports.append})
        original = model.forward
        model.forward = compiled
        try:
            got = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static",
                                 pad_token_id=0)
        finally:
            model.forward = original
    torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert reports and all(any("cpu_q8_linear" in str(n.target) for n in r.graph.graph.nodes)
                           for r in reports)
    # asked for sparsity: the int8 MLPs take their sparse path (tests/test_int8_sparse_mlp.py), the
    # attention and output head projections stay dense, reported
    reports.clear()
    with torch.no_grad():
        torch.compile(model, backend="dejavu", options={"mlp_density": 0.6, "on_report": reports.append})(
            ids[:, :1], use_cache=False)
    torch._dynamo.reset()
    assert [r.split(":")[0] for r in reports[-1].rewritten] == ["layer 0 mlp", "layer 1 mlp"]
    assert any(where == "int8 projections" and "9 projections" in why for where, why in reports[-1].match.fallbacks)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 50), groups=st.integers(1, 4), group=st.sampled_from(GROUP_SIZES),
       ids_shape=st.sampled_from([(1,), (1, 1), (2, 7), (3, 1, 4)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_int8_embedding_looks_up_its_dequantized_rows(rows, groups, group, ids_shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    embedding = torch.nn.Embedding(rows, groups * group).to(dtype)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(rows, groups * group, generator=g) * torch.rand(rows, 1, generator=g))
    int8 = Int8Embedding(embedding, group)
    ids = torch.randint(0, rows, ids_shape, generator=g)
    got = int8(ids)
    # float64 of the int8 values times their scales, rounded once to the embedding's dtype
    q, scales = quantize_rows_grouped(embedding.weight, group)
    expected = (q.double().reshape(rows, groups, group) * scales.double()[..., None]).reshape(rows, -1)[ids]
    assert got.dtype == dtype and got.shape == (*ids_shape, groups * group)
    eps = torch.finfo(dtype).eps
    assert ((got.double() - expected).abs() <= eps * expected.abs()).all()
    step = scales.double().repeat_interleave(group, -1)[ids]  # within half a step of the float rows
    original = embedding.weight.double()[ids]
    assert ((got.double() - original).abs() <= step * (0.5 + 128 * EPS32) + eps * (original.abs() + step)).all()


def test_quantize_weights_reports_what_it_keeps_and_refuses_bad_arguments():
    class ScaledEmbedding(torch.nn.Embedding):  # a subclass's forward may do more than look rows up
        pass

    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    report = quantize_weights(model)
    assert report.quantized == ["0"] and report.kept == [("2", "16 inputs, not a multiple of 32")]
    embeddings = torch.nn.ModuleList([torch.nn.Embedding(4, 48), torch.nn.Embedding(4, 64, max_norm=1.0),
                                      ScaledEmbedding(4, 64), torch.nn.Embedding(4, 64)])
    report = quantize_weights(embeddings)
    assert report.quantized == ["3"] and [name for name, _ in report.kept] == ["0", "1", "2"]
    assert "ScaledEmbedding" in str(report) and "max_norm" in str(report)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), model[2](torch.relu(model[0](x))))
    with pytest.raises(ValueError, match="format must be one of"):
        quantize_weights(torch.nn.Linear(64, 4), "int4")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_weights(torch.nn.Linear(64, 4), group_size=48)
    with pytest.raises(ValueError, match="CPU models"):
        quantize_weights(torch.nn.Linear(64, 4, device="meta"))
