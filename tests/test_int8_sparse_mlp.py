"""Sparse MLPs over quantize_weights' int8 projections: each gated MLP chosen and valued by its own
int8 gate/up (dejavu::cpu_q8_glu_mlp in the decode graph, the same selection as a mask in the
simulation), against float64 of the dequantized model with all but the top k |act(g) * up| of each
token zeroed before the down projection; what stays dense, and why."""
from __future__ import annotations

import pytest
import torch

from dejavu_compile.compiler.quantize import quantize_weights
from dejavu_compile.kernels.cpu import native
from dejavu_compile.plan import rules
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import token_ids
from tests.test_quantized_weights import _dequantized_copy

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")


def _masked_reference(model, k: int):
    """The float64 dequantized model with each MLP's down projection reading only the k largest
    |act(g) * up| of each token; ``reference.gaps`` collects, per MLP call, the smallest relative gap
    between the k-th and the next largest |act(g) * up| over its tokens."""
    reference = _dequantized_copy(model)
    reference.gaps = []

    def keep_top_k(_module, args):
        (h,) = args
        top = h.abs().topk(k + 1, dim=-1).values
        reference.gaps.append(float(((top[..., k - 1] - top[..., k]) / top[..., 0]).min()))
        idx = h.abs().topk(k, dim=-1).indices
        return (h * torch.zeros_like(h).scatter(-1, idx, 1.0),)

    for layer in reference.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(keep_top_k)
    return reference


def _unambiguous_ids(reference, batch: int, tokens: int):
    """Token ids (the first of a few seeds) whose top k in every MLP is clear of float32 rounding: the
    k-th largest |act(g) * up| is more than 1e-4 (relative) above the next, so the int8 kernels'
    fp32 values must pick the reference's neurons."""
    for seed in range(20):
        ids = token_ids(batch, tokens, seed)
        reference.gaps.clear()
        with torch.no_grad():
            expected = reference(ids, use_cache=False).logits
        if min(reference.gaps) > 1e-4:
            return ids, expected
    raise AssertionError("no input with an unambiguous top k")


def _compiled_logits(model, ids, options):
    reports = []
    with torch.no_grad():
        compiled = torch.compile(model, backend="dejavu", options={**options, "on_report": reports.append})
        logits = compiled(ids, use_cache=False).logits
    torch._dynamo.reset()
    return logits, reports[-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("density", [0.5, 0.25])
def test_int8_mlp_density_decodes_as_float64_of_the_masked_int8_model(arch, density):
    """A decode step (one token per sequence, two sequences) under mlp_density: every MLP is one
    cpu_q8_glu_mlp call and the logits are the masked float64 reference's, up to x's int16 rounding;
    the same plan's masked simulation over a 7-token prompt matches the reference too."""
    model = tiny_model(arch, layers=2)
    quantize_weights(model)
    total = model.config.intermediate_size
    k = rules.uniform_k(total, density, rules.k_multiple(total))
    assert k < total
    reference = _masked_reference(model, k)
    for (batch, tokens), options in (((2, 1), {}), ((1, 7), {"simulate": True})):
        ids, expected = _unambiguous_ids(reference, batch, tokens)
        logits, report = _compiled_logits(model, ids, {"mlp_density": density, **options})
        scale = float(expected.abs().max())
        assert float((logits.double() - expected).abs().max()) < 1e-4 * scale, options
        assert len([r for r in report.rewritten if f"{k}/{total} neurons, int8" in r]) == 2, report.rewritten
        ops = {str(n.target) for n in report.graph.graph.nodes}
        assert ("dejavu.cpu_q8_glu_mlp.default" in ops) == (not options), ops
    # the masking matters: the dense int8 model gives other logits
    with torch.no_grad():
        dense = _dequantized_copy(model)(ids, use_cache=False).logits
    assert float((dense - expected).abs().max()) > 1e-3 * scale


def test_int8_blocks_that_stay_dense_say_why():
    """Attention of int8 projections stays dense (a sparse entry for it warns); a block mixing int8 and
    float projections stays dense; the output head and attention count as int8 projections outside MLPs."""
    model = tiny_model("llama", layers=2)
    quantize_weights(model)
    heads, neurons = model.config.num_attention_heads, model.config.intermediate_size
    entries = {(0, "attention"): PlanEntry(0, "attention", heads // 2, heads),
               (0, "mlp"): PlanEntry(0, "mlp", neurons // 2, neurons),
               (1, "mlp"): PlanEntry(1, "mlp", neurons, neurons)}
    plan = SparsityPlan(entries, {}, {})
    with pytest.warns(UserWarning, match="sparse entries for layer 0 attention are not applied"):
        _, report = _compiled_logits(model, token_ids(1, 1), {"plan": plan})
    assert report.rewritten == [f"layer 0 mlp: {neurons // 2}/{neurons} neurons, int8 weights (chosen and valued "
                                "by its own gate/up)"]
    fallbacks = dict(report.match.fallbacks)
    assert "no sparse path" in fallbacks["model.layers.0.self_attn"]
    assert "9 projections with int8 weights" in fallbacks["int8 projections"]  # 2 x 4 attention + the head

    mixed = tiny_model("llama", layers=2)
    float_up = mixed.model.layers[1].mlp.up_proj
    quantize_weights(mixed)
    mixed.model.layers[1].mlp.up_proj = float_up
    _, report = _compiled_logits(mixed, token_ids(1, 1), {"mlp_density": 0.5})
    assert "mixes int8 and float projections" in dict(report.match.fallbacks)["model.layers.1.mlp"]
    assert [r.split(":")[0] for r in report.rewritten] == ["layer 0 mlp"]


def test_bandwidth_bound_of_int8_mlps_counts_the_unread_down_rows():
    """An int8 model's step reads its int8 values and scales; a sparse entry on an int8 MLP saves the
    unread share of its down weight's values (gate, up and the scales are read whole)."""
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound

    model = tiny_model("llama", layers=2)
    quantize_weights(model)
    neurons = model.config.intermediate_size
    plan = SparsityPlan({(layer, "mlp"): PlanEntry(layer, "mlp", neurons // 4, neurons) for layer in range(2)}, {})
    int8 = {name: t for name, t in model.named_buffers() if name.endswith((".qweight", ".scales"))}
    embedding = model.get_input_embeddings()  # untied: one row per token, not counted
    total = sum(t.nbytes for t in int8.values()) + sum(p.nbytes for p in model.parameters()) \
        - embedding.qweight.nbytes - embedding.scales.nbytes
    down = sum(t.nbytes for name, t in int8.items() if name.endswith("down_proj.qweight"))
    assert bandwidth_bound(model, plan) == pytest.approx(total / (total - 0.75 * down), rel=1e-12)
