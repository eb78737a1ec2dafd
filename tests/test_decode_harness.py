"""The decode-timing harness every benchmark uses: variants interleaved, the warm-up's tokens kept,
shared compiled forwards, variants with their own model, outside runtimes, and a compiled variant
that compiled nothing refused."""
from __future__ import annotations

import statistics

import pytest
import torch

from dejavu_compile.evaluation.bench import Variant, compiled_forward, measure_decode
from dejavu_compile.evaluation.decode import greedy_decode
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import token_ids


@pytest.fixture
def model():
    torch._dynamo.reset()
    m = tiny_model("llama", layers=1)
    m.generation_config.eos_token_id = None  # every run decodes exactly the tokens asked for
    return m


def test_every_variant_decodes_the_same_tokens_and_shares_what_it_is_given(model, monkeypatch):
    from dejavu_compile.evaluation import decode

    cache_lens = []
    monkeypatch.setattr(decode, "greedy_decode", lambda *a, max_cache_len=None, **kw: cache_lens.append(
        max_cache_len) or greedy_decode(*a, max_cache_len=max_cache_len, **kw))
    ids = token_ids(tokens=4)
    with torch.no_grad():
        want = greedy_decode(model, ids, 5)
    runs = []

    def outside(n):  # a peer runtime: its own call, its own tokens
        runs.append(n)
        return greedy_decode(model, ids, n)[0, ids.shape[1]:].tolist()

    compiled = compiled_forward("eager")
    variants = [Variant("eager"), Variant("compiled", compiled),
                Variant("compiled, greedy_decode", compiled, loop="greedy_decode", max_cache_len=64),
                Variant("outside", run=outside)]
    speed = measure_decode(model, ids, variants, new_tokens=5, repeats=2, progress=False)
    assert list(speed) == [v.name for v in variants]
    for v in variants[:3]:
        assert torch.equal(v.outputs, want), v.name
    assert variants[3].outputs == want[0, ids.shape[1]:].tolist()
    assert runs == [1, 5] * 3  # the warm-up round, then two timed rounds, interleaved
    assert cache_lens == [64] * 6  # the greedy_decode variant's 3 rounds of 1 and 5 tokens, its cache as asked
    # one rate per timed round, their median reported (not their sign: on a one-layer model a round's
    # five tokens can take less than another round's one under a loaded machine)
    for row in speed.values():
        assert len(row["runs"]) == 2 and row["tokens_per_s"] == statistics.median(row["runs"])
    assert speed["compiled"]["graphs"] >= 1 and speed["eager"]["graphs"] == 0
    assert model.forward.__func__ is type(model).forward  # the model's own forward is back


def test_a_variant_decodes_its_own_model_with_its_own_compiled_forward(model):
    other = tiny_model("llama", layers=2, seed=1)  # another depth, so graphs of its own; other tokens
    other.generation_config.eos_token_id = None
    ids = token_ids(tokens=4)
    with torch.no_grad():
        want, want_other = greedy_decode(model, ids, 5), greedy_decode(other, ids, 5)
    assert not torch.equal(want, want_other)
    compiled = compiled_forward("eager")  # one wrap for both models: each gets its own compiled forward
    variants = [Variant("compiled", compiled), Variant("other, compiled", compiled, model=other),
                Variant("other, eager", model=other)]
    speed = measure_decode(model, ids, variants, new_tokens=5, repeats=1, progress=False)
    assert torch.equal(variants[0].outputs, want)
    assert torch.equal(variants[1].outputs, want_other) and torch.equal(variants[2].outputs, want_other)
    assert speed["other, compiled"]["graphs"] >= 1 and speed["other, eager"]["graphs"] == 0
    for m in (model, other):
        assert m.forward.__func__ is type(m).forward


def test_a_compiled_variant_that_compiles_nothing_is_refused(model):
    variants = [Variant("claims to compile", lambda forward: forward)]
    with pytest.raises(RuntimeError, match="compiled no graph"):
        measure_decode(model, token_ids(tokens=4), variants, new_tokens=3, repeats=1, progress=False)
    assert not torch._dynamo.config.error_on_recompile


def test_a_cache_length_is_for_the_greedy_loops():
    with pytest.raises(ValueError, match="max_cache_len"):
        Variant("generate", loop="generate", max_cache_len=64)


def test_one_new_token_is_refused(model):
    with pytest.raises(ValueError, match="new_tokens"):
        measure_decode(model, token_ids(), [Variant("eager")], new_tokens=1)


def test_one_wrap_gives_each_forward_the_options_it_was_given(model):
    # torch.compile pops guard_filter_fn out of its options: a shared dict would lose it after one compile
    other = tiny_model("llama", layers=2, seed=1)
    other.generation_config.eos_token_id = None
    filtered = []

    def keep_every_guard(entries):
        filtered.append(len(entries))
        return [True] * len(entries)

    options = {"guard_filter_fn": keep_every_guard}
    compiled = compiled_forward("dejavu", options=options)
    variants = [Variant("compiled", compiled), Variant("other, compiled", compiled, model=other)]
    measure_decode(model, token_ids(tokens=4), variants, new_tokens=3, repeats=1, progress=False)
    assert options == {"guard_filter_fn": keep_every_guard}
    # a prefill and a decode graph per model, each frame's guards through the filter
    assert len(filtered) >= 4 and all(n > 0 for n in filtered)
