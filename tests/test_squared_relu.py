"""Squared ReLU end to end, on a real Hugging Face family that uses it (Nemotron, hidden_act="relu2"):
matched by the built-in MLP rule, calibrated, and decoded through the sparse CPU ops and (under the
Triton interpreter) the Triton kernel, equal to a float64 masked reference computed from the
activation table's own reference function."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dejavu_compile  # noqa: E402
from dejavu_compile import activations  # noqa: E402
from dejavu_compile.calibration.calibrate import calibrate  # noqa: E402
from dejavu_compile.calibration.collect import collect  # noqa: E402
from dejavu_compile.testing import describe_difference  # noqa: E402
from dejavu_compile.testing.tiny import tiny_model  # noqa: E402
from tests.test_sparse_backend import logits_with_hooks  # noqa: E402

V = 128


def _batches(n=4, t=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (1, t), generator=g) for _ in range(n)]


def masked_reference_float64(model, plan, ids):
    """Eager logits where each MLP is replaced by sum over kept neurons j of relu2(up_j . x) down_j,
    computed in float64 from the table's reference, the kept set chosen by the plan's predictor from
    the lookahead source (the layer's attention input) or the MLP's own input."""
    handles, sources = [], {}
    relu2 = activations.get("relu2").reference
    for layer, block in enumerate(model.model.layers):
        entry = plan.entry(layer, "mlp")

        def keep_source(module, args, output, layer=layer):
            sources[layer] = output

        def sparse_mlp(module, args, output, layer=layer, entry=entry):
            (x,) = args
            flat = x.reshape(-1, x.shape[-1])
            source = sources[layer].reshape(-1, sources[layer].shape[-1])
            idx = entry.select(source)
            up = module.up_proj.weight.double()
            down = module.down_proj.weight.double()
            hidden = relu2(flat.double() @ up.t())
            mask = torch.zeros_like(hidden).scatter(-1, idx, 1.0)
            return ((hidden * mask) @ down.t()).to(output.dtype).view_as(output)

        source = block.input_layernorm if entry.lookahead else block.post_attention_layernorm
        handles.append(source.register_forward_hook(keep_source))
        handles.append(block.mlp.register_forward_hook(sparse_mlp))
    return logits_with_hooks(model, ids, handles)


def build_model_and_plan():
    """A tiny Nemotron and its calibrated plan at 50% MLP density (Deja Vu's two-layer predictor)."""
    model = tiny_model("nemotron", vocab=V)
    samples, _ = collect(model, _batches(), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, progress=False, dense_when_unprofitable=False)
    return model, plan


@pytest.fixture(scope="module")
def nemotron_and_plan():
    return build_model_and_plan()


def test_builtin_rule_matches_squared_relu():
    model = tiny_model("nemotron", vocab=V)
    report = dejavu_compile.explain(model, torch.tensor([[3, 4, 5, 6]]))
    mlps = [b for b in report.blocks if b.kind == "mlp"]
    assert len(mlps) == 2 and not report.fallbacks
    assert {(b.activation, b.gated) for b in mlps} == {("relu2", False)}


def test_calibrated_plan_names_the_blocks_activation(nemotron_and_plan):
    _, plan = nemotron_and_plan
    entries = [plan.entry(layer, "mlp") for layer in range(2)]
    assert all(not e.dense for e in entries)
    assert abs(sum(e.k for e in entries) - sum(e.total for e in entries) // 2) <= 2  # 50%, spread over layers
    assert {e.activation for e in entries} == {"relu2"}


@pytest.mark.parametrize("cpu_lowering, inner", [("auto", "inductor"), ("op", "eager"), ("decomposed", "inductor")])
def test_squared_relu_decode_matches_float64_masked_reference(nemotron_and_plan, cpu_lowering, inner):
    model, plan = nemotron_and_plan
    ids = torch.randint(3, V, (2, 1), generator=torch.Generator().manual_seed(7))
    expected = masked_reference_float64(model, plan, ids)
    reports = []
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="dejavu", options={
            "plan": plan, "strict": True, "inner": inner, "cpu_lowering": cpu_lowering,
            "on_report": reports.append})(ids, use_cache=False).logits
    torch._dynamo.reset()
    sparse_ops = [n for n in reports[-1].graph.graph.nodes
                  if (n.meta.get("dejavu") or {}).get("role") == "sparse_mlp"]
    assert len(sparse_ops) == 2, reports[-1].rewritten
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
    assert (dense - expected).abs().max() > 1e-3  # the plan really removed neurons


TRITON_DECODE = """
import torch
from dejavu_compile.testing import describe_difference
from tests.test_squared_relu import build_model_and_plan, masked_reference_float64, V

torch.set_num_threads(1)
model, plan = build_model_and_plan()
ids = torch.randint(3, V, (2, 1), generator=torch.Generator().manual_seed(7))
expected = masked_reference_float64(model, plan, ids)
reports = []
with torch.no_grad():
    got = torch.compile(model, backend="dejavu", options={
        "plan": plan, "inner": "eager", "lowering": "triton", "strict": True,
        "on_report": reports.append})(ids, use_cache=False).logits
assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
targets = {getattr(n.target, "__name__", "") for r in reports for n in r.graph.graph.nodes if n.op == "call_function"}
assert "sparse_mlp_triton" in targets, targets
print("triton relu2 decode ok")
"""


def test_squared_relu_decodes_through_the_triton_kernel_under_the_interpreter():
    """The Triton lowering's relu2 case inside a whole model: TRITON_INTERPRET=1 must be set before
    the kernels are imported, so the decode runs in a fresh process (CPU tensors, fp32)."""
    from tests.test_passes import run_under_triton_interpreter

    assert "triton relu2 decode ok" in run_under_triton_interpreter(TRITON_DECODE)
