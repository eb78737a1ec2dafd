"""Calibration on tiny LLaMA configs with planted contextual sparsity (fast, no real weights)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dejavu_compile.calibration import budget
from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.calibration.collect import collect
from dejavu_compile.experiments.quality import (
    MaskedSimulation,
    TealSelector,
    oracle_selector,
    perplexity,
    plan_selector,
    random_selector,
)
from dejavu_compile.plan import predictors, rules
from dejavu_compile.plan.predictors.baselines import teal_input_mask
from dejavu_compile.plan.predictors.glu_lowrank import fit_glu_predictor, glu_scores
from dejavu_compile.plan.predictors.metrics import mass_captured, recall
from dejavu_compile.plan.predictors.twolayer import train_predictor
from dejavu_compile.plan.sparsity_plan import SparsityPlan
from tests.helpers import ByteTokenizer
from tests.planted import FF, PLANT, D, H, L, V, batches, tiny_llama, tiny_opt


def test_collect_shapes_and_subsampling():
    model = tiny_llama()
    samples, blocks = collect(model, batches(4, 32), max_tokens=100, progress=False)
    assert sorted(samples) == list(range(L))
    s = samples[1]
    assert s.mlp_input.shape == (100, D) and s.mlp_importance.shape == (100, FF)
    assert s.attn_input.shape == (100, D) and s.attn_importance.shape == (100, H)
    assert (s.mlp_importance >= 0).all() and (s.attn_importance >= 0).all()
    # importance really is |act(gate x) * up x| of the collected input
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        ref = (mlp.act_fn(mlp.gate_proj(s.mlp_input)) * mlp.up_proj(s.mlp_input)).abs()
    torch.testing.assert_close(s.mlp_importance, ref, rtol=1e-4, atol=1e-5)
    assert {(b.layer, b.kind) for b in blocks} == {(i, k) for i in range(L) for k in ("mlp", "attention")}


def test_glu_predictor_recovers_planted_sparsity():
    model = tiny_llama()
    samples, _ = collect(model, batches(), progress=False)
    s = samples[0]
    mlp = model.model.layers[0].mlp
    n = s.mlp_input.shape[0]
    fit, val = slice(0, n * 3 // 4), slice(n * 3 // 4, n)
    k = FF // 4
    t = fit_glu_predictor(s.mlp_input[fit], s.mlp_input[fit], mlp.gate_proj.weight, mlp.up_proj.weight, rank=PLANT)
    sc = glu_scores(s.mlp_input[val], t)
    assert recall(sc, s.mlp_importance[val], k) > 0.95
    # a rank too small to hold the planted structure must do clearly worse (the test can fail)
    t1 = fit_glu_predictor(s.mlp_input[fit], s.mlp_input[fit], mlp.gate_proj.weight, mlp.up_proj.weight, rank=1)
    assert (recall(glu_scores(s.mlp_input[val], t1), s.mlp_importance[val], k)
            < recall(sc, s.mlp_importance[val], k) - 0.1)


@pytest.mark.parametrize("relu,loss", [(False, "bce"), (True, "soft")])
def test_dejavu_predictor_learns_planted_relu_sparsity(relu, loss):
    # ReLU-MLP style planted sparsity (what Deja Vu was designed for): importance = relu(x W), W rank 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 32, generator=g)
    W = torch.randn(32, 4, generator=g) @ torch.randn(4, 128, generator=g)
    imp = torch.relu(x @ W)
    k = 32
    p = train_predictor(x[:2500], imp[:2500], k, rank=8, relu=relu, loss=loss, steps=200, lr=1e-2)
    with torch.no_grad():
        sc = p(x[2500:])
    r = recall(sc, imp[2500:], k)
    assert r > 0.85, r
    rand = recall(torch.rand(500, 128, generator=g), imp[2500:], k)
    assert rand < 0.5
    assert mass_captured(sc, imp[2500:], k) > 0.85 * mass_captured(imp[2500:], imp[2500:], k)


def test_calibrate_planted_model_hits_density_and_recall():
    model = tiny_llama()
    samples, _ = collect(model, batches(), progress=False)
    plan = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.5, attn_density=0.75,
                     lookahead=False, rank=PLANT, progress=False, min_density=0.25)
    assert abs(plan.mlp_density - 0.5) < 0.05
    assert plan.attn_density <= 0.75 + 1e-9
    for l in range(L):
        e = plan.entry(l, "mlp")
        assert e.total == FF and not e.lookahead
        if not e.dense:
            assert e.stats["recall"] > 0.9
            idx = e.select(samples[l].mlp_input[:5])
            assert idx.shape == (5, e.k) and idx.dtype == torch.long
    # lookahead predictors exist and are flagged
    plan_la = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.5, lookahead=True, rank=PLANT,
                        progress=False)
    assert all(plan_la.entry(l, "mlp").lookahead for l in range(L) if not plan_la.entry(l, "mlp").dense)


def test_calibrated_head_plan_decodes_through_the_backend():
    """Head predictors from calibration (lookahead from layer 1) drive the head-sparse decode graph,
    which selects what the plan's masked simulation selects."""
    from dejavu_compile.testing import describe_difference

    model = tiny_llama()
    samples, _ = collect(model, batches(), progress=False)
    plan = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=1.0, attn_density=0.5, rank=PLANT,
                     progress=False, min_density=0.25)
    heads = [plan.entry(l, "attention") for l in range(L)]
    assert [e.lookahead for e in heads] == [False, True]
    assert all(0.0 <= e.stats["recall"] <= 1.0 for e in heads if not e.dense)
    ids = torch.randint(0, V, (3, 1), generator=torch.Generator().manual_seed(5))
    got = {}
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for name, options in (("sparse", {}), ("simulation", {"simulate": True})):
            torch._dynamo.reset()
            reports = []
            got[name] = torch.compile(model, backend="dejavu", options={
                "plan": plan, "inner": "eager", "strict": True, "on_report": reports.append, **options})(
                ids, use_cache=False).logits
            assert any("heads" in line for r in reports for line in r.rewritten), name
    assert describe_difference("logits", got["sparse"], got["simulation"], rtol=1e-4, atol=1e-4) is None
    assert (got["sparse"] - dense).abs().max() > 1e-4


