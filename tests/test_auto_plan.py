"""The one-line start: options={"mlp_density": d} without a plan builds the training-free int8 plan
from the weights at compile time, the plan calibrate() makes by default on CPU."""
import logging

import pytest
import torch

from dejavu_compile.errors import DejavuOptionError
from dejavu_compile.testing import describe_difference
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import token_ids
from tests.references import predictor_values_reference


def _compile(model, options, ids):
    reports = []
    compiled = torch.compile(model, backend="dejavu", options={**options, "on_report": reports.append})
    with torch.no_grad():
        logits = compiled(ids, use_cache=False).logits
    return logits, reports


def _calibrated_default_plan(model):
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

    samples, _ = collect(model, [token_ids(1, 24, seed) for seed in range(2)], progress=False)
    return calibrate(model, None, samples=samples, progress=False)


def test_mlp_density_builds_the_plan_calibrate_makes_by_default():
    model = tiny_model("llama", intermediate=320)
    calibrated = _calibrated_default_plan(model)
    _, reports = _compile(model, {"mlp_density": 0.6, "inner": "eager", "strict": True}, token_ids(2, 1))
    built = reports[-1].plan
    assert set(built.entries) == set(calibrated.entries)
    for key, want in calibrated.entries.items():
        got = built.entries[key]
        fields = ("k", "total", "predictor", "activation", "lookahead", "values")
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], key
        assert set(got.tensors) == set(want.tensors)
        assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items()), key
    assert {e.k for e in built.entries.values() if e.kind == "mlp"} == {192}  # round(0.6 * 320)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_one_line_start_decodes_as_the_calibrated_plans_reference(inner):
    model = tiny_model("llama", intermediate=320)
    calibrated = _calibrated_default_plan(model)
    ids = token_ids(3, 1)
    expected = predictor_values_reference(model, calibrated, ids)
    got, reports = _compile(model, {"mlp_density": 0.6, "inner": inner, "strict": True}, ids)
    assert reports[-1].pass_counts["auto_plan"] == 2 and reports[-1].pass_counts["sparse_mlp"] == 2
    assert describe_difference("logits", got, expected, rtol=1e-4, atol=1e-4) is None
    with torch.no_grad():
        assert (model(ids, use_cache=False).logits - got).abs().max() > 1e-4  # it really is sparse


def test_the_plan_is_built_once_per_model(monkeypatch):
    from dejavu_compile.plan import predictors

    fits = []
    kind = predictors.training_free_kind()
    real = kind.from_weights
    monkeypatch.setattr(kind, "from_weights", lambda g, u: fits.append(1) or real(g, u))
    model = tiny_model("llama")
    options = {"mlp_density": 0.5, "inner": "eager", "strict": True}
    _compile(model, options, token_ids(1, 4))  # prefill graph
    _compile(model, options, token_ids(1, 1))  # decode graph
    torch._dynamo.reset()
    _compile(model, options, token_ids(2, 1))  # recompiled
    assert len(fits) == model.config.num_hidden_layers
    with torch.no_grad():  # new weights, new predictor
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    _compile(model, options, token_ids(3, 1))
    assert len(fits) == model.config.num_hidden_layers + 1


def test_plain_mlps_stay_dense_and_are_reported():
    model = tiny_model("opt")
    ids = token_ids(2, 1)
    got, reports = _compile(model, {"mlp_density": 0.5, "inner": "eager", "strict": True}, ids)
    report = reports[-1]
    assert not report.rewritten and all(e.dense for e in report.plan.entries.values())
    assert any("training-free plan needs gated MLPs" in reason for _, reason in report.match.fallbacks)
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, use_cache=False).logits)


def test_without_options_the_backend_says_once_how_to_turn_sparsity_on(monkeypatch, caplog):
    from dejavu_compile.compiler.passes import auto_plan

    monkeypatch.setattr(auto_plan, "_hint_logged", False)
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="dejavu_compile"):
        for ids in (token_ids(1, 4), token_ids(1, 1), token_ids(2, 1)):
            torch._dynamo.reset()
            got, reports = _compile(model, {}, ids)
            assert not reports[-1].rewritten
    hints = [r for r in caplog.records if "mlp_density" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.WARNING
    assert "options={'mlp_density': 0.6}" in hints[0].getMessage() and "calibrate(" in hints[0].getMessage()


@pytest.mark.parametrize("density", [0, 0.0, -0.5, 1.5, float("nan"), "0.6", True, [0.6]])
def test_bad_mlp_density_is_a_clear_error(density):
    model = tiny_model("llama")
    with pytest.raises(DejavuOptionError, match=r"option 'mlp_density' must be a number in \(0, 1\]"):
        _compile(model, {"mlp_density": density}, token_ids(1, 1))


def test_plan_and_mlp_density_together_is_an_error():
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    model = tiny_model("llama")
    with pytest.raises(DejavuOptionError, match="'plan' and 'mlp_density' exclude each other"):
        _compile(model, {"plan": SparsityPlan.dense(model), "mlp_density": 0.5}, token_ids(1, 1))
