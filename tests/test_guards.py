"""Compiled graphs refuse model tensors they were not compiled for (compiler/weight_watch.py's
StoredTensorCheck): with Dynamo's module guards dropped (guard_filter_fn), a model cast after compiling
or another model of the same class would otherwise run a graph built for other tensors. With the
guards kept, the same changes recompile as before. Tiny random-weight LLaMA models, eager inner
compiler."""
import pytest
import torch

from dejavu_compile.compiler.weight_watch import StoredTensorCheck, stored_tensor_positions
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import decode_logits, greedy_step_tokens, token_ids

SKIP_MODULE_GUARDS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


@pytest.fixture
def model():
    m = tiny_model("llama", layers=2)
    yield m
    torch._dynamo.reset_code(type(m).forward.__code__)  # each test's graphs go with it


@pytest.mark.parametrize("density", [None, 0.5], ids=["exact", "mlp_density 0.5"])
def test_a_cast_after_compiling_without_module_guards_is_refused(model, density):
    options = {"inner": "eager", **({} if density is None else {"mlp_density": density})}
    forward = torch.compile(model.forward, backend="dejavu", options={**options, **SKIP_MODULE_GUARDS})
    ids = token_ids(tokens=5)
    decode_logits(forward, model, ids, greedy_step_tokens(model, ids, 1))
    model.to(torch.bfloat16)  # no guard notices: the fp32 graph is called with bf16 weights
    with pytest.raises(RuntimeError, match=r"compiled for a model tensor of dtype torch.float32.*"
                                           r"called with one of dtype torch.bfloat16"):
        decode_logits(forward, model, ids, greedy_step_tokens(model, ids, 1))


def test_another_model_of_the_same_class_without_module_guards_is_refused(model):
    wider = tiny_model("llama", layers=2, hidden=96, intermediate=192, seed=1)
    ids = token_ids(tokens=5)
    forward = torch.compile(model.forward, backend="dejavu", options={"inner": "eager", **SKIP_MODULE_GUARDS})
    decode_logits(forward, model, ids, greedy_step_tokens(model, ids, 1))
    # one code object, one set of graphs: without the module guards the wider model finds the first one's
    other = torch.compile(wider.forward, backend="dejavu", options={"inner": "eager", **SKIP_MODULE_GUARDS})
    with pytest.raises(RuntimeError, match=r"shape \[128, 64\].*shape \[128, 96\]"):
        decode_logits(other, wider, ids, greedy_step_tokens(wider, ids, 1))


def test_with_the_guards_kept_a_cast_recompiles(model):
    forward = torch.compile(model.forward, backend="dejavu", options={"inner": "eager"})
    ids = token_ids(tokens=5)
    decode_logits(forward, model, ids, greedy_step_tokens(model, ids, 1))
    model.to(torch.bfloat16)
    tokens = greedy_step_tokens(model, ids, 2)
    got = decode_logits(forward, model, ids, tokens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, decode_logits(model, model, ids, tokens), rtol=2e-2, atol=2e-2)


def test_the_check_samples_the_stored_tensors_from_first_to_last(model):
    graphs = []

    def keep(gm, example_inputs):  # the inputs' sources are read while the graph compiles, as the backend does
        inputs = list(example_inputs)
        graphs.append((inputs, stored_tensor_positions(gm, inputs), StoredTensorCheck(gm, inputs, samples=3)))
        return gm.forward

    torch.compile(model.forward, backend=keep)(token_ids(tokens=5))
    inputs, stored, check = graphs[0]
    weights = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {id(inputs[i]) for i in stored} == {id(t) for t in inputs if id(t) in weights}  # the model's, no other
    assert check.positions[0] == stored[0] and check.positions[-1] == stored[-1]
    assert 3 <= len(check.positions) <= 4 < len(stored)
    check.check(inputs)  # what it was built from passes
    moved = list(inputs)
    moved[check.positions[1]] = inputs[check.positions[1]].to(torch.float16)
    with pytest.raises(RuntimeError, match="torch.float16"):
        check.check(moved)