def test_dense_plan_and_simulation_are_exact():
    model = tiny_llama(planted=False)
    ids = batches(1, 20)[0]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with MaskedSimulation(model, plan_selector(SparsityPlan.dense(model))):
            out = model(input_ids=ids).logits
        with MaskedSimulation(model, oracle_selector(1.0, 1.0)):
            out2 = model(input_ids=ids).logits
        with MaskedSimulation(model, oracle_selector(0.5, 0.5)):
            out3 = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)
    assert not torch.allclose(out3, ref)
    assert SparsityPlan.dense(model).mlp_density == 1.0
    # hooks are removed on exit
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref)


def test_masking_degrades_gracefully_oracle_beats_random():
    model = tiny_llama()
    ev = batches(2, 48, seed=5)
    dense = perplexity(model, ev)
    oracle = perplexity(model, ev, oracle_selector(0.25))
    rnd = perplexity(model, ev, random_selector(0.25))
    teal = perplexity(model, ev, TealSelector(0.5))
    assert abs(oracle / dense - 1) < abs(rnd / dense - 1)
    assert teal != dense
    m = teal_input_mask(torch.randn(3, 10), 0.3)
    assert m.sum(-1).tolist() == [3.0, 3.0, 3.0]


def test_budget_allocation_prefers_cheap_layers():
    totals = {0: 100, 1: 100}
    grid = rules.k_grid(100, 0.1, 9)
    assert grid[0] == 100 and grid[-1] == 10 and grid == sorted(grid, reverse=True)
    # layer 0 loses a lot per neuron removed, layer 1 little
    curves = {0: {k: (100 - k) * 0.05 for k in grid}, 1: {k: (100 - k) * 0.001 for k in grid}}
    ks = budget.allocate(curves, totals, 0.6)
    assert ks[0] + ks[1] <= 120 and ks[0] > ks[1]
    assert budget.allocate(curves, totals, 1.0) == {0: 100, 1: 100}
    with pytest.raises(ValueError):
        budget.allocate(curves, totals, 0.0)


