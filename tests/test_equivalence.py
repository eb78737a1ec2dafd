"""The dejavu backend without a plan computes exactly what eager computes, with no graph breaks."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import dejavu_compile
from dejavu_compile.testing import assert_matches_eager, describe_difference, greedy_generate
from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model
from tests.helpers import token_ids


def _generate(model, ids, cache, compiled_options=None):
    return greedy_generate(model, ids, 16, cache, compiled_options)


@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compiled_matches_eager(arch, inner):
    model = tiny_model(arch)
    ids = token_ids()
    counters.clear()
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend="dejavu", fullgraph=True, options={"inner": inner})
        got = compiled(ids).logits
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None

    for cache in ("dynamic", "static"):
        reference = _generate(model, ids, cache)
        tokens = _generate(model, ids, cache, compiled_options={"inner": inner})
        assert describe_difference(f"tokens ({cache} cache)", tokens, reference, 0, 0) is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    # prefill + decode, and for DynamicCache one recompile with a dynamic length: never one per step.
    assert counters["stats"]["unique_graphs"] <= 6


def test_assert_matches_eager_helper_passes_and_fails_readably():
    model = tiny_model("llama", layers=1)
    ids = token_ids()
    assert_matches_eager(model, ids, dejavu_options={"inner": "eager"})
    assert_matches_eager(model.generate, ids, max_new_tokens=4, do_sample=False,
                         dejavu_options={"inner": "eager"})

    # A backend that perturbs the graph must be caught, with a diff that says where.
    from dejavu_compile.compiler import backend

    original = backend.DejavuBackend.run_passes

    def perturb(self, gm, example_inputs, opts, report):
        for node in gm.graph.nodes:
            if node.op == "output":
                with gm.graph.inserting_before(node):
                    logits = node.args[0][-1] if isinstance(node.args[0], (tuple, list)) else node.args[0]
                    bumped = gm.graph.call_function(torch.add, (logits, 1e-2))
                node.args = (tuple(bumped if a is logits else a for a in node.args[0]),) \
                    if isinstance(node.args[0], (tuple, list)) else (bumped,)
        gm.recompile()
        return gm

    backend.DejavuBackend.run_passes = perturb
    try:
        torch._dynamo.reset()
        with pytest.raises(AssertionError, match=r"max abs diff 1\.000e-02"):
            assert_matches_eager(model, ids, dejavu_options={"inner": "eager"})
    finally:
        backend.DejavuBackend.run_passes = original


def test_pytest_plugin_fixture(dejavu_equivalence):
    """The fixture users get from ``pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]``."""
    model = tiny_model("gpt2", layers=1)
    dejavu_equivalence(model, token_ids(), dejavu_options={"inner": "eager"})
    with pytest.raises(AssertionError, match="shape"):
        dejavu_equivalence(lambda ids: model(ids).logits[:, :-1] if torch.compiler.is_compiling()
                           else model(ids).logits, token_ids(), dejavu_options={"inner": "eager"})


def test_mode_reduce_overhead_is_accepted():
    """transformers' CompileConfig sends mode="reduce-overhead" (CUDA graphs; a no-op on CPU)."""
    model = tiny_model("qwen2", layers=1)
    ids = token_ids()
    with torch.no_grad():
        got = torch.compile(model, backend="dejavu", mode="reduce-overhead")(ids)
        torch.testing.assert_close(got.logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_compile_config_in_generate():
    from transformers import CompileConfig

    model = tiny_model("llama", layers=1)
    ids = token_ids()
    reference = _generate(model, ids, "static")
    reports = []
    # torch.compile takes mode or options, not both: CompileConfig's default mode must be cleared.
    config = CompileConfig(backend="dejavu", fullgraph=True, mode=None,
                           options={"inner": "eager", "on_report": reports.append})
    config._compile_all_devices = True  # transformers compiles on CPU only when asked to
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                cache_implementation="static", compile_config=config)
    assert torch.equal(tokens, reference)
    assert reports and all(r.match.attention for r in reports)  # the backend really ran


# ----------------------------------------------------------------------------------------------
# Property test: random small LLaMA-family and OPT-family configs.

llama_family = st.fixed_dictionaries({
    "arch": st.sampled_from(["llama", "mistral", "qwen2"]),
    "layers": st.integers(1, 3),
    "head_dim": st.sampled_from([8, 16]),
    "heads": st.sampled_from([1, 2, 4]),
    "kv_div": st.sampled_from([1, 2, 4]),
    "intermediate": st.integers(8, 96),
    "hidden_act": st.sampled_from(["silu", "gelu_pytorch_tanh", "relu", "gelu"]),
    "bias": st.booleans(),
})

opt_family = st.fixed_dictionaries({
    "arch": st.just("opt"),
    "layers": st.integers(1, 3),
    "head_dim": st.sampled_from([8, 16]),
    "heads": st.sampled_from([1, 2, 4]),
    "intermediate": st.integers(8, 96),
    "hidden_act": st.sampled_from(["relu", "gelu"]),
    "bias": st.booleans(),
})


def _random_model(spec):
    hidden = spec["head_dim"] * spec["heads"]
    if spec["arch"] == "opt":
        return tiny_model("opt", layers=spec["layers"], hidden=hidden, heads=spec["heads"],
                          intermediate=spec["intermediate"], activation_function=spec["hidden_act"],
                          enable_bias=spec["bias"])
    kv = max(1, spec["heads"] // spec["kv_div"])
    extra = {"hidden_act": spec["hidden_act"]}
    if spec["arch"] == "llama":
        extra.update(attention_bias=spec["bias"], mlp_bias=spec["bias"])
    return tiny_model(spec["arch"], layers=spec["layers"], hidden=hidden, heads=spec["heads"], kv_heads=kv,
                      intermediate=spec["intermediate"], **extra)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.one_of(llama_family, opt_family), batch=st.integers(1, 3), tokens=st.integers(1, 7))
def test_random_configs_match_and_compile_like_eager(spec, batch, tokens):
    torch._dynamo.reset()
    model = _random_model(spec)
    ids = token_ids(batch, tokens, seed=tokens)
    report = dejavu_compile.explain(model, ids)
    layers = spec["layers"]
    assert (report.num_layers, report.mlp_matched, report.attention_matched) == (layers, layers, layers), \
        str(report)
    gated = spec["arch"] != "opt"
    assert all(b.gated == gated for b in report.blocks if b.kind == "mlp")
    torch._dynamo.reset()
    assert_matches_eager(model, ids, dejavu_options={"inner": "eager"})
