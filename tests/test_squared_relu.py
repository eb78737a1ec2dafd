"""Squared ReLU end to end, on a real Hugging Face family that uses it (Nemotron, hidden_act="relu2"):
matched by the built-in MLP rule, calibrated, and decoded through the sparse CPU ops and (under the
Triton interpreter) the Triton kernel, equal to a float64 masked reference computed from the
activation table's own reference function."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dejavu_compile
from dejavu_compile.testing import describe_difference
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import calibrated_nemotron, run_under_triton_interpreter, token_ids
from tests.references import nemotron_masked_reference

V = 128


@pytest.fixture(scope="module")
def nemotron_and_plan():
    return calibrated_nemotron(V)


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
    ids = token_ids(2, 1, seed=7, high=V)
    expected = nemotron_masked_reference(model, plan, ids)
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


TRITON_DECODE = f"V = {V}\n" + """
import torch
from dejavu_compile.testing import describe_difference
from tests.helpers import calibrated_nemotron, token_ids
from tests.references import nemotron_masked_reference

torch.set_num_threads(1)
model, plan = calibrated_nemotron(V)
ids = token_ids(2, 1, seed=7, high=V)
expected = nemotron_masked_reference(model, plan, ids)
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
    assert "triton relu2 decode ok" in run_under_triton_interpreter(TRITON_DECODE)
