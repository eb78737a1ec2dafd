"""SparsityPlan persistence and model binding."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan  # noqa: E402
from test_calibration import FF, H, L, PLANT, batches, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_and_plan():
    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.calibration.calibrate import calibrate

    model = tiny_llama()
    samples, _ = collect(model, batches(3, 48), progress=False)
    plan = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.5, attn_density=0.75, rank=PLANT, progress=False)
    return model, plan


def test_round_trip(tmp_path, model_and_plan):
    model, plan = model_and_plan
    plan.save(tmp_path / "p")
    back = SparsityPlan.load(tmp_path / "p", model=model)
    assert back.mlp_density == plan.mlp_density and back.attn_density == plan.attn_density
    assert set(back.entries) == set(plan.entries)
    x = torch.randn(7, model.config.hidden_size)
    for key, e in plan.entries.items():
        b = back.entries[key]
        assert (b.k, b.total, b.nonlinearity, b.lookahead) == (e.k, e.total, e.nonlinearity, e.lookahead)
        assert torch.equal(b.select(x), e.select(x))
    assert back.settings["target_mlp_density"] == 0.5
    assert back.fingerprint == plan.fingerprint


def test_dense_plan_round_trip(tmp_path):
    model = tiny_llama(planted=False)
    plan = SparsityPlan.dense(model)
    assert plan.mlp_density == 1.0 and plan.attn_density == 1.0
    assert plan.entry(0, "mlp").select(torch.randn(2, model.config.hidden_size)).shape == (2, FF)
    plan.save(tmp_path)
    SparsityPlan.load(tmp_path).check(model)


def test_wrong_model_is_a_clear_error(tmp_path, model_and_plan):
    model, plan = model_and_plan
    plan.save(tmp_path)
    other_weights = tiny_llama(seed=3)  # same architecture, other weights
    with pytest.raises(ValueError, match="weights differ"):
        SparsityPlan.load(tmp_path, model=other_weights)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=FF * 2, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=2)
    with pytest.raises(ValueError, match="intermediate_size"):
        plan.check(LlamaForCausalLM(cfg))


def test_corrupt_or_partial_directory_is_a_clear_error(tmp_path, model_and_plan):
    _, plan = model_and_plan
    d = tmp_path / "plan"
    plan.save(d)
    tens = (d / "predictors.safetensors").read_bytes()
    meta = (d / "plan.json").read_text()

    (d / "predictors.safetensors").write_bytes(tens[: len(tens) // 2])  # truncated
    with pytest.raises(ValueError, match="corrupt|truncated"):
        SparsityPlan.load(d)

    flipped = bytearray(tens)
    flipped[-5] ^= 0xFF  # one flipped byte inside tensor data
    (d / "predictors.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum"):
        SparsityPlan.load(d)

    (d / "predictors.safetensors").unlink()
    with pytest.raises(ValueError, match="partial"):
        SparsityPlan.load(d)

    (d / "predictors.safetensors").write_bytes(tens)
    (d / "plan.json").write_text(meta[: len(meta) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        SparsityPlan.load(d)

    bad = json.loads(meta)
    bad["entries"][0]["k"] = bad["entries"][0]["total"] + 1
    (d / "plan.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="bad entry"):
        SparsityPlan.load(d)

    (d / "plan.json").unlink()
    with pytest.raises(ValueError, match="plan.json missing"):
        SparsityPlan.load(d)
    with pytest.raises(ValueError, match="does not exist"):
        SparsityPlan.load(tmp_path / "nowhere")


def test_entry_shape_validation(tmp_path):
    model = tiny_llama(planted=False)
    plan = SparsityPlan.dense(model)
    plan.entries[(0, "mlp")] = PlanEntry(0, "mlp", 10, FF, torch.randn(64, 4), torch.randn(5, FF))
    plan.save(tmp_path)
    with pytest.raises(ValueError, match="do not fit"):
        SparsityPlan.load(tmp_path)


def test_int8_plan_round_trip(tmp_path):
    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.calibration.calibrate import calibrate

    model = tiny_llama(planted=False)
    samples, _ = collect(model, batches(2, 48), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", progress=False)
    plan.save(tmp_path / "p")
    back = SparsityPlan.load(tmp_path / "p", model=model)
    x = torch.randn(5, model.config.hidden_size)
    for key, e in plan.entries.items():
        b = back.entries[key]
        assert b.nonlinearity == e.nonlinearity and b.values == e.values
        if b.A is not None:
            assert b.A.dtype == torch.int8 and torch.equal(b.A, e.A)
        assert torch.equal(b.select(x), e.select(x))
    bad = PlanEntry(0, "mlp", 8, FF, torch.zeros(2 * FF, 64), None, torch.ones(2 * FF), None, "glu_int8")
    with pytest.raises(ValueError, match="int8"):
        SparsityPlan({(0, "mlp"): bad}, plan.fingerprint).save(tmp_path / "q")
        SparsityPlan.load(tmp_path / "q")


def test_values_round_trip_and_validation(tmp_path):
    """An entry's values survive save/load; a plan written before values existed loads as "exact";
    values "predictor" without the int8 predictor, or an unknown values, is a clear error."""
    import json

    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.calibration.calibrate import calibrate

    model = tiny_llama(planted=False)
    samples, _ = collect(model, batches(2, 48), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", values="predictor",
                     progress=False, dense_when_unprofitable=False)
    plan.save(tmp_path / "p")
    assert {e.values for e in SparsityPlan.load(tmp_path / "p").entries.values() if e.kind == "mlp"} == {"predictor"}
    meta_path = tmp_path / "p" / "plan.json"
    meta = json.loads(meta_path.read_text())
    for record in meta["entries"]:
        del record["values"]
    meta_path.write_text(json.dumps(meta))
    assert {e.values for e in SparsityPlan.load(tmp_path / "p").entries.values()} == {"exact"}
    for record in meta["entries"]:
        record["values"] = "int4"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="corrupt"):
        SparsityPlan.load(tmp_path / "p")
    lowrank = PlanEntry(0, "mlp", 10, FF, torch.randn(64, 4), torch.randn(4, FF), values="predictor")
    SparsityPlan({(0, "mlp"): lowrank}, plan.fingerprint).save(tmp_path / "q")
    with pytest.raises(ValueError, match="values 'predictor' needs the int8"):
        SparsityPlan.load(tmp_path / "q")
