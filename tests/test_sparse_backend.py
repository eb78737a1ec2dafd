"""End-to-end sparse decoding in the backend: predictors with lookahead, top-k and sparse ops."""
import pytest
import torch

from dejavu_compile.compiler.prepare import prepare_model
from dejavu_compile.errors import PlanMismatchError
from dejavu_compile.kernels.cpu import native
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint
from dejavu_compile.testing import describe_difference, greedy_generate
from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model
from tests.helpers import AlwaysSparseEntry, int8_plan, sparse_plan, token_ids
from tests.references import masked_reference_llama, predictor_values_reference


def _generate(model, ids, cache="static", options=None):
    return greedy_generate(model, ids, 12, cache, options)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_density_plan_through_sparse_ops_matches_eager(arch):
    model = tiny_model(arch)
    plan = sparse_plan(model, 1.0, entry_cls=AlwaysSparseEntry, attn_density=1.0)
    ids = token_ids()
    reports = []
    options = {"plan": plan, "inner": "eager", "strict": True, "on_report": reports.append}
    for cache in ("static", "dynamic"):
        reference = _generate(model, ids, cache)
        tokens = _generate(model, ids, cache, options)
        assert describe_difference(f"tokens ({cache})", tokens, reference, 0, 0) is None
    rewritten = [r for r in reports if r.rewritten]
    assert rewritten, "no decode graph went through the sparse ops"
    ops = {n.target for r in rewritten for n in r.graph.graph.nodes if n.op == "call_function"}
    if native.load_ops() and arch != "gpt2":  # "auto" on CPU fp32: the C++ op, gated or plain,
        expected = torch.ops.dejavu.cpu_sparse_mlp.default  # where weight rows are contiguous (not Conv1D's)
    else:
        expected = torch.ops.dejavu.sparse_gated_mlp.default if arch in (
            "llama", "mistral", "qwen2", "gemma3_text", "phi3") else torch.ops.dejavu.sparse_mlp.default
    assert expected in ops
    roles = {n.meta.get("dejavu", {}).get("role") for r in rewritten for n in r.graph.graph.nodes}
    assert "sparse_attention" in roles, "no attention block went through the head-sparse lowering"


def test_full_density_logits_within_fp32_tolerance_with_inductor():
    model = tiny_model("llama")
    plan = sparse_plan(model, 1.0, entry_cls=AlwaysSparseEntry)
    prepare_model(model)
    ids = token_ids(2, 1)  # decode-shaped (one token per sequence, no cache): the sparse path
    reports = []
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="dejavu",
                                 options={"plan": plan, "strict": True, "on_report": reports.append})
        got = compiled(ids, use_cache=False).logits
    assert reports[-1].rewritten
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None


def _mlp_lowering(report) -> str:
    targets = {n.target for n in report.graph.graph.nodes if n.op == "call_function"}
    if native.load_ops() and torch.ops.dejavu.cpu_sparse_mlp.default in targets:
        return "native"
    if torch.ops.dejavu.sparse_gated_mlp.default in targets:
        return "op"
    assert torch.nn.functional.embedding_bag in targets, targets
    return "decomposed"


def _expected_lowering(options) -> str:
    """"auto" on CPU fp32: the C++ ops when they build, else the decomposed ops under Inductor and
    the custom op under eager; "op" and "decomposed" as asked."""
    choice = options.get("cpu_lowering", "auto")
    if choice in ("auto", "native") and native.load_ops():
        return "native"
    if choice == "auto":
        return "decomposed" if options["inner"] == "inductor" else "op"
    return "op" if choice == "native" else choice


