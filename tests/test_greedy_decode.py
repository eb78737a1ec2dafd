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


def test_skipped_guards_give_the_same_tokens_and_only_after_a_step_compiled_nothing(monkeypatch):
    """skip_guards: the same tokens, with the guards skipped from the third decode step on, and kept
    in a call whose second decode step compiled a graph."""
    from dejavu_compile.evaluation import decode

    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(3))
    expected = greedy_generate(model, ids, new_tokens=6, cache="static")
    stances = []
    set_stance = torch.compiler.set_stance

    def recording_set_stance(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe"))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording_set_stance)
    original = model.forward
    model.forward = torch.compile(original, backend="dejavu", options={"inner": "eager"})
    try:
        first = dejavu_compile.greedy_decode(model, ids, 6, skip_guards=True)  # compiles prefill, then decode
        longer = dejavu_compile.greedy_decode(model, torch.cat([ids, ids], 1), 6, skip_guards=True)  # a new prefill
        assert stances == [True, True]
        graphs = iter(range(100))
        monkeypatch.setattr(decode, "_compiled_graphs", lambda: next(graphs))  # as if every step compiled
        third = dejavu_compile.greedy_decode(model, ids, 6, skip_guards=True)
        assert stances == [True, True]
    finally:
        model.forward = original
        torch._dynamo.reset()
    assert torch.equal(first, expected) and torch.equal(third, expected)
    assert torch.equal(longer, greedy_generate(model, torch.cat([ids, ids], 1), new_tokens=6, cache="static"))
