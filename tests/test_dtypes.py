"""bf16 and fp16 models on CPU: calibrated and compiled (Inductor, eager, the masked simulation),
each decode step compared with a masked reference computed in float64 from the same cast weights.

A bf16/fp16 model's sparse MLPs take the C++ ops where they build (weights read as stored, sums in
fp32), and the decomposed aten form (Inductor) or the custom op (eager) in the model's dtype when
asked for by ``cpu_lowering``; the int8 predictor scores in fp32 (its input cast) in a model of any
dtype, as calibration scores it.

Tolerances, relative to the reference logits' largest magnitude: bf16 keeps 8 significant bits
(unit roundoff 2^-9 = 2e-3), fp16 11 (2^-12 = 2.4e-4); two layers of matmuls, norms and rotary
embeddings, each rounding to the model's dtype, add up to about ten units (measured: the dense
model in bf16 is 6e-3 from float64, in fp16 6e-4). Hence 2e-2 for bf16 and 5e-3 for fp16, and the
plan must move the logits by several tolerances, so that a wrong selection would show.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.calibration.collect import collect
from dejavu_compile.compiler.passes.lowering import choose_lowering
from dejavu_compile.kernels import int8_linear
from dejavu_compile.kernels.cpu import native
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import ByteTokenizer, token_ids
from tests.references import int8_predictor_values

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
TEXT = " ".join(f"token{i % 37} word{i % 11}" for i in range(60))


def cast_model(dtype):
    """A one-layer tiny LLaMA in `dtype` whose MLP weighs enough in the logits (weights x4) for half
    of its neurons to move the logits well past the dtype's rounding. One layer: a later layer's
    predictor would read activations that each path rounds a little differently, and in 8 bits of
    mantissa that swaps near-tied neurons (each swap moves these logits by ~2%)."""
    model = tiny_model("llama", layers=1)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.mul_(4.0)
    return model.to(dtype)


def masked_logits(model, plan, ids, selection=None):
    """One uncached forward with each MLP masked to its plan entry's neurons. `selection` None: each
    entry's predictor picks them from the model's own activations (recorded and returned); else the
    given ids. Values "predictor" entries take the int8 rows' act(g~) * u~ on the kept neurons
    (float64 from the dequantized rows when `selection` is given)."""
    record = selection is None
    selection = {} if record else selection
    sources, handles = {}, []
    for layer, block in enumerate(model.model.layers):
        entry = plan.entries[(layer, "mlp")]
        source = block.input_layernorm if entry.lookahead else block.post_attention_layernorm

        def keep_source(module, args, output, layer=layer):
            sources[layer] = output

        def replace_mlp(module, args, output, layer=layer, entry=entry):
            (x,) = args
            flat = x.reshape(-1, x.shape[-1])
            if record:
                s = sources[layer]
                selection[layer] = entry.scores(s.reshape(-1, s.shape[-1])).topk(entry.k, dim=-1).indices
            if entry.values == "predictor" and record:  # as the graph computes them: fp32, then cast
                hidden = entry.predictor_kind.graph_values(flat.float(), **entry.tensors).to(flat.dtype)
            elif entry.values == "predictor":  # the float64 model: its input is float64
                hidden = int8_predictor_values(entry, flat)
            else:
                hidden = module.act_fn(module.gate_proj(flat)) * module.up_proj(flat)
            mask = torch.zeros_like(hidden).scatter(-1, selection[layer], 1.0)
            return module.down_proj(hidden * mask).view_as(output)

        handles.append(source.register_forward_hook(keep_source))
        handles.append(block.mlp.register_forward_hook(replace_mlp))
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits, selection
    finally:
        for h in handles:
            h.remove()


def float64_references(model, plan, ids):
    """([masked logits], dense logits), all in float64 from the model's cast weights. The neurons are
    those the plan's predictor picks from the model's eager activations in its own dtype, or from
    the exact ones: Inductor rounds less than eager (fused bf16 norms), and in bf16 that can swap a
    near-tied neuron; either selection is the plan's."""
    exact = copy.deepcopy(model).double()
    masked = [masked_logits(exact, plan, ids, masked_logits(model, plan, ids)[1])[0],
              masked_logits(exact, plan, ids, masked_logits(exact, plan, ids)[1])[0]]
    with torch.no_grad():
        dense = exact(ids, use_cache=False).logits
    return masked, dense


def _relative(got, expected) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


def _dejavu_ops(report) -> set:
    return {str(n.target) for n in report.graph.graph.nodes if n.op == "call_function" and "dejavu" in str(n.target)}