@pytest.mark.parametrize("batch, fused_op", [(1, False), (3, False), (3, True)])
def test_sparse_decode_matches_masked_reference(batch, fused_op, monkeypatch):
    """Every CPU lowering: the C++ op (auto), the custom op (its C kernel, fp32), the decomposed
    Inductor-fused ops, and with fused_op (C and C++ kernels off) the custom op's own Inductor-fused
    gather (large calls forced on tiny shapes) inside the Inductor-compiled graph."""
    from dejavu_compile.kernels import torch_impl as mlp_mod
    if fused_op:
        monkeypatch.setattr(mlp_mod, "FUSED_MIN_ELEMENTS", 0)
        monkeypatch.setitem(native._STATE, "enabled", False)
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.4)
    ids = token_ids(batch, 1)
    expected = masked_reference_llama(model, plan, ids)
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for options in ({"inner": "eager"}, {"simulate": True, "inner": "eager"},
                        {"inner": "inductor"}, {"inner": "inductor", "cpu_lowering": "op"},
                        {"inner": "inductor", "cpu_lowering": "decomposed"},
                        {"inner": "eager", "cpu_lowering": "op"}):
            torch._dynamo.reset()
            reports = []
            got = torch.compile(model, backend="dejavu", options={
                "plan": plan, "strict": True, "on_report": reports.append, **options})(ids, use_cache=False).logits
            assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None, options
            if options.get("simulate"):
                continue
            assert _mlp_lowering(reports[-1]) == _expected_lowering(options), options
    assert (dense - expected).abs().max() > 1e-3  # the plan really removed something


def test_down_row_sums_split_a_prime_k_into_padded_bags():
    """k = 131 (prime) kept of 262: the down projection's row sums are cut into 4 bags of 33, the
    last padded with weight-0 ids; batch 2, so a bag straddling two rows would show."""
    model = tiny_model("llama", intermediate=262)
    plan = sparse_plan(model, 0.5)
    assert {e.k for e in plan.entries.values() if e.kind == "mlp"} == {131}
    ids = token_ids(2, 1)
    expected = masked_reference_llama(model, plan, ids)
    torch._dynamo.reset()
    reports = []
    with torch.no_grad():
        got = torch.compile(model, backend="dejavu", options={
            "plan": plan, "strict": True, "on_report": reports.append, "cpu_lowering": "decomposed"})(
            ids, use_cache=False).logits
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
    graph = reports[-1].graph.graph
    assert any(n.target is torch.nn.functional.pad for n in graph.nodes)


def _sparse_logits(model, plan, ids, options):
    """Logits of one uncached forward compiled with `plan` (strict), and the backend's last report."""
    torch._dynamo.reset()
    reports = []
    got = torch.compile(model, backend="dejavu", options={
        "plan": plan, "strict": True, "on_report": reports.append, **options})(ids, use_cache=False).logits
    return got, reports[-1]


@pytest.mark.parametrize("batch", [1, 3])
def test_predictor_values_decode_matches_reference(batch):
    """values="predictor": the kept neurons take the int8 predictor's act(g~) * u~ and only their
    down rows are read; every lowering (the C++ op, the aten form under Inductor and eager, the
    masked simulation) computes the reference. F=320 at 40%: k=128."""
    model = tiny_model("llama", intermediate=320)
    plan = int8_plan(model, 0.4)
    ids = token_ids(batch, 1)
    plan.down_rows = "bfloat16"  # calibrate's default: the C++ op reads a bf16 copy of the down rows
    expected = predictor_values_reference(model, plan, ids)
    model_rows = predictor_values_reference(model, plan, ids, "model")  # what the aten form reads
    exact_values = masked_reference_llama(model, int8_plan(model, 0.4, values="exact"), ids)
    with torch.no_grad():
        for options in ({"inner": "eager"}, {"inner": "inductor"}, {"inner": "inductor", "cpu_lowering": "decomposed"},
                        {"simulate": True, "inner": "eager"}):
            got, report = _sparse_logits(model, plan, ids, options)
            want = model_rows if options.get("cpu_lowering") == "decomposed" or not native.load_ops() else expected
            assert describe_difference("logits", got, want, rtol=1e-4, atol=1e-4) is None, options
            graph = report.graph.graph
            targets = {n.target for n in graph.nodes if n.op == "call_function"}
            fused = torch.ops.dejavu.cpu_glu_int8_mlp.default in targets if native.load_ops() else False
            assert fused == (native.load_ops() and not options.get("simulate")
                             and options.get("cpu_lowering", "auto") == "auto"), options
            # outside the simulation, no node reads the fp32 gate or up weights
            readers = [n for n in graph.nodes if n.op != "placeholder"
                       and any(("gate_proj" in a.name or "up_proj" in a.name) for a in n.all_input_nodes)]
            assert options.get("simulate") or not readers, (options, readers)
    # int8 values differ from exact ones, bf16 down rows from the model's: the references tell them apart
    assert (exact_values - model_rows).abs().max() > 1e-4
    assert describe_difference("logits", model_rows, expected, rtol=1e-4, atol=1e-4) is not None


