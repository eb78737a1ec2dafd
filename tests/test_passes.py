"""The pass runner (named passes, per-pass counts, debug logging, failures) and the kernel-lowering
registry (the cpu_lowering choices, forcing a lowering, Triton end to end under the interpreter)."""
import logging
import os
import textwrap

import pytest
import torch

from dejavu_compile.compiler import backend
from dejavu_compile.compiler.passes import lowering
from dejavu_compile.compiler.passes.graph_utils import find_linears
from dejavu_compile.compiler.passes.runner import PassContext, dejavu_op_nodes, run_passes
from dejavu_compile.compiler.passes.sparse_mlp import SparseMLPPass
from dejavu_compile.compiler.passes.sparsify import default_passes
from dejavu_compile.errors import DejavuOptionError
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import run_under_triton_interpreter, sparse_plan, token_ids


def _dynamo_graph(model, ids):
    """Dynamo's graph of one uncached forward, and its example inputs."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(ids, use_cache=False)
    torch._dynamo.reset()
    (gm, example_inputs), = captured
    return backend._copy_graph_module(gm), example_inputs


def test_passes_run_in_order_and_count_what_they_did():
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.4)
    gm, inputs = _dynamo_graph(model, token_ids(2, 1))
    opts = backend.validate_options({"plan": plan, "inner": "eager", "cpu_lowering": "op"})
    passes = default_passes(opts)
    assert [p.name for p in passes] == ["match", "training_guard", "auto_plan", "plan_check", "weights_check",
                                        "decode_shape", "sparse_mlp", "sparse_attention", "head_screen"]
    report = backend.BackendReport("test")
    ctx = PassContext(list(inputs), opts, report)
    split = [p.name for p in passes].index("sparse_mlp")
    with torch.no_grad():  # the training guard checks grad mode
        gm = run_passes(gm, passes[:split], ctx)
    layers = model.config.num_hidden_layers
    params = len(list(model.parameters()))
    assert report.pass_counts == {"match": 2 * layers, "training_guard": 0, "auto_plan": 0, "plan_check": layers,
                                  "weights_check": params, "decode_shape": 0}
    linears_before = len(find_linears(gm))
    assert dejavu_op_nodes(gm) == []

    with torch.no_grad():
        gm = run_passes(gm, passes[split:], ctx)
    ops = [n.target for n in dejavu_op_nodes(gm)]
    assert ops == [torch.ops.dejavu.sparse_gated_mlp.default] * layers
    assert len(find_linears(gm)) == linears_before - 3 * layers  # gate, up, down of each MLP
    assert report.pass_counts["sparse_mlp"] == layers and report.pass_counts["sparse_attention"] == 0
    assert report.pass_counts["head_screen"] == 0  # the plan keeps the head dense
    assert not ctx.stopped


def test_guards_stop_the_run_with_the_reason():
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.4)
    reports = []
    with torch.no_grad():
        torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager", "on_report": reports.append})(
            token_ids(1, 5), use_cache=False)
    torch._dynamo.reset()
    (report,) = reports
    assert report.dense_reason.startswith("prefill-shaped graph")
    assert report.pass_counts["decode_shape"] == 1 and "sparse_mlp" not in report.pass_counts


def test_debug_logging_shows_each_graph_before_and_after_each_pass(caplog):
    model = tiny_model("llama", layers=1)
    plan = sparse_plan(model, 0.4)
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="dejavu_compile.passes"):
        compiled = torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager"})
        compiled(token_ids(1, 1), use_cache=False)
    torch._dynamo.reset()
    for name in ("match", "training_guard", "auto_plan", "plan_check", "weights_check", "decode_shape", "sparse_mlp",
                 "sparse_attention"):
        assert f"before pass {name}:" in caplog.text and f"after pass {name} " in caplog.text, name
    after_mlp = caplog.text.split("after pass sparse_mlp", 1)[1].split("before pass sparse_attention", 1)[0]
    assert "dejavu.sparse_gated_mlp" in after_mlp or "dejavu.cpu_sparse_mlp" in after_mlp


def test_a_failing_pass_is_named_and_the_graph_stays_dense(monkeypatch, caplog):
    def broken(self, gm, ctx):
        raise RuntimeError("simulated lowering failure")

    monkeypatch.setattr(SparseMLPPass, "__call__", broken)
    model = tiny_model("llama", layers=1)
    plan = sparse_plan(model, 0.4)
    ids = token_ids(1, 1)
    reports = []
    with torch.no_grad(), caplog.at_level("WARNING", logger="dejavu_compile"):
        got = torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager",
                                                              "on_report": reports.append})(ids, use_cache=False).logits
        expected = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert reports[-1].failed_pass == "sparse_mlp" and "simulated lowering failure" in reports[-1].error
    assert "pass sparse_mlp failed" in caplog.text
    with torch.no_grad(), pytest.raises(Exception, match="simulated lowering failure"):
        torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager", "strict": True})(
            ids, use_cache=False)
    torch._dynamo.reset()


def _old_cpu_lowering(opts, weight, rows_contiguous=True):
    """The cpu_lowering option's rule written out directly (what the registry's choice must equal)."""
    if weight is not None and weight.device.type != "cpu":
        return None
    choice = opts.get("cpu_lowering", "auto")
    kernel_dtype = weight is None or weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if choice in ("auto", "native") and kernel_dtype and rows_contiguous and lowering.cpu_ops_available({}, "cpu"):
        return "native"
    if choice == "auto":
        return "decomposed" if opts["inner"] == "inductor" else "op"
    return "op" if choice == "native" else choice


def test_registry_keeps_the_cpu_lowering_choices():
    assert {"native", "decomposed", "op", "triton"} <= set(lowering.registered_lowerings())
    for choice in ("auto", "native", "op", "decomposed"):
        for inner in ("inductor", "eager"):
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, None):
                for rows_contiguous in (True, False):
                    opts = {"cpu_lowering": choice, "inner": inner}
                    weight = None if dtype is None else torch.zeros(4, 4, dtype=dtype)
                    assert lowering.cpu_lowering(opts, weight, rows_contiguous) == _old_cpu_lowering(
                        opts, weight, rows_contiguous), (choice, inner, dtype, rows_contiguous)


def test_forced_lowering_is_validated_and_must_be_able_to_run():
    with pytest.raises(DejavuOptionError, match="option 'lowering'"):
        backend.validate_options({"lowering": "cuda-graphs"})
    assert lowering.choose_lowering({"lowering": "op", "inner": "inductor"}, torch.zeros(2, 2)).name == "op"
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(DejavuOptionError, match="'triton' cannot run here"):
            lowering.choose_lowering({"lowering": "triton", "inner": "eager"}, torch.zeros(2, 2))


TRITON_DECODE = textwrap.dedent("""
    import torch
    from dejavu_compile.compiler.passes.runner import dejavu_op_nodes
    from dejavu_compile.testing import describe_difference
    from dejavu_compile.testing.tiny import tiny_model
    from tests.helpers import sparse_plan, token_ids
    from tests.references import masked_reference_llama

    torch.set_num_threads(1)
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.4)
    ids = token_ids(2, 1)
    reports = []
    with torch.no_grad():
        got = torch.compile(model, backend="dejavu", options={
            "plan": plan, "inner": "eager", "lowering": "triton", "strict": True,
            "on_report": reports.append})(ids, use_cache=False).logits

    # float64 masked reference: each MLP keeps the neurons its predictor picks (scored in fp32, as
    # the graph does) from the lookahead source, the rest of the model in float64
    expected = masked_reference_llama(model, plan, ids, float64=True)
    assert describe_difference("logits", got.double(), expected, rtol=1e-4, atol=1e-4) is None
    targets = {n.target.__name__ for r in reports for n in r.graph.graph.nodes if n.op == "call_function"}
    assert "sparse_gated_mlp_triton" in targets, targets
    # no C++ or custom sparse-MLP op: only the dense projections' GEMV and the decode attention
    # (passes dense_linear and decode_attention) are dejavu ops
    assert {n.target for r in reports for n in dejavu_op_nodes(r.graph)} <= {
        torch.ops.dejavu.cpu_linear.default, torch.ops.dejavu.cpu_linear_cat.default,
        torch.ops.dejavu.cpu_decode_attention.default}
    assert reports[-1].pass_counts["sparse_mlp"] == model.config.num_hidden_layers
    print("triton decode ok")
""")


def test_triton_lowering_decodes_a_tiny_model_under_the_interpreter():
    """The "triton" registry entry end to end: TRITON_INTERPRET=1 must be set before the Triton
    kernels are first imported, so the decode runs in a fresh process (CPU tensors, fp32: bf16 math
    is wrong in the interpreter)."""
    assert "triton decode ok" in run_under_triton_interpreter(TRITON_DECODE)