def test_uniform_k_is_the_nearest_grid_point():
    assert rules.uniform_k(1536, 0.6, 32) == 928 and rules.uniform_k(1536, 0.5, 32) == 768
    assert rules.uniform_k(100, 0.333) == 33 and rules.uniform_k(100, 1.0) == 100
    assert rules.uniform_k(1536, 0.001, 32) == 32 and rules.uniform_k(16, 0.5, 32) == 16  # one step, at most total
    with pytest.raises(ValueError):
        rules.uniform_k(100, 0.0)


def test_allocation_is_uniform_for_the_quantized_predictors_and_greedy_for_lowrank():
    """allocation="auto": every layer keeps the same k with the int8 predictor; the low-rank
    predictor's budget follows its per-layer curves; an explicit choice overrides; a bad one is an error."""
    model = tiny_llama(planted=False)
    samples, _ = collect(model, batches(), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", progress=False,
                     dense_when_unprofitable=False)
    assert plan.settings["allocation"] == "uniform"
    assert {plan.entry(l, "mlp").k for l in range(L)} == {rules.uniform_k(FF, 0.5)}
    lowrank = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="lowrank", rank=4, progress=False,
                        dense_when_unprofitable=False)
    assert lowrank.settings["allocation"] == "greedy"
    greedy = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", allocation="greedy",
                       progress=False, dense_when_unprofitable=False)
    assert greedy.settings["allocation"] == "greedy" and abs(greedy.mlp_density - 0.5) < 0.05
    with pytest.raises(ValueError, match="allocation"):
        calibrate(model, None, samples=samples, allocation="even", progress=False)


def test_int8_predictor_selects_nearly_the_oracle_set():
    """The int8 copy of gate/up ranks neurons almost exactly as the true |act(g)*u| does, on a
    model without any planted structure (where a low-rank predictor is near random)."""
    model = tiny_llama(planted=False)
    samples, _ = collect(model, batches(), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, predictor="int8", progress=False,
                     min_density=0.25)
    assert plan.settings["predictor"] == "int8"
    for l in range(L):
        e = plan.entry(l, "mlp")
        assert not e.lookahead  # it is the block's own projection
        if not e.dense:
            assert e.predictor == "glu_int8" and e.tensors["rows"].dtype == torch.int8
            assert e.stats["recall"] > 0.9
            assert e.predictor_bytes() < 0.2 * 3 * FF * D * 4  # a sixth of the fp32 block (+ scales)
    lowrank = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.5, rank=4, progress=False,
                        min_density=0.25)
    sparse = [l for l in range(L) if not lowrank.entry(l, "mlp").dense and not plan.entry(l, "mlp").dense]
    assert sparse and all(plan.entry(l, "mlp").stats["recall"] > lowrank.entry(l, "mlp").stats["recall"]
                          for l in sparse)


def test_default_predictor_is_int8_for_gated_mlps_on_cpu_else_lowrank():
    """calibrate()'s defaults: the int8 predictor at its kind's default density for a gated model on
    the CPU; Deja Vu's low-rank one at its default density for plain MLPs (OPT)."""
    int8_density = predictors.option_kinds("int8")[0].default_density
    lowrank_density = predictors.option_kinds("lowrank")[0].default_density

    gated = tiny_llama(planted=False)
    plan = calibrate(gated, None, samples=collect(gated, batches(), progress=False)[0], progress=False,
                     dense_when_unprofitable=False)
    assert plan.settings["predictor"] == "int8" and not plan.settings["lookahead"]
    assert plan.settings["target_mlp_density"] == int8_density
    assert abs(plan.mlp_density - int8_density) < 0.05
    sparse = [e for e in plan.entries.values() if e.kind == "mlp" and not e.dense]
    assert sparse and all(e.values == "predictor" for e in sparse)  # values from the int8 predictor
    plain = tiny_opt()
    plan = calibrate(plain, None, samples=collect(plain, batches(), progress=False)[0], progress=False,
                     train_steps=5)
    assert plan.settings["predictor"] == "lowrank" and plan.settings["method"] == "dejavu-lowrank"
    assert plan.settings["target_mlp_density"] == lowrank_density
    assert plan.settings["values"] == "exact" and all(e.values == "exact" for e in plan.entries.values())