@pytest.mark.parametrize("predictor", ["int8", "lowrank"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_model_calibrates_compiles_and_decodes_like_float64(dtype, predictor):
    model = cast_model(dtype)
    plan = calibrate(model, ByteTokenizer(), texts=[TEXT], max_tokens=512, seq_len=32, predictor=predictor,
                     mlp_density=0.5, train_steps=50, progress=False)
    assert plan.settings["quality"] is not None  # measured through the masked simulation in `dtype`
    assert all(not e.dense for (_, kind), e in plan.entries.items() if kind == "mlp")
    ids = token_ids(2, 1)  # one decode step, batch 2
    references, dense = float64_references(model, plan, ids)
    tol = TOLERANCE[dtype]
    assert min(_relative(dense, r) for r in references) > 3 * tol  # the plan moves the logits past the tolerance
    exact_values = plan.entries[(0, "mlp")].values == "exact"
    native_ops = native.load_ops()
    for options in ({"inner": "inductor"}, {"inner": "eager"}, {"inner": "inductor", "cpu_lowering": "decomposed"},
                    {"inner": "eager", "cpu_lowering": "op"}, {"inner": "eager", "simulate": True}):
        torch._dynamo.reset()
        reports = []
        with torch.no_grad():
            got = torch.compile(model, backend="dejavu", options={
                "plan": plan, "strict": True, "on_report": reports.append, **options})(ids, use_cache=False).logits
        assert got.dtype == dtype
        error = min(_relative(got, r) for r in references)
        assert error < tol, (options, error)
        ops = _dejavu_ops(reports[-1])
        if options.get("simulate"):
            continue
        fused_block = any("cpu_glu_int8_mlp" in op for op in ops)
        lowering = options.get("cpu_lowering", "native" if native_ops else None)
        if lowering == "native":  # the C++ ops in the model's dtype
            assert any("cpu_sparse_mlp" in op for op in ops) if exact_values else fused_block, ops
            assert any("cpu_linear" in op for op in ops), ops  # the dense projections too
        elif exact_values and options["inner"] == "eager":
            assert any("sparse_gated_mlp" in op for op in ops), ops  # the custom op
        elif exact_values:
            targets = {n.target for n in reports[-1].graph.graph.nodes}
            assert torch.nn.functional.embedding_bag in targets  # the decomposed aten form
        if predictor == "int8" and exact_values and native_ops:
            assert any("cpu_glu_int8_topk" in op for op in ops), ops  # predictor fused, fp32 input


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int8_predictor_scores_in_fp32_in_a_half_model(dtype):
    """The compiled graph scores with the arithmetic calibration and the simulation used (fp32 on the
    cast input), whatever the model's dtype; and exact values take the fused C++ top-k there too."""
    model = cast_model(dtype)
    plan = calibrate(model, ByteTokenizer(), texts=[TEXT], max_tokens=512, seq_len=32, predictor="int8",
                     values="exact", mlp_density=0.5, progress=False, warn_ppl_increase=None)
    for options in ({"inner": "eager", "cpu_lowering": "decomposed"}, {"inner": "eager", "simulate": True,
                                                                        "cpu_lowering": "decomposed"}):
        torch._dynamo.reset()
        reports = []
        with torch.no_grad():
            torch.compile(model, backend="dejavu", options={"plan": plan, "strict": True, "on_report": reports.append,
                                                            **options})(torch.tensor([[5], [9]]), use_cache=False)
        graph = reports[-1].graph.graph
        predictors = [n for n in graph.nodes if n.meta.get("dejavu", {}).get("role") == "predictor"]
        assert predictors
        for node in predictors:  # its input is the model's activation cast to fp32
            (x,) = node.args[:1]
            assert x.op == "call_method" and x.target == "to" and x.args[1] == torch.float32, x.format_node()


def test_collection_records_fp32_statistics_of_a_bf16_model():
    model = cast_model(torch.bfloat16)
    samples, _ = collect(model, [torch.randint(3, 120, (1, 16))], progress=False)
    for s in samples.values():
        for name in ("mlp_input", "mlp_importance", "attn_input", "attn_importance"):
            assert getattr(s, name).dtype == torch.float32, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lowering_by_dtype(dtype):
    """Every CPU float dtype: the C++ ops where they build; else decomposed under Inductor, the op under eager."""
    weight = torch.zeros(8, 4, dtype=dtype)
    for inner, fallback in (("inductor", "decomposed"), ("eager", "op")):
        name = choose_lowering({"inner": inner}, weight).name
        assert name == ("native" if native.load_ops() else fallback), (dtype, inner)
        assert choose_lowering({"inner": inner}, weight.double()).name == fallback  # no kernel for float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_takes_half_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).to(dtype)
    rows = torch.randint(-127, 128, (24, 40), generator=g, dtype=torch.int8)
    scales = torch.rand(24, generator=g) + 0.01
    out = int8_linear(x, rows, scales)
    assert out.dtype == dtype
    if native.available():  # the C kernel's fp32 arithmetic, rounded once
        torch.testing.assert_close(out, int8_linear(x.float(), rows, scales).to(dtype), rtol=0, atol=0)
    ref = x.double() @ (rows.double() * scales.double()[:, None]).T
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < TOLERANCE[dtype]
