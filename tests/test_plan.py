"""SparsityPlan persistence and model binding."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan
from tests.planted import FF, PLANT, H, batches, tiny_llama


@pytest.fixture(scope="module")
def model_and_plan():
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

    model = tiny_llama()
    samples, _ = collect(model, batches(3, 48), progress=False)
    plan = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.5, attn_density=0.75, rank=PLANT,
                     progress=False)
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
        assert (b.k, b.total, b.predictor, b.lookahead) == (e.k, e.total, e.predictor, e.lookahead)
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
    with pytest.raises(ValueError, match="intermediate_size"):
        plan.check(tiny_llama(planted=False, intermediate=FF * 2))


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
    plan.entries[(0, "mlp")] = PlanEntry(0, "mlp", 10, FF, "twolayer",
                                         {"in_proj": torch.randn(64, 4), "out_proj": torch.randn(5, FF)})
    plan.save(tmp_path)
    with pytest.raises(ValueError, match="do not fit"):
        SparsityPlan.load(tmp_path)


def test_int8_plan_round_trip(tmp_path):
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

    model = tiny_llama(planted=False)
    samples, _ = collect(model, batches(2, 48), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", progress=False)
    plan.save(tmp_path / "p")
    back = SparsityPlan.load(tmp_path / "p", model=model)
    x = torch.randn(5, model.config.hidden_size)
    for key, e in plan.entries.items():
        b = back.entries[key]
        assert b.predictor == e.predictor and b.values == e.values
        if "rows" in b.tensors:
            assert b.tensors["rows"].dtype == torch.int8 and torch.equal(b.tensors["rows"], e.tensors["rows"])
        assert torch.equal(b.select(x), e.select(x))
    bad = PlanEntry(0, "mlp", 8, FF, "glu_int8", {"rows": torch.zeros(2 * FF, 64), "scales": torch.ones(2 * FF)})
    with pytest.raises(ValueError, match="int8"):
        SparsityPlan({(0, "mlp"): bad}, plan.fingerprint).save(tmp_path / "q")
        SparsityPlan.load(tmp_path / "q")


def test_values_round_trip_and_validation(tmp_path):
    """An entry's values survive save/load; a plan written before values existed loads as "exact";
    values "predictor" without the int8 predictor, or an unknown values, is a clear error."""
    import json

    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect

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
    lowrank = PlanEntry(0, "mlp", 10, FF, "twolayer", {"in_proj": torch.randn(64, 4), "out_proj": torch.randn(4, FF)},
                        values="predictor")
    SparsityPlan({(0, "mlp"): lowrank}, plan.fingerprint).save(tmp_path / "q")
    with pytest.raises(ValueError, match="values 'predictor' needs the int8"):
        SparsityPlan.load(tmp_path / "q")


# Format 1, spelled out here rather than derived from the code that reads it: each predictor was a
# "nonlinearity" with tensors A, B, a, b.
V1_FORMAT = {
    "twolayer": ("none", {"in_proj": "A", "out_proj": "B", "in_bias": "a", "out_bias": "b"}),
    "twolayer_relu": ("relu", {"in_proj": "A", "out_proj": "B", "in_bias": "a", "out_bias": "b"}),
    "glu_lowrank": ("glu", {"in_proj": "A", "in_bias": "a", "out_proj": "B"}),
    "glu_int8": ("glu_int8", {"rows": "A", "scales": "a"}),
    "glu_int4": ("glu_int4", {"codes": "A", "scales": "a", "bias": "b"}),
    None: ("dense", {}),
}


def write_format_1(plan, directory) -> None:
    """`plan` as format version 1 wrote it (plan.json + predictors.safetensors)."""
    import hashlib

    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    tensors, records = {}, []
    for (layer, kind), e in sorted(plan.entries.items()):
        nonlinearity, names = V1_FORMAT[e.predictor]
        for name, t in e.tensors.items():
            tensors[f"{layer}.{kind}.{names[name]}"] = t.detach().contiguous()
        records.append({"layer": layer, "kind": kind, "k": e.k, "total": e.total, "nonlinearity": nonlinearity,
                        "activation": e.activation, "lookahead": e.lookahead, "values": e.values,
                        "tensors": sorted(names[n] for n in e.tensors), "stats": e.stats})
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].numpy().tobytes())
    save_file(tensors, str(directory / "predictors.safetensors"))
    meta = {"format": "dejavu-compile-plan", "version": 1, "fingerprint": plan.fingerprint,
            "settings": plan.settings, "entries": records, "tensors_sha256": digest.hexdigest()}
    (directory / "plan.json").write_text(json.dumps(meta))


def test_format_1_plans_load_converted(tmp_path, model_and_plan):
    """A plan written in format 1 (A/B/a/b + nonlinearity) loads with every kind's tensors renamed and
    selects the same neurons and heads; saving it again writes the current format."""
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.plan.predictors.glu_int4 import fit_int4_glu_predictor
    from dejavu_compile.plan.predictors.twolayer import train_predictor
    from dejavu_compile.plan.sparsity_plan import FORMAT_VERSION

    model, plan = model_and_plan
    samples, _ = collect(model, batches(2, 48), progress=False)
    int8 = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", progress=False,
                     dense_when_unprofitable=False)
    s = samples[0]
    mlp = model.model.layers[0].mlp
    entries = dict(plan.entries)
    entries[(0, "mlp")] = int8.entry(0, "mlp")
    int4 = fit_int4_glu_predictor(s.attn_input, mlp.gate_proj.weight, mlp.up_proj.weight, x_block=s.mlp_input)
    entries[(1, "mlp")] = PlanEntry(1, "mlp", FF // 2, FF, "glu_int4", int4, lookahead=True)
    relu = train_predictor(s.attn_input, s.attn_importance, 2, rank=4, relu=True, steps=5).tensors()
    entries[(1, "attention")] = PlanEntry(1, "attention", 2, H, "twolayer_relu", relu)
    plain = train_predictor(s.attn_input, s.attn_importance, 2, rank=4, steps=5).tensors()
    entries[(0, "attention")] = PlanEntry(0, "attention", 2, H, "twolayer", plain)
    mixed = SparsityPlan(entries, plan.fingerprint, plan.settings)
    assert {e.predictor for e in mixed.entries.values()} == {"glu_int8", "glu_int4", "twolayer", "twolayer_relu"}
    assert {e.predictor for e in plan.entries.values()} >= {"glu_lowrank", "twolayer"}
    assert any(e.predictor is None for e in SparsityPlan.dense(model).entries.values())

    for original in (mixed, SparsityPlan.dense(model), plan):
        d = tmp_path / f"v1_{id(original)}"
        write_format_1(original, d)
        back = SparsityPlan.load(d, model=model)
        x = torch.randn(5, model.config.hidden_size)
        for key, e in original.entries.items():
            b = back.entries[key]
            assert (b.predictor, b.k, b.values, b.lookahead, b.activation) == (e.predictor, e.k, e.values, e.lookahead,
                                                                               e.activation)
            assert set(b.tensors) == set(e.tensors)
            assert all(torch.equal(b.tensors[n], t) and b.tensors[n].dtype == t.dtype for n, t in e.tensors.items())
            assert torch.equal(b.select(x), e.select(x))
        back.save(tmp_path / "again")
        assert json.loads((tmp_path / "again" / "plan.json").read_text())["version"] == FORMAT_VERSION
        SparsityPlan.load(tmp_path / "again", model=model)
        import shutil

        shutil.rmtree(tmp_path / "again")


def test_unknown_format_versions_are_clear_errors(tmp_path, model_and_plan):
    _, plan = model_and_plan
    plan.save(tmp_path)
    meta = json.loads((tmp_path / "plan.json").read_text())
    meta["version"] = 7
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="version 7, newer than this code reads"):
        SparsityPlan.load(tmp_path)
    meta["version"] = "two"
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown plan format version 'two'"):
        SparsityPlan.load(tmp_path)


def test_unknown_predictor_kind_is_a_clear_error(tmp_path, model_and_plan):
    _, plan = model_and_plan
    with pytest.raises(ValueError, match="unknown predictor kind 'glu_int3'.*glu_int4"):
        PlanEntry(0, "mlp", 8, FF, "glu_int3", {})
    plan.save(tmp_path)
    meta = json.loads((tmp_path / "plan.json").read_text())
    meta["entries"][0]["predictor"] = "glu_int3"
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="corrupt: bad entry.*glu_int3"):
        SparsityPlan.load(tmp_path)
