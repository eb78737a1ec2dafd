"""A predictor kind is one registration: a kind that declares its own alias is accepted by
calibrate and the command line, fitted to the model's MLPs and loaded back from a saved plan, with
no other file edited."""
from __future__ import annotations

import pytest

from dejavu_compile import cli
from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.calibration.collect import collect
from dejavu_compile.plan import predictors
from dejavu_compile.plan.predictors.glu_int8 import GluInt8
from dejavu_compile.plan.sparsity_plan import SparsityPlan
from tests.planted import batches, tiny_llama


class Int8Copy(GluInt8):
    """The int8 kind under another name and alias, neither automatic nor training-free."""

    name = "glu_int8_copy"
    option, default_density, auto_devices, training_free, v1_code = "int8copy", 0.5, (), False, None


@pytest.fixture
def copy_kind():
    kind = predictors.register(Int8Copy())
    yield kind
    predictors.unregister(kind.name)


def test_a_registered_alias_is_fitted_saved_and_loaded(copy_kind, tmp_path):
    assert "int8copy" in predictors.option_names()
    assert predictors.auto_option("cpu", True) == "int8"  # not automatic: the built-in choice stands
    assert predictors.training_free_kind().name == "glu_int8"
    model = tiny_llama(planted=False)
    plan = calibrate(model, None, samples=collect(model, batches(), progress=False)[0], predictor="int8copy",
                     progress=False, dense_when_unprofitable=False)
    sparse = [e for e in plan.entries.values() if e.kind == "mlp" and not e.dense]
    assert sparse and {e.predictor for e in sparse} == {"glu_int8_copy"}
    assert plan.settings["predictor"] == "int8copy" and plan.settings["target_mlp_density"] == 0.5
    plan.save(tmp_path / "plan")
    loaded = SparsityPlan.load(tmp_path / "plan")
    assert {loaded.entry(e.layer, "mlp").predictor for e in sparse} == {"glu_int8_copy"}


def test_the_command_line_offers_a_registered_alias(copy_kind, capsys):
    # the parser accepts the alias and stops at the next check (the missing text file), not at the choice
    with pytest.raises(SystemExit) as accepted:
        cli.calibrate_cmd(["--out", "x", "--predictor", "int8copy", "--texts", "/no/such/file"])
    assert accepted.value.code == 2 and "--texts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.calibrate_cmd(["--out", "x", "--predictor", "int8missing", "--texts", "/no/such/file"])
    assert "invalid choice" in capsys.readouterr().err