def test_values_from_the_predictor_need_the_int8_predictor():
    model = tiny_llama(planted=False)
    with pytest.raises(ValueError, match="predictor='int8'"):
        calibrate(model, None, samples={}, predictor="lowrank", values="predictor", progress=False)
    with pytest.raises(ValueError, match="values must be"):
        calibrate(model, None, samples={}, values="int4", progress=False)


def test_unknown_predictor_is_a_clear_error():
    model = tiny_llama(planted=False)
    with pytest.raises(ValueError, match="predictor"):
        calibrate(model, None, samples={}, predictor="int3", progress=False)


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_quality_budget_mode_respects_its_budget(budget):
    """max_ppl_increase picks the lowest density whose calibration-holdout perplexity stays within
    the budget: a zero budget keeps (nearly) everything, a loose one goes sparser."""
    from dejavu_compile.assets.data import tokenize_chunks
    from dejavu_compile.evaluation.perplexity import perplexity

    model = tiny_llama(planted=False)
    text = " ".join(f"token{i % 37} word{i % 11}" for i in range(600))
    tokenizer = ByteTokenizer(first=1, count=V - 1, eos_token_id=0)  # ids below the tiny vocabulary
    plan = calibrate(model, tokenizer, texts=[text], max_ppl_increase=budget, max_tokens=512,
                     seq_len=32, predictor="int8", progress=False)
    assert plan.settings["max_ppl_increase"] == budget
    if plan.mlp_density < 1.0:
        assert plan.settings["holdout_ppl_increase"] <= budget
    from dejavu_compile.calibration.calibrate import split_holdout

    holdout = split_holdout(tokenize_chunks(tokenizer, [text], 32, 512 + 1024), 512, 32)[1]  # held out
    inc = perplexity(model, holdout, plan) / perplexity(model, holdout) - 1.0
    assert inc <= budget + 1e-6
    if budget == 0.5:
        assert plan.mlp_density < 0.9


def test_unprofitable_layers_stay_dense():
    """A layer whose kept rows plus predictor read as many bytes as the dense block stays dense,
    unless asked to hit the target exactly."""
    model = tiny_llama()
    samples, _ = collect(model, batches(3, 48), progress=False)
    kwargs = dict(samples=samples, predictor="lowrank", mlp_density=0.8, rank=32, lookahead=False, progress=False)
    plan = calibrate(model, None, **kwargs)  # predictor ~42% of the block: 0.8 + 0.42 > 1
    assert plan.settings["predictor_cost"] > 0.3
    assert all(plan.entry(l, "mlp").dense for l in range(L)) and plan.mlp_density == 1.0
    exact = calibrate(model, None, dense_when_unprofitable=False, **kwargs)
    assert abs(exact.mlp_density - 0.8) < 0.05 and not all(exact.entry(l, "mlp").dense for l in range(L))


