"""greedy_decode gives generate()'s greedy tokens over a static cache, eager and compiled."""
from __future__ import annotations

import pytest
import torch

import dejavu_compile
from dejavu_compile.testing import greedy_generate
from dejavu_compile.testing.tiny import tiny_model

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_same_tokens_as_generate(arch):
    model = tiny_model(arch, layers=2)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    expected = greedy_generate(model, ids, new_tokens=7, cache="static")
    assert torch.equal(dejavu_compile.greedy_decode(model, ids, 7), expected)


def test_same_tokens_compiled_with_the_backend():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(1))
    expected = greedy_generate(model, ids, new_tokens=6, cache="static")
    original = model.forward
    model.forward = torch.compile(original, backend="dejavu", options={"inner": "eager", "mlp_density": 1.0})
    try:
        actual = dejavu_compile.greedy_decode(model, ids, 6)
    finally:
        model.forward = original
        torch._dynamo.reset()
    assert torch.equal(actual, expected)


def test_stops_at_eos_and_pads_finished_sequences():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 100, (2, 3), generator=torch.Generator().manual_seed(2))
    free = dejavu_compile.greedy_decode(model, ids, 6)
    eos = int(free[0, 4])  # the first sequence's second new token
    out = dejavu_compile.greedy_decode(model, ids, 6, eos_token_id=eos)
    assert torch.equal(out[0, :5], free[0, :5]) and bool((out[0, 5:] == eos).all())
    if not bool((free[1, 3:] == eos).any()):  # the other sequence never stops: it runs to the end
        assert out.shape[1] == 9 and torch.equal(out[1], free[1])


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(input_ids=torch.zeros(1, 0, dtype=torch.long))])
def test_bad_arguments_are_named(bad):
    model = tiny_model("llama", layers=1)
    kwargs = {"input_ids": torch.tensor([[5, 6]]), "max_new_tokens": 2, **bad}
    with pytest.raises(ValueError, match="max_new_tokens|input_ids"):
        dejavu_compile.greedy_decode(model, kwargs["input_ids"], kwargs["max_new_tokens"])
