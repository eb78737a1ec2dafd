"""The command line and the demo's helpers, on tiny models (the real demo needs minutes)."""
import torch

from dejavu_compile.cli import main
from dejavu_compile.evaluation.bandwidth import bandwidth_bound
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint
from dejavu_compile.testing.tiny import tiny_model


def test_explain_command_prints_the_report(capsys):
    assert main(["explain", "llama"]) == 0
    out = capsys.readouterr().out
    assert "MLP matched in 2, attention matched in 2" in out and "left dense: nothing" in out


def test_unknown_command_prints_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert "usage: dejavu-compile" in capsys.readouterr().out
    assert main(["--help"]) == 0


def _twolayer(rank, total):
    return {"in_proj": torch.zeros(64, rank), "out_proj": torch.zeros(rank, total)}


def _plan(model, density, rank=4):
    entries = {(l, "mlp"): PlanEntry(l, "mlp", round(128 * density), 128, "twolayer", _twolayer(rank, 128),
                                     lookahead=True) for l in range(2)}
    return SparsityPlan(entries, model_fingerprint(model))


def test_bandwidth_bound_counts_kept_rows_and_predictors():
    model = tiny_model("llama")
    dense = bandwidth_bound(model, _plan(model, 1.0, rank=0))
    assert abs(dense - 1.0) < 1e-9
    half, quarter = bandwidth_bound(model, _plan(model, 0.5)), bandwidth_bound(model, _plan(model, 0.25))
    assert 1.0 < half < quarter
    # A predictor as large as the neurons it saves earns nothing.
    assert bandwidth_bound(model, _plan(model, 0.5, rank=96)) < half


def test_bandwidth_bound_by_hand():
    """Weights read per step: all but the untied input embedding (one row per token); a plan saves
    the dropped MLP rows and pays for its predictors."""
    model = tiny_model("llama")
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    mlp = sum(p.numel() for name, p in model.named_parameters() if ".mlp." in name)
    predictors = 2 * (64 * 4 + 4 * 128)
    expected = total / (total - (0.5 * mlp - predictors))
    assert abs(bandwidth_bound(model, _plan(model, 0.5)) - expected) < 1e-9
    # Heads: 2 of 4 kept saves half of each q and o projection, less the head predictors.
    plan = _plan(model, 0.5)
    plan.entries.update({(l, "attention"): PlanEntry(l, "attention", 2, 4, "twolayer", _twolayer(4, 4),
                                                     lookahead=l > 0) for l in range(2)})
    q_and_o = sum(p.numel() for name, p in model.named_parameters() if "q_proj" in name or "o_proj" in name)
    expected = total / (total - (0.5 * mlp - predictors) - (0.5 * q_and_o - 2 * (64 * 4 + 4 * 4)))
    assert abs(bandwidth_bound(model, plan) - expected) < 1e-9


def _int8_values_plan(model, density):
    from dejavu_compile.compiler.explain import matched_blocks

    entries = {}
    for block in matched_blocks(model):
        if block.kind == "mlp":
            F, d = block.intermediate_size, block.hidden_size
            entries[(block.layer, "mlp")] = PlanEntry(
                block.layer, "mlp", round(F * density), F, "glu_int8",
                {"rows": torch.zeros(2 * F, d, dtype=torch.int8), "scales": torch.ones(2 * F)}, values="predictor")
    return SparsityPlan(entries, model_fingerprint(model))


def test_bandwidth_bound_with_the_predictors_values():
    """Values from the int8 predictor: gate and up are not read at all, the down projection only
    for the kept rows; the int8 predictor (2F x d bytes + 2F fp32 scales) is paid for. Phi-3's fused
    gate_up_proj counts once (each role owns half its rows)."""
    for arch, names in (("llama", ("gate_proj", "up_proj")), ("phi3", ("gate_up_proj",))):
        model = tiny_model(arch)
        params = dict(model.named_parameters())
        total = sum(p.numel() for p in model.parameters()) * 4
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            total -= model.get_input_embeddings().weight.numel() * 4
        gate_up = sum(p.numel() for n, p in params.items() if any(f"mlp.{k}." in n for k in names)) * 4
        down = sum(p.numel() for n, p in params.items() if "mlp.down_proj." in n) * 4
        F, d, layers = model.config.intermediate_size, model.config.hidden_size, model.config.num_hidden_layers
        predictors = layers * (2 * F * d + 2 * F * 4)
        expected = total / (total - (gate_up + 0.5 * down - predictors))
        assert abs(bandwidth_bound(model, _int8_values_plan(model, 0.5)) - expected) < 1e-9, arch