def test_calibrate_plain_relu_mlp_learns_planted_sparsity():
    """Plain MLPs (OPT, GPT-2) calibrate too: Deja Vu's trained low-rank predictor, high recall."""
    model = tiny_opt()
    samples, _ = collect(model, batches(12), progress=False)
    plan = calibrate(model, None, predictor="lowrank", samples=samples, mlp_density=0.25, lookahead=False,
                     rank=2 * PLANT, train_steps=1000, progress=False, min_density=0.125,
                     dense_when_unprofitable=False)
    assert plan.settings["method"] == "dejavu-lowrank"
    assert abs(plan.mlp_density - 0.25) < 0.05
    for l in range(L):
        e = plan.entry(l, "mlp")
        assert e.predictor == "twolayer" and e.total == FF and not e.dense
        assert e.stats["recall"] > 0.9, e.stats
    # a rank-2 predictor of an unplanted model does much worse: the recall is earned
    unplanted = tiny_opt(planted=False)
    plain = calibrate(unplanted, None, predictor="lowrank", samples=collect(unplanted, batches(12), progress=False)[0],
                      mlp_density=0.25, lookahead=False, rank=2, train_steps=1000, progress=False,
                      dense_when_unprofitable=False)
    assert min(plan.entry(l, "mlp").stats["recall"] for l in range(L)) > max(
        plain.entry(l, "mlp").stats["recall"] for l in range(L)) + 0.1


@pytest.mark.parametrize("arch", ["opt", "gpt2"])
def test_plain_mlp_plan_decodes_through_the_sparse_ops(arch):
    """A calibrated plain-MLP plan (GPT-2's Conv1D layout included) through the backend: the sparse
    ops give what the masked simulation of the same plan gives, and differ from dense."""
    from dejavu_compile.testing.tiny import tiny_model

    model = tiny_opt() if arch == "opt" else tiny_model("gpt2", hidden=D, intermediate=FF, vocab=V)
    samples, _ = collect(model, batches(), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, progress=False, dense_when_unprofitable=False)
    assert all(plan.entry(l, "mlp").lookahead for l in range(L))
    ids = torch.randint(3, V, (3, 1), generator=torch.Generator().manual_seed(5))
    outs = {}
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        for name, opts in (("simulate", {"simulate": True, "inner": "eager"}), ("sparse", {})):
            torch._dynamo.reset()
            outs[name] = torch.compile(model, backend="dejavu", options={"plan": plan, "strict": True, **opts})(
                ids, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(outs["sparse"], outs["simulate"], rtol=1e-4, atol=1e-4)
    assert (outs["sparse"] - dense).abs().max() > 1e-3


def test_int8_predictor_on_a_plain_mlp_is_a_clear_error():
    model = tiny_opt(planted=False)
    samples, _ = collect(model, batches(2, 16), progress=False)
    with pytest.raises(ValueError, match="plain"):
        calibrate(model, None, samples=samples, predictor="int8", progress=False)


def test_gemma_calibrates_with_its_own_activation():
    """Per-block facts come from the matched blocks, not config attribute names: a Gemma config names
    its activation `hidden_activation` (GELU-tanh) and has no `hidden_act`, so a plan built from the
    config would score with SiLU. The int8 predictor's scores are |act(g~) * u~| with GELU-tanh, here
    computed in float64 from the dequantized rows."""
    from dejavu_compile.activations import ACTIVATIONS
    from dejavu_compile.testing.tiny import tiny_model

    model = tiny_model("gemma3_text", hidden_activation="gelu_pytorch_tanh")
    assert not hasattr(model.config, "hidden_act")
    ids = torch.randint(3, model.config.vocab_size, (4, 1, 48), generator=torch.Generator().manual_seed(0))
    samples, _ = collect(model, list(ids), progress=False)
    plan = calibrate(model, None, samples=samples, predictor="int8", mlp_density=0.5, progress=False,
                     dense_when_unprofitable=False)
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    act = ACTIVATIONS["gelu_tanh"].reference
    for layer in range(model.config.num_hidden_layers):
        e = plan.entry(layer, "mlp")
        assert e.predictor == "glu_int8" and e.activation == "gelu_tanh" and not e.dense
        rows = e.tensors["rows"].double() * e.tensors["scales"].double()[:, None]
        h = x.double() @ rows.T
        want = (act(h[:, :e.total]) * h[:, e.total:]).abs()
        torch.testing.assert_close(e.scores(x).double(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
