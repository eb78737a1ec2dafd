"""Plans are bound to the weights they were calibrated on: another checkpoint of the same
architecture is a PlanMismatchError (plan.check and the backend's weights_check pass); a bf16 or
fp16 cast of the same checkpoint is the same model."""
import copy
import json
import logging

import pytest
import torch

from dejavu_compile.errors import PlanMismatchError
from dejavu_compile.plan.sparsity_plan import FORMAT_VERSION, SparsityPlan
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import fine_tuned, int8_plan, token_ids


def _compile_and_run(model, plan, **options):
    reports = []
    compiled = torch.compile(model, backend="dejavu", options={
        "plan": plan, "inner": "eager", "strict": True, "on_report": reports.append, **options})
    with torch.no_grad():
        compiled(token_ids(1, 1), use_cache=False)
    return reports


def test_backend_rejects_a_plan_of_another_checkpoint():
    model = tiny_model("llama")
    plan = int8_plan(model)
    for other in (fine_tuned(model), fine_tuned(model).to(torch.bfloat16)):
        torch._dynamo.reset()
        names = r"weights differ .* in 16 of 21 parameters \(model\.embed_tokens\.weight, model\.layers\.0\.self_attn"
        with pytest.raises(PlanMismatchError, match=names):  # the norms' weights (all ones) are unchanged
            _compile_and_run(other, plan, simulate=True)
        with pytest.raises(ValueError, match=names):
            plan.check(other)


def test_a_small_fine_tune_is_caught_at_the_coarser_dtype():
    """Each value moved by ~2% (more than bf16's precision): caught in fp32 and in bf16."""
    model = tiny_model("llama")
    plan = int8_plan(model)
    gen = torch.Generator().manual_seed(2)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=gen).sign())
    for candidate in (other, copy.deepcopy(other).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="weights differ"):
            plan.check(candidate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_dtype_cast_of_the_same_checkpoint_passes(dtype):
    model = tiny_model("llama")
    plan = int8_plan(model)
    cast = copy.deepcopy(model).to(dtype)
    plan.check(cast)
    reports = _compile_and_run(cast, plan, simulate=True)
    n_params = len(list(cast.parameters()))
    assert reports[-1].pass_counts["weights_check"] == n_params
    assert reports[-1].rewritten  # the plan really applied


def test_the_verdict_is_cached_across_recompiles(monkeypatch):
    from dejavu_compile.compiler.passes import weights_check

    model = tiny_model("llama")
    plan = int8_plan(model)
    calls = []
    real = weights_check.same_weights
    monkeypatch.setattr(weights_check, "same_weights", lambda *a: calls.append(a[1]) or real(*a))
    _compile_and_run(model, plan)
    first = len(calls)
    assert first == len(list(model.parameters()))
    torch._dynamo.reset()
    _compile_and_run(model, plan, simulate=True)
    assert len(calls) == first
    with torch.no_grad():  # an in-place update is looked at again
        model.model.layers[0].mlp.gate_proj.weight.mul_(1.5)
    torch._dynamo.reset()
    with pytest.raises(PlanMismatchError, match=r"1 of \d+ parameters \(model\.layers\.0\.mlp\.gate_proj\.weight\)"):
        _compile_and_run(model, plan)


def test_prepared_weights_are_the_same_weights():
    """prepare_model re-lays out weights in place (other strides, same values)."""
    from dejavu_compile.compiler.prepare import prepare_model

    model = tiny_model("llama")
    plan = int8_plan(model)
    assert prepare_model(model)
    plan.check(model)
    assert _compile_and_run(model, plan)[-1].rewritten


def test_saved_plan_keeps_its_weight_sample(tmp_path):
    model = tiny_model("llama")
    plan = int8_plan(model)
    plan.save(tmp_path)
    meta = json.loads((tmp_path / "plan.json").read_text())
    assert meta["version"] == FORMAT_VERSION == 3
    back = SparsityPlan.load(tmp_path, model=model.to(torch.bfloat16))
    assert back.weight_sample == plan.weight_sample
    with pytest.raises(PlanMismatchError, match="weights differ"):
        SparsityPlan.load(tmp_path, model=fine_tuned(model))


def test_format_2_plans_load_and_are_logged_once_as_unverifiable(tmp_path, caplog):
    model = tiny_model("llama")
    plan = int8_plan(model)
    plan.save(tmp_path)
    meta = json.loads((tmp_path / "plan.json").read_text())
    meta["version"] = 2  # format 2: format 3 without the sample
    del meta["fingerprint"]["weight_sample"]
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    old = SparsityPlan.load(tmp_path, model=model)
    assert old.weight_sample is None
    with pytest.raises(ValueError, match="weights differ"):  # the old hash check
        old.check(fine_tuned(model))
    with caplog.at_level(logging.WARNING, logger="dejavu_compile"):
        _compile_and_run(model, old)
        torch._dynamo.reset()
        _compile_and_run(model, old, simulate=True)
    unverifiable = [r for r in caplog.records if "no weight sample" in r.getMessage()]
    assert len(unverifiable) == 1 and "plan format 2," in unverifiable[0].getMessage()
