"""Library calls leave the user's state alone: the global RNG, and Dynamo's compiled functions."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import token_ids


def _assert_rng_untouched(call):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    call()
    assert torch.equal(torch.get_rng_state(), before), "the global RNG state changed"


def test_explain_leaves_the_global_rng_alone():
    from dejavu_compile import explain

    model = tiny_model("llama")
    _assert_rng_untouched(lambda: explain(model, token_ids(1, 3)))


def test_compiling_and_running_leaves_the_global_rng_alone():
    model = tiny_model("llama")

    def run():
        with torch.no_grad():
            torch.compile(model, backend="dejavu", options={"inner": "eager"})(token_ids(1, 3), use_cache=False)

    _assert_rng_untouched(run)


def test_matching_a_graph_leaves_the_global_rng_alone():
    """The MLP rule probes activations with random values; Dynamo restores the RNG around a compile,
    but the matcher also runs on graphs outside one (here, a graph captured earlier)."""
    from dejavu_compile.compiler.passes.match import match_blocks

    model = tiny_model("llama")
    graphs = []

    def capture(gm, example_inputs, **_):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(token_ids(1, 3), use_cache=False)
    results = []
    _assert_rng_untouched(lambda: results.append(match_blocks(graphs[0])))
    assert len(results[0].mlp) == model.config.num_hidden_layers


def test_training_a_predictor_leaves_the_global_rng_alone():
    from dejavu_compile.plan.predictors.twolayer import train_predictor

    gen = torch.Generator().manual_seed(0)
    x, importance = torch.randn(64, 16, generator=gen), torch.rand(64, 32, generator=gen)
    first = train_predictor(x, importance, 8, rank=4, steps=3).tensors()
    _assert_rng_untouched(lambda: train_predictor(x, importance, 8, rank=4, steps=3))
    again = train_predictor(x, importance, 8, rank=4, steps=3).tensors()  # still seeded by `seed`
    assert all(torch.equal(first[n], again[n]) for n in first)


def test_calibrating_a_plain_mlp_model_leaves_the_global_rng_alone():
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

    model = tiny_model("opt")
    batches = [token_ids(1, 24, seed) for seed in range(2)]
    samples, _ = collect(model, batches, progress=False)
    plans = []
    _assert_rng_untouched(lambda: plans.append(calibrate(model, None, samples=samples, mlp_density=0.5,
                                                         train_steps=3, progress=False)))
    assert {e.predictor for e in plans[0].entries.values() if not e.dense} == {"twolayer"}


def _user_function():
    """A user's compiled function, unrelated to the model, and its compile counter."""
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def scaled_sine(x):
        return torch.sin(x) * 2

    return scaled_sine, counter


def test_prepare_model_does_not_reset_the_users_compiled_functions():
    from dejavu_compile.compiler.prepare import prepare_model

    fn, counter = _user_function()
    x = torch.randn(8)
    fn(x)
    prepare_model(tiny_model("llama"))
    fn(x)
    assert counter.frame_count == 1


def test_model_compiled_before_prepare_model_recompiles_on_the_new_layout():
    from dejavu_compile.compiler.prepare import prepare_model

    model = tiny_model("llama")
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    ids = token_ids(1, 3)
    with torch.no_grad():
        compiled(ids, use_cache=False)
        assert prepare_model(model)
        got = compiled(ids, use_cache=False).logits
        expected = model(ids, use_cache=False).logits
    assert counter.frame_count == 2  # the strides changed: Dynamo's guards recompiled
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_perplexity_does_not_reset_the_users_compiled_functions():
    from dejavu_compile.evaluation.perplexity import perplexity
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    model = tiny_model("llama")
    fn, counter = _user_function()
    x = torch.randn(8)
    fn(x)
    chunks = [token_ids(1, 12, seed) for seed in range(2)]
    dense = perplexity(model, chunks)
    plan = SparsityPlan.dense(model)
    for _ in range(10):  # more evaluations than Dynamo's recompile limit of one code object
        assert perplexity(model, chunks, plan) == pytest.approx(dense, rel=1e-5)
    fn(x)
    assert counter.frame_count == 1