@pytest.mark.parametrize("batch", [1, 3])
def test_int8_predictor_decode_matches_masked_reference(batch):
    """The int8 predictor in the graph (fused int8 reduction under Inductor on CPU, a matmul
    elsewhere) selects what the plan's own scores select. F=320 at 40%: k=128, so the CPU lowering
    splits the down projection's row sum into 4 bags."""
    model = tiny_model("llama", intermediate=320)
    plan = int8_plan(model, 0.4, values="exact")
    for options, _, predictors in _graphs_matching_masked_reference(model, plan, token_ids(batch, 1)):
        assert predictors and not any(n.meta["dejavu"]["lookahead"] for n in predictors)
        # on CPU fp32 with the C++ ops: scoring and top-k in one call, in the simulation too
        fused = all(n.target is torch.ops.dejavu.cpu_glu_int8_topk.default for n in predictors)
        assert fused == native.load_ops(), options


def _graphs_matching_masked_reference(model, plan, ids) -> list:
    """Decode `ids` under `plan` with eager, Inductor and the masked simulation; each must give the
    masked reference's logits, which must differ from dense. Returns (options, graph, predictor
    nodes) of each, for the caller's checks on what the graph holds."""
    expected = masked_reference_llama(model, plan, ids)
    out = []
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for options in ({"inner": "eager"}, {"inner": "inductor"}, {"simulate": True, "inner": "eager"}):
            got, report = _sparse_logits(model, plan, ids, options)
            assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None, options
            graph = report.graph.graph
            predictors = [n for n in graph.nodes if n.meta.get("dejavu", {}).get("role") == "predictor"]
            out.append((options, graph, predictors))
    assert (dense - expected).abs().max() > 1e-3  # the plan really removed something
    return out


def _int4_plan(model, density, lookahead):
    """The learned int4 predictor fitted to random block inputs (with lookahead, to "attention
    inputs" from which the block inputs are a noisy linear map, so the fitted rows and biases matter)."""
    from dejavu_compile.plan.predictors.glu_int4 import fit_int4_glu_predictor

    gen = torch.Generator().manual_seed(0)
    d = model.config.hidden_size
    entries = {}
    for layer, block in enumerate(model.model.layers):
        mlp = block.mlp
        x_in = torch.randn(512, d, generator=gen)
        x_block = (x_in @ torch.randn(d, d, generator=gen) / d ** 0.5 + 0.1 * torch.randn(512, d, generator=gen)
                   + 0.5 if lookahead else None)
        t = fit_int4_glu_predictor(x_in, mlp.gate_proj.weight, mlp.up_proj.weight, x_block=x_block)
        total = mlp.gate_proj.weight.shape[0]
        entries[(layer, "mlp")] = PlanEntry(layer, "mlp", max(1, round(total * density)), total, "glu_int4", t,
                                            "silu", lookahead=lookahead)
    return SparsityPlan(entries, model_fingerprint(model))


