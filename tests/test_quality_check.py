"""calibrate() measures the plan it returns on calibration tokens held out from collection, stores
the figure in the plan, and warns when it is above `warn_ppl_increase`."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from dejavu_compile.assets.data import tokenize_chunks
from dejavu_compile.calibration.calibrate import PlanQualityWarning, calibrate, split_holdout
from dejavu_compile.calibration.collect import collect
from dejavu_compile.evaluation.perplexity import perplexity
from dejavu_compile.plan.sparsity_plan import SparsityPlan
from dejavu_compile.testing.tiny import tiny_model
from tests.helpers import ByteTokenizer

MAX_TOKENS, SEQ_LEN = 512, 32
TEXT = " ".join(f"token{i % 37} word{i % 11}" for i in range(47))  # 20 chunks of 32: the 4 beyond MAX_TOKENS held out


def model_with_strong_mlps():
    """A tiny LLaMA whose MLPs carry much of the residual stream and whose logits are sharp (MLP and
    output weights x5), so that keeping 10% of the MLP neurons costs perplexity (in the random
    model it costs < 0.1%)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.mul_(5.0)
        model.lm_head.weight.mul_(5.0)
    return model


def _calibrate(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = calibrate(model, ByteTokenizer(), texts=[TEXT], max_tokens=MAX_TOKENS, seq_len=SEQ_LEN,
                         progress=False, **kwargs)
    return plan, [w for w in caught if issubclass(w.category, PlanQualityWarning)]


def _holdout():
    """The chunks calibrate holds out of TEXT."""
    return split_holdout(tokenize_chunks(ByteTokenizer(), [TEXT], SEQ_LEN, MAX_TOKENS + 1024), MAX_TOKENS, SEQ_LEN)[1]


@pytest.fixture(scope="module")
def model():
    return model_with_strong_mlps()


@pytest.fixture(scope="module")
def bad(model):
    return _calibrate(model, mlp_density=0.1)


def test_holdout_is_the_text_beyond_collection_or_a_tenth_of_it():
    chunks = [torch.full((1, 4), i) for i in range(40)]
    collected, held = split_holdout(chunks, max_tokens=32 * 4, seq_len=4)  # 8 beyond max_tokens: all held out
    assert collected == chunks[:32] and held == chunks[32:]
    collected, held = split_holdout(chunks[:20], max_tokens=32 * 4, seq_len=4)  # short text: the last tenth
    assert collected == chunks[:18] and held == chunks[18:20]
    collected, held = split_holdout(chunks, max_tokens=4, seq_len=4)  # at most HOLDOUT_TOKENS (256 chunks of 4)
    assert len(held) == 39
    assert split_holdout(chunks[:1], max_tokens=4, seq_len=4) == (chunks[:1], [])


def test_bad_plan_warns_with_its_figure(model, bad):
    plan, caught = bad
    quality = plan.settings["quality"]
    assert quality["tokens"] == sum(c.numel() for c in _holdout()) == 4 * SEQ_LEN
    assert quality["increase"] > 0.05
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{quality['increase']:+.1%}" in message and "mlp_density" in message and "max_ppl_increase" in message
    # the figure is the plan's perplexity on the held-out chunks through the masked simulation
    holdout = _holdout()
    assert quality["dense_ppl"] == pytest.approx(perplexity(model, holdout), rel=1e-4)
    assert quality["plan_ppl"] == pytest.approx(perplexity(model, holdout, plan), rel=1e-4)


def test_good_plan_stores_its_figure_without_warning(model, tmp_path):
    plan, caught = _calibrate(model, mlp_density=0.75)
    quality = plan.settings["quality"]
    assert not caught
    assert abs(quality["increase"]) < 0.05 and quality["tokens"] == 4 * SEQ_LEN
    assert plan.settings["warn_ppl_increase"] == 0.05
    plan.save(tmp_path / "plan")
    assert SparsityPlan.load(tmp_path / "plan").settings["quality"] == quality


def test_bound_is_a_parameter(model):
    plan, caught = _calibrate(model, mlp_density=0.1, warn_ppl_increase=1.0)
    assert plan.settings["quality"]["increase"] > 0.05 and not caught
    plan, caught = _calibrate(model, mlp_density=0.1, warn_ppl_increase=None)
    assert plan.settings["quality"] is None and "warn_ppl_increase=None" in plan.settings["quality_note"]
    assert not caught


def test_quality_budget_picks_a_denser_plan_than_the_bad_one(model, bad):
    bad_plan, _ = bad
    plan, caught = _calibrate(model, max_ppl_increase=0.05)
    assert plan.mlp_density > bad_plan.mlp_density
    assert plan.settings["quality"]["increase"] <= 0.05 and not caught
    # measured on the held-out chunks, not on the ones it was fitted to
    holdout = _holdout()
    assert perplexity(model, holdout, plan) / perplexity(model, holdout) - 1.0 <= 0.05 + 1e-6


def test_precomputed_samples_hold_nothing_out():
    model = model_with_strong_mlps()
    samples = collect(model, [torch.randint(3, 120, (1, 32), generator=torch.Generator().manual_seed(i))
                              for i in range(4)], progress=False)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanQualityWarning)
        plan = calibrate(model, None, samples=samples, mlp_density=0.1, progress=False)
    assert plan.settings["quality"] is None and "samples" in plan.settings["quality_note"]
    with pytest.raises(ValueError, match="held out"):
        calibrate(model, None, samples=samples, max_ppl_increase=0.05, progress=False)
