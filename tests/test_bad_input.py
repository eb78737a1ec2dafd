"""Reliability: each bad input a user can give gets a clear error, and each good path next to it
stays exact. Tiny random-weight LLaMA models (2 layers, hidden 64, MLP 128), eager inner compiler."""
import json
import os
import stat

import pytest
import torch

from dejavu_compile.compiler import backend as backend_module
from dejavu_compile.compiler.isolated import isolated_compile
from dejavu_compile.errors import DejavuOptionError, PlanMismatchError
from dejavu_compile.plan.sparsity_plan import SparsityPlan
from dejavu_compile.testing import assert_matches_eager
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import ByteTokenizer, decode_logits, fine_tuned, greedy_step_tokens, int8_plan, token_ids


def _fresh_compile_logits(model, options, ids, tokens):
    """Decode logits of ``model`` compiled from scratch with ``options`` (its own code object)."""
    with isolated_compile(model, "fresh_compile", backend="dejavu", options=options) as forward:
        return decode_logits(forward, model, ids, tokens)


# ---------------------------------------------------------------------------- weights changed after compiling

def _edit_in_place(model, other):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(-3.0)
            layer.mlp.gate_proj.weight.add_(1.0)


def _load_other_checkpoint(model, other):
    model.load_state_dict(other.state_dict())


def _assign_new_parameter(model, other):
    for mine, theirs in zip(model.model.layers, other.model.layers):
        mine.mlp.gate_proj.weight = torch.nn.Parameter(theirs.mlp.gate_proj.weight.detach().clone())
        mine.mlp.up_proj.weight.data = theirs.mlp.up_proj.weight.detach().clone()


@pytest.mark.parametrize("skip_module_guards", [False, True], ids=["guards kept", "module guards skipped"])
@pytest.mark.parametrize("change", [_load_other_checkpoint, _edit_in_place, _assign_new_parameter])
def test_weights_changed_after_compiling_mlp_density_derives_its_copies_again(change, skip_module_guards):
    """The training-free plan's int8 gate/up copies follow the weights: after a change, the compiled
    function gives what a fresh compile on the new weights gives (the same neurons, the same values).
    Also with Dynamo's guards on the modules dropped (torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    benchmarks/module_guards.py): the backend's own check of the weights does not rest on them."""
    model, other = tiny_model("llama", layers=2), tiny_model("llama", layers=2, seed=1)
    ids = token_ids(tokens=5)
    options = {"mlp_density": 0.6, "inner": "eager", "strict": True}
    tokens = greedy_step_tokens(model, ids, 3)
    guard_filter = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if skip_module_guards else {}
    forward = torch.compile(model.forward, backend="dejavu", options={**options, **guard_filter})
    try:
        before = decode_logits(forward, model, ids, tokens)
        torch.testing.assert_close(before, _fresh_compile_logits(model, options, ids, tokens), rtol=1e-5, atol=1e-5)
        change(model, other)
        after = decode_logits(forward, model, ids, tokens)
        fresh = _fresh_compile_logits(model, options, ids, tokens)
        assert (fresh - before).abs().max() > 1e-2  # the change matters to the logits
        torch.testing.assert_close(after, fresh, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset_code(type(model).forward.__code__)


def test_weights_changed_after_compiling_a_calibrated_plan_is_refused():
    model = tiny_model("llama", layers=2)
    plan = int8_plan(model, 0.5)
    ids = token_ids(tokens=5)
    tokens = greedy_step_tokens(model, ids, 2)
    forward = torch.compile(model.forward, backend="dejavu", options={"plan": plan, "inner": "eager", "strict": True})
    try:
        decode_logits(forward, model, ids, tokens)
        model.load_state_dict(fine_tuned(model).state_dict())
        with pytest.raises(PlanMismatchError, match="weights differ from the ones the plan was calibrated on"):
            decode_logits(forward, model, ids, tokens)
    finally:
        torch._dynamo.reset_code(type(model).forward.__code__)


def test_weights_changed_without_a_plan_stay_exact():
    model, other = tiny_model("llama", layers=2), tiny_model("llama", layers=2, seed=1)
    ids = token_ids(tokens=5)
    forward = torch.compile(model.forward, backend="dejavu", options={"inner": "eager"})
    try:
        model.load_state_dict(other.state_dict())
        tokens = greedy_step_tokens(model, ids, 3)
        torch.testing.assert_close(decode_logits(forward, model, ids, tokens), decode_logits(model, model, ids, tokens),
                                   rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset_code(type(model).forward.__code__)


# ---------------------------------------------------------------------------- plan files

def _saved_plan(tmp_path):
    model = tiny_model("llama", layers=2)
    int8_plan(model, 0.5).save(tmp_path)
    return model, json.loads((tmp_path / "plan.json").read_text())


def test_a_format_3_plan_without_its_weight_sample_is_corrupt(tmp_path):
    model, meta = _saved_plan(tmp_path)
    del meta["fingerprint"]["weight_sample"]
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    missing = r"plan\.json is corrupt: plan format 3 .*'fingerprint\.weight_sample', which is missing"
    with pytest.raises(ValueError, match=missing):
        SparsityPlan.load(tmp_path)


@pytest.mark.parametrize("field", ["k", "total", "layer"])
@pytest.mark.parametrize("value", [True, "64", 64.9, None])
def test_plan_integers_must_be_json_integers(tmp_path, field, value):
    model, meta = _saved_plan(tmp_path)
    meta["entries"][0][field] = value
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"plan\.json is corrupt: bad entry \('{field}' must be an integer"):
        SparsityPlan.load(tmp_path)


def test_plan_files_are_written_with_the_same_permissions(tmp_path):
    _saved_plan(tmp_path)
    modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("plan.json", "predictors.safetensors")}
    assert len(set(modes.values())) == 1, modes