@pytest.mark.parametrize("batch, lookahead", [(1, False), (3, True)])
def test_int4_predictor_decode_matches_masked_reference(batch, lookahead):
    """The learned int4 predictor in the graph (codes unpacked and scaled by aten ops, then a
    matmul) selects what the plan's own scores select, with and without lookahead; the packed
    codes, not fp32 rows, are what the graph holds."""
    model = tiny_model("llama", intermediate=320)
    plan = _int4_plan(model, 0.4, lookahead)
    assert ("bias" in plan.entry(0, "mlp").tensors) == lookahead
    for options, graph, predictors in _graphs_matching_masked_reference(model, plan, token_ids(batch, 1)):
        assert len(predictors) == 2 and all(n.meta["dejavu"]["lookahead"] == lookahead for n in predictors)
        consts = [n for n in graph.nodes if n.op == "placeholder" and n.name.endswith("_codes")]
        assert len(consts) == 2 and all(n.meta["example_value"].dtype == torch.uint8 for n in consts), options


def test_simulation_is_per_token_on_prefill():
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.3)
    ids = token_ids(2, 7)
    expected = masked_reference_llama(model, plan, ids)
    with torch.no_grad():
        got = torch.compile(model, backend="dejavu", options={"plan": plan, "simulate": True, "inner": "eager"})(
            ids, use_cache=False).logits
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None


def test_lookahead_predictor_reads_the_previous_blocks_input():
    model = tiny_model("llama", layers=3)
    plan = sparse_plan(model, 0.5)
    reports = []
    with torch.no_grad():
        torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager", "on_report": reports.append})(
            token_ids(1, 1), use_cache=False)
    report = reports[-1]
    graph_nodes = list(report.graph.graph.nodes)
    position = {n: i for i, n in enumerate(graph_nodes)}
    predictors = [n for n in graph_nodes if n.meta.get("dejavu", {}).get("role") == "predictor"]
    assert len(predictors) == 3
    attention_inputs = {b.layer: b.nodes.input.name for b in report.match.attention}
    for node in predictors:
        meta = node.meta["dejavu"]
        assert meta["lookahead"] and meta["reads"] == attention_inputs[meta["layer"]]
        # Scheduled beside the attention block: before that layer's attention output projection.
        o_proj = next(n for n in graph_nodes if n.op == "call_function" and "o_proj" in str(n.args[1:2])
                      and f"layers_modules_{meta['layer']}_" in str(n.args[1]))
        assert position[node] < position[o_proj]


def test_prefill_and_large_batches_stay_dense():
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.5)
    reports = []
    with torch.no_grad():
        compiled = torch.compile(model, backend="dejavu",
                                 options={"plan": plan, "inner": "eager", "on_report": reports.append})
        for ids in (token_ids(1, 5), token_ids(9, 1)):
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    reasons = [r.dense_reason for r in reports]
    assert any("prefill" in (r or "") for r in reasons) and any("max_batch" in (r or "") for r in reasons)


def test_plan_for_another_model_is_a_clear_error():
    small = tiny_model("llama", intermediate=96)
    other = tiny_model("llama")
    plan = sparse_plan(small, 0.5)
    with pytest.raises(ValueError, match="96 neurons"):
        with torch.no_grad():
            torch.compile(other, backend="dejavu", options={"plan": plan, "inner": "eager"})(
                token_ids(1, 1), use_cache=False)
    assert issubclass(PlanMismatchError, ValueError)


def test_predictor_values_need_the_int8_predictor_and_no_gate_biases():
    """values="predictor" on a low-rank entry: a clear error before compiling. On a block with
    gate/up biases (the int8 rows leave them out): exact values, and the report says why."""
    model = tiny_model("llama", intermediate=96)
    plan = sparse_plan(model, 0.5)
    for entry in plan.entries.values():
        entry.values = "predictor"
    with pytest.raises(PlanMismatchError, match="values 'predictor' needs the int8"):
        with torch.no_grad():
            torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager"})(
                token_ids(1, 1), use_cache=False)
    biased = tiny_model("llama", intermediate=96, mlp_bias=True)
    plan = int8_plan(biased, 0.5)
    ids = token_ids(1, 1)
    with torch.no_grad():
        got, report = _sparse_logits(biased, plan, ids, {})
    expected = masked_reference_llama(biased, int8_plan(biased, 0.5, values="exact"), ids)
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
    assert any("biases" in why for _, why in report.match.fallbacks)


