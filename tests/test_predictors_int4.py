"""The learned int4 gated-MLP predictor: packing, the fit to calibration inputs, lookahead,
calibration and plan files."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.calibration.collect import collect
from dejavu_compile.plan.predictors.glu_int4 import (
    dequantize_int4,
    fit_int4_glu_predictor,
    int4_glu_scores,
    pack_int4,
    unpack_int4,
)
from dejavu_compile.plan.predictors.metrics import recall
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan
from tests.planted import FF, D, L, batches, tiny_llama, tiny_opt


def _rtn(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Round-to-nearest 4-bit rows, one scale per group: what the fit must beat."""
    blocks = w.double().view(w.shape[0], -1, group)
    scale = (blocks.abs().amax(-1, keepdim=True) / 7).half().double()
    return ((blocks / scale).round().clamp(-7, 7) * scale).view_as(w)


def _correlated_inputs(n: int, mixing: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Inputs whose directions carry very unequal shares of the variance (as LLM hidden states')."""
    return torch.randn(n, mixing.shape[0], generator=gen) @ mixing


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_codes_round_trip_and_rows_on_the_grid_are_fitted_exactly(rows, groups, seed):
    """pack/unpack is lossless; rows that already are 4-bit values (each group holding a +-7 code,
    fp16 scales) come back exactly whatever inputs they are fitted to: no error, nothing fed back."""
    gen = torch.Generator().manual_seed(seed)
    d = 32 * groups
    codes = torch.randint(-7, 8, (2 * rows, d), generator=gen, dtype=torch.int8)
    codes[:, ::32] = 7 * torch.where(torch.rand(2 * rows, groups, generator=gen) < 0.5, -1, 1).to(torch.int8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    scales = (torch.rand(2 * rows, groups, generator=gen) + 0.01).half()
    w = (codes.float().view(2 * rows, groups, 32) * scales.float()[:, :, None]).view(2 * rows, d)
    t = fit_int4_glu_predictor(torch.randn(64, d, generator=gen), w[:rows], w[rows:])
    assert t["codes"].dtype == torch.uint8 and t["codes"].shape == (2 * rows, d // 2)
    assert t["scales"].dtype == torch.float16 and "bias" not in t
    assert torch.equal(dequantize_int4(t["codes"], t["scales"]), w)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_beats_rounding_on_the_inputs_it_is_fitted_to(seed):
    """On inputs concentrated in a few directions, the fitted rows' pre-activation error on fresh
    inputs of the same kind is well below round-to-nearest's (the error feedback at work)."""
    gen = torch.Generator().manual_seed(seed)
    d, n = 64, 48
    mixing = torch.randn(d, d, generator=gen) / torch.arange(1, d + 1.0)[:, None] ** 0.5
    x_fit, x_test = _correlated_inputs(2048, mixing, gen), _correlated_inputs(512, mixing, gen)
    gate, up = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    t = fit_int4_glu_predictor(x_fit, gate, up)
    w = torch.cat([gate, up]).double()
    fitted = ((x_test.double() @ (w - dequantize_int4(t["codes"], t["scales"]).double()).T) ** 2).mean()
    rounded = ((x_test.double() @ (w - _rtn(torch.cat([gate, up]))).T) ** 2).mean()
    assert fitted < 0.5 * rounded, (fitted.item(), rounded.item())


def test_lookahead_fit_maps_the_earlier_input_to_the_blocks_preactivations():
    """With lookahead the predictor reads another input from which the block's input is a linear
    map plus an offset: the fitted rows and biases rank the block's neurons nearly as the truth
    does, while rows fitted without the map (reading the earlier input as if it were the block's)
    do not."""
    gen = torch.Generator().manual_seed(0)
    d, n, k = 64, 128, 32
    x_in = torch.randn(3000, d, generator=gen)
    M, c = torch.randn(d, d, generator=gen) / d ** 0.5, torch.randn(d, generator=gen)
    x_block = x_in @ M + c
    gate, up = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    truth = (torch.nn.functional.silu(x_block @ gate.T) * (x_block @ up.T)).abs()
    look = fit_int4_glu_predictor(x_in[:2500], gate, up, x_block=x_block[:2500])
    assert look["bias"].shape == (2 * n,)
    plain = fit_int4_glu_predictor(x_in[:2500], gate, up)
    held = slice(2500, None)
    assert recall(int4_glu_scores(x_in[held], look), truth[held], k) > 0.85
    assert recall(int4_glu_scores(x_in[held], plain), truth[held], k) < 0.6


@pytest.fixture(scope="module")
def int4_model_and_samples():
    model = tiny_llama(planted=True)
    return model, collect(model, batches(), progress=False)[0]


def test_calibrate_int4_learns_the_planted_sparsity(int4_model_and_samples):
    """calibrate(predictor="int4"): 4-bit entries reading the block's own input by default, near
    the oracle's recall on the planted model, at under a seventh of the fp32 block's bytes; with
    lookahead=True the entries read the attention input and carry the fitted biases."""
    model, samples = int4_model_and_samples
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int4", progress=False,
                     min_density=0.25, dense_when_unprofitable=False)
    assert plan.settings["predictor"] == "int4" and plan.settings["method"] == "dejavu-glu-int4"
    assert not plan.settings["lookahead"] and plan.settings["values"] == "exact"
    for l in range(L):
        e = plan.entry(l, "mlp")
        assert e.predictor == "glu_int4" and not e.lookahead and "bias" not in e.tensors
        assert e.stats["recall"] > 0.9
        assert e.read_bytes(4) < 3 * FF * D * 4 / 7
    look = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int4", lookahead=True,
                     progress=False, min_density=0.25, dense_when_unprofitable=False)
    assert all(look.entry(l, "mlp").lookahead and "bias" in look.entry(l, "mlp").tensors for l in range(L))


def test_int4_plan_round_trip_and_errors(tmp_path, int4_model_and_samples):
    """Codes stay uint8 and scales fp16 through save/load and select the same neurons; malformed
    int4 entries, values from the int4 predictor, and int4 on a plain MLP are clear errors."""
    model, samples = int4_model_and_samples
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int4", lookahead=True,
                     progress=False, dense_when_unprofitable=False)
    plan.save(tmp_path / "p")
    back = SparsityPlan.load(tmp_path / "p", model=model)
    x = torch.randn(7, D)
    for key, e in plan.entries.items():
        b = back.entries[key]
        if e.kind == "mlp":
            dtypes = [b.tensors[n].dtype for n in ("codes", "scales", "bias")]
            assert dtypes == [torch.uint8, torch.float16, torch.float32]
            assert all(torch.equal(b.tensors[n], t) for n, t in e.tensors.items()) and set(b.tensors) == set(e.tensors)
        assert torch.equal(b.select(x), e.select(x))
    e = plan.entry(0, "mlp")
    t = e.tensors
    for bad in (PlanEntry(0, "mlp", e.k, FF, "glu_int4", {**t, "codes": t["codes"].to(torch.int8)}),
                PlanEntry(0, "mlp", e.k, FF, "glu_int4", {**t, "scales": t["scales"][:-1]}),
                PlanEntry(0, "mlp", e.k, FF, "glu_int4", t, values="predictor")):
        SparsityPlan({(0, "mlp"): bad}, plan.fingerprint).save(tmp_path / "q")
        with pytest.raises(ValueError, match="int4|int8"):
            SparsityPlan.load(tmp_path / "q")
    with pytest.raises(ValueError, match="predictor='int8'"):
        calibrate(model, None, samples=samples, predictor="int4", values="predictor", progress=False)
    plain = tiny_opt()
    with pytest.raises(ValueError, match="plain"):
        calibrate(plain, None, samples=collect(plain, batches(2, 32), progress=False)[0], predictor="int4",
                  progress=False)