# ---------------------------------------------------------------------------- options

@pytest.mark.parametrize("options, message", [
    ({"simulate": "no"}, "option 'simulate' must be True or False"),
    ({"simulate": 1}, "option 'simulate' must be True or False"),
    ({"strict": "yes"}, "option 'strict' must be True or False"),
    ({"max_batch": True}, "option 'max_batch' must be a positive int"),
    ({"max_batch": 2.0}, "option 'max_batch' must be a positive int"),
    ({"on_report": 5}, "option 'on_report' must be a callable"),
])
def test_options_are_typed_strictly(options, message):
    model = tiny_model("llama", layers=1)
    with pytest.raises(DejavuOptionError, match=message), isolated_compile(
            model, "bad_options", backend="dejavu", options={"inner": "eager", **options}) as forward:
        with torch.no_grad():
            forward(token_ids(tokens=2))


# ---------------------------------------------------------------------------- calibrate arguments

@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer": None}, "calibrate needs the model's tokenizer"),
    ({"seq_len": 0}, "seq_len must be a positive int"),
    ({"max_tokens": 0}, "max_tokens must be a positive int"),
    ({"max_tokens": -5}, "max_tokens must be a positive int"),
    ({"seq_len": 32.5}, "seq_len must be a positive int"),
])
def test_calibrate_arguments_are_checked_first(kwargs, message):
    from dejavu_compile import calibrate

    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match=message):
        calibrate(model, **{"tokenizer": ByteTokenizer(), "texts": "some text " * 50, "progress": False, **kwargs})


# ---------------------------------------------------------------------------- training mode

def test_dropout_passed_into_attention_keeps_the_graph_dense():
    """LLaMA in train mode passes attention_dropout to scaled_dot_product_attention as dropout_p
    (no dropout node in the graph): under no_grad the decode graph must still stay dense."""
    model = tiny_model("llama", layers=2, attention_dropout=0.3, attn_implementation="sdpa").train()
    ids = token_ids(tokens=4)
    reports = []
    options = {"mlp_density": 0.6, "inner": "eager", "on_report": reports.append}
    with pytest.warns(UserWarning, match=r"dense because the model is in training mode \(attention dropout 0\.3"):
        with isolated_compile(model, "train_mode", backend="dejavu", options=options) as forward:
            decode_logits(forward, model, ids, [ids[:, :1]])
    assert reports and all(not r.rewritten for r in reports)
    assert all("training mode" in (r.dense_reason or "") for r in reports)


# ---------------------------------------------------------------------------- the CI helper

def test_assert_matches_eager_compares_the_sparse_decode_path():
    """A plain call is a prefill, which stays dense: the helper must run decode steps too."""
    model = tiny_model("llama", layers=2)
    ids = token_ids(tokens=5)
    with pytest.raises(AssertionError, match="decode step 1 logits"):
        assert_matches_eager(model, ids, dejavu_options={"mlp_density": 0.01, "inner": "eager"}, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pass rtol= and atol="):
        assert_matches_eager(model, ids, dejavu_options={"mlp_density": 0.01, "inner": "eager"})
    # the same sparse path, with the difference the caller accepts stated
    assert_matches_eager(model, ids, dejavu_options={"mlp_density": 0.6, "inner": "eager"}, rtol=0.0, atol=1.0)
    assert_matches_eager(model, ids, dejavu_options={"inner": "eager"})  # exact mode: the dtype's tolerance


def test_assert_matches_eager_fails_when_asked_for_sparsity_that_never_happens():
    model = tiny_model("llama", layers=1)
    with pytest.raises(AssertionError, match="no compiled graph was made sparse"):
        assert_matches_eager(model, token_ids(tokens=3), decode_steps=0, rtol=1, atol=1,
                             dejavu_options={"mlp_density": 0.5, "inner": "eager"})


def _scale_outputs(factor):
    """A stand-in for a broken backend: every floating output of every compiled graph x factor."""
    compile_inner = backend_module._compile_inner

    def scaled_compile(*args, **kwargs):
        compiled = compile_inner(*args, **kwargs)

        def run(*inputs):
            outputs = compiled(*inputs)
            return type(outputs)(o * factor if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                                 for o in outputs)
        return run
    return scaled_compile


def test_assert_matches_eager_is_not_fooled_by_the_recompile_limit(monkeypatch):
    """Past Dynamo's recompile limit on the model's forward, a compile there runs eagerly: the
    helper compiles on its own code object and checks that compiled code ran."""
    model = tiny_model("llama", layers=1)
    ids = token_ids(tokens=3)
    try:
        with torch.no_grad():
            for max_batch in range(1, 10):  # nine compiles of the same code object
                torch.compile(model.forward, backend="dejavu", options={"inner": "eager", "max_batch": max_batch})(ids)
        monkeypatch.setattr(backend_module, "_compile_inner", _scale_outputs(1.5))
        with pytest.raises(AssertionError, match="does not match eager"):
            assert_matches_eager(model, ids, dejavu_options={"inner": "eager"}, decode_steps=0)
    finally:
        torch._dynamo.reset_code(type(model).forward.__code__)


def test_assert_matches_eager_fails_when_no_compiled_graph_ran():
    model = tiny_model("llama", layers=1)
    with torch.compiler.set_stance("force_eager"), pytest.raises(AssertionError, match="ran no compiled graph"):
        assert_matches_eager(model, token_ids(tokens=3), dejavu_options={"inner": "eager"}, decode_steps=0)