def test_predictor_dtype_follows_the_model():
    model = tiny_model("llama").to(torch.bfloat16)
    plan = sparse_plan(model, 1.0, entry_cls=AlwaysSparseEntry)
    ids = token_ids(1, 1)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager", "strict": True})(
            ids, use_cache=False).logits
    assert got.dtype == torch.bfloat16
    assert describe_difference("logits", got, expected, rtol=3e-2, atol=3e-2) is None


def test_prepare_model_relays_out_in_place_without_changing_results():
    model = tiny_model("llama")
    ids = token_ids()
    with torch.no_grad():
        before = model(ids).logits
    changed = prepare_model(model)
    assert sorted(changed) == sorted([f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] +
                                     [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)])
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.t().is_contiguous() and weight.shape == (64, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert prepare_model(model) == []  # idempotent


def test_report_counts_the_memory_the_graph_adds():
    """extra_bytes: the predictors, the head-row tables, and the transposed weight copies that
    prepare_model makes unnecessary."""
    model = tiny_model("llama")
    plan = sparse_plan(model, 0.5, attn_density=0.5)

    def extra_bytes():
        reports = []
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="dejavu", options={"plan": plan, "inner": "eager", "strict": True,
                                                            "on_report": reports.append})(
                token_ids(1, 1), use_cache=False)
        return reports[-1].extra_bytes

    before = extra_bytes()
    prepare_model(model)
    after = extra_bytes()
    copies = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if "down_proj" in name or "o_proj" in name)
    predictors = sum(e.read_bytes(4) for e in plan.entries.values() if not e.dense)
    head_tables = 2 * 4 * 16 * 8  # per layer: (heads, head_dim) int64 query-row ids
    assert after == predictors + head_tables
    assert before == after + copies


def test_added_inputs_reach_inductor_as_fixed_shape_fakes():
    """Predictor tensors a pass adds go to Inductor as fake tensors of fixed shape in Dynamo's fake
    mode: as real tensors AOTAutograd gave them symbolic sizes in dynamic graphs, and Inductor's
    guards on those sizes (reshaping the int4 codes) broke Dynamo's guard building on SmolLM2
    (IndexError in produce_guards; a tiny model did not reproduce it). Outside tracing: unchanged."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dejavu_compile.compiler.backend import _static_examples

    codes = torch.zeros(6, 16, dtype=torch.uint8)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with tracing(TracingContext(mode)):
        (fake,) = _static_examples([codes])
    assert isinstance(fake, FakeTensor) and fake.fake_mode is mode
    assert fake.dtype == torch.uint8 and all(type(size) is int for size in fake.shape) and fake.shape == codes.shape
    assert _static_examples([codes])[0] is codes


def test_plans_compile_under_inductors_cpp_wrapper():
    """Inductor's cpp_wrapper takes the graph's example inputs from the placeholders' "val" metadata
    as soon as one placeholder carries it. Dynamo's placeholders carry none, so the predictor tensors
    a pass adds must not either: otherwise every parameter reaches AOT tracing as None."""
    model = tiny_model("llama", intermediate=320)
    plan = int8_plan(model, 0.4)
    ids = token_ids(1, 1)
    expected = predictor_values_reference(model, plan, ids)
    with torch.no_grad():
        got, report = _sparse_logits(model, plan, ids, {"inductor_config": {"cpp_wrapper": True}})
    assert report.extra_bytes > 0 and report.rewritten  # the predictors travel as added inputs
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
