"""The command line and the demo's helpers, on tiny models (the real demo needs minutes)."""
import json

import pytest
import torch

from dejavu_compile import cli
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
        plan = _int8_values_plan(model, 0.5)
        assert abs(bandwidth_bound(model, plan) - expected) < 1e-9, arch
        # the kept down rows from a bf16 copy: half their bytes
        plan.down_rows = "bfloat16"
        expected = total / (total - (gate_up + 0.75 * down - predictors))
        assert abs(bandwidth_bound(model, plan) - expected) < 1e-9, arch
        # a screened head: its int8 copy (vocab x d bytes and an fp32 scale per row) and k fp32 rows
        head = model.get_output_embeddings().weight
        plan.head_candidates = 8
        vocab, width = head.shape
        screen = head.numel() * 4 * (1 - 8 / vocab) - vocab * (width + 4)
        expected = total / (total - (gate_up + 0.75 * down - predictors) - screen)
        assert abs(bandwidth_bound(model, plan) - expected) < 1e-9, arch


# ------------------------------------------------------------------ your own model from the command line

def _save_local_model(directory, **config):
    """A tiny random LLaMA with a byte-level tokenizer (no merges), as save_pretrained writes them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tiny_model("llama", vocab=len(vocab), **config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A local model directory and a plan calibrated for it through the CLI."""
    root = tmp_path_factory.mktemp("own-model")
    model_dir = _save_local_model(root / "tinyllama")
    plan_dir = root / "plan"
    assert main(["calibrate", "--model", str(model_dir), "--out", str(plan_dir), "--max-tokens", "512"]) == 0
    return model_dir, plan_dir


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _one_line_error(capsys, argv, *expected):
    """Exit code 2 and one error line, the last on stderr (progress bars of loading may precede it)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [l for l in lines if "error" in l.lower()] == lines[-1:], err
    assert lines[-1].startswith(f"dejavu-compile {argv[0]}: error: "), err
    assert all(e in lines[-1] for e in expected), lines[-1]
    return lines[-1]


@pytest.mark.slow  # Inductor compiles four variants
def test_calibrate_and_bench_a_local_model(local, tmp_path, capsys):
    model_dir, plan_dir = local
    assert (plan_dir / "plan.json").exists()
    before = _snapshot(plan_dir)
    capsys.readouterr()
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--model", str(model_dir), "--plan", str(plan_dir), "--new-tokens", "4", "--repeats", "1",
                 "--eval-tokens", "64", "--threads", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "model: tinyllama (llama)" in out and "loaded the plan from" in out
    for row in ("HF eager", "Inductor dense", "dejavu exact", "dejavu", "held-out perplexity (wiki",
                "held-out perplexity (news", "machine: ", "1 threads"):
        assert row in out, row
    assert "first words of each output" not in out  # bench: the table only
    record = json.loads(out_json.read_text())
    assert record["model"] == "tinyllama (llama)" and record["new_tokens"] == 4
    assert set(record["speed"]) == {"HF eager", "Inductor dense", "dejavu exact", "dejavu"}
    assert record["perplexity"]["wiki"]["dense"] > 1 and record["machine"]["threads"] == 1
    assert _snapshot(plan_dir) == before  # loading a plan leaves it as it was


def test_a_named_plan_directory_is_never_overwritten(local, tmp_path, capsys):
    model_dir, plan_dir = local
    before = _snapshot(plan_dir)
    _one_line_error(capsys, ["calibrate", "--model", str(model_dir), "--out", str(plan_dir)], "already holds a plan",
                    "--overwrite")
    _one_line_error(capsys, ["bench", "--model", str(model_dir), "--plan", str(plan_dir), "--recalibrate"],
                    "already holds a plan", "--overwrite")
    # A plan made for other weights: refused with the reason, not recalibrated over.
    other = tmp_path / "other-plan"
    SparsityPlan.dense(tiny_model("llama", seed=1, vocab=259)).save(other)
    other_before = _snapshot(other)
    _one_line_error(capsys, ["demo", "--model", str(model_dir), "--plan", str(other)], "does not fit",
                    "weights differ", "another --plan directory")
    assert _snapshot(other) == other_before
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    _one_line_error(capsys, ["bench", "--model", str(model_dir), "--plan", str(busy)], "not empty")
    _one_line_error(capsys, ["calibrate", "--model", str(model_dir), "--out", str(busy)], "not empty")
    assert _snapshot(busy) == {"notes.txt": b"mine"}
    assert _snapshot(plan_dir) == before


@pytest.fixture
def fake_calibration(monkeypatch, tmp_path):
    """calibrate() replaced by a dense plan, and the cache in tmp_path."""
    import dejavu_compile.calibration.calibrate as calibration

    calls = []

    def fake(model, tokenizer, *args, **kwargs):
        calls.append(model)
        return SparsityPlan.dense(model, {"method": "fake"})

    monkeypatch.setattr(calibration, "calibrate", fake)
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path / "cache"))
    return calls


def _resolve(plan=None, recalibrate=False, overwrite=False, model=None):
    import argparse

    ap = cli._Parser(prog="test")
    args = argparse.Namespace(plan=None if plan is None else str(plan), recalibrate=recalibrate,
                              overwrite=overwrite, model=cli.BUNDLED)
    return cli._resolve_plan(ap, args, model, None)


def test_where_demo_and_bench_write_a_new_plan(fake_calibration, tmp_path, capsys):
    model = tiny_model("llama")
    # A new or empty user-named directory receives the new plan.
    for target in (tmp_path / "new" / "plan", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        plan, where = _resolve(target, model=model)
        assert where == target and (target / "plan.json").exists()
    assert len(fake_calibration) == 2
    # Then it is loaded, not calibrated again.
    _resolve(tmp_path / "empty", model=model)
    assert len(fake_calibration) == 2
    # --recalibrate --overwrite replaces it.
    _resolve(tmp_path / "empty", recalibrate=True, overwrite=True, model=model)
    assert len(fake_calibration) == 3
    # The default cache directory is refreshed when its plan belongs to other weights.
    _, default = _resolve(model=model)
    assert str(default).startswith(str(tmp_path / "cache")) and len(fake_calibration) == 4
    SparsityPlan.dense(tiny_model("llama", seed=1)).save(default)
    plan, _ = _resolve(model=model)
    plan.check(model)
    assert len(fake_calibration) == 5
    assert "calibrating again" in capsys.readouterr().out


@pytest.fixture(scope="module")
def unmatched_model(tmp_path_factory):
    # QuickGELU is in no built-in activation table: no MLP block is matched.
    return _save_local_model(tmp_path_factory.mktemp("unmatched") / "quickgelu", hidden_act="quick_gelu")


BAD_ARGUMENTS = [
    (["demo", "--threads", "0"], "--threads"),
    (["bench", "--threads", "-2"], "--threads"),
    (["calibrate", "--out", "{tmp}/p", "--threads", "0"], "--threads"),
    (["calibrate", "--out", "{tmp}/p", "--density", "0"], "--density"),
    (["calibrate", "--out", "{tmp}/p", "--density", "1.5"], "--density"),
    (["calibrate", "--out", "{tmp}/p", "--density", "-0.5"], "--density"),
    (["demo", "--new-tokens", "1"], "--new-tokens"),
    (["bench", "--new-tokens", "0"], "--new-tokens"),
    (["calibrate", "--out", "{tmp}/p", "--texts", "{tmp}/missing.txt"], "--texts"),
    (["demo", "--model", "{tmp}/no-such-model"], "not a directory"),
    (["bench", "--model", "{tmp}"], "no config.json"),
    (["calibrate", "--out", "{tmp}/p", "--model", "{tmp}"], "no config.json"),
    (["bench", "--model", "{unmatched}"], "matches no MLP block"),
    (["calibrate", "--out", "{tmp}/p", "--model", "{unmatched}"], "matches no MLP block"),
]


@pytest.mark.parametrize("argv,expected", BAD_ARGUMENTS, ids=[" ".join(a[:3]) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors(argv, expected, tmp_path, capsys, request):
    fill = {"tmp": str(tmp_path)}
    if any("{unmatched}" in a for a in argv):
        fill["unmatched"] = str(request.getfixturevalue("unmatched_model"))
    _one_line_error(capsys, [a.format(**fill) for a in argv], expected)
    assert not (tmp_path / "p").exists()


def test_every_command_has_help(capsys):
    for command in ("demo", "bench", "calibrate", "explain"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        assert "--model" in capsys.readouterr().out or command == "explain"
