"""Dense model -> SparsityPlan: collect activations, fit predictors, choose k per layer.

    plan = calibrate(model, tokenizer)                 # bundled Wikipedia calibration split
    plan = calibrate(model, tokenizer, texts=[...], mlp_density=0.6)
    plan = calibrate(model, tokenizer, values="exact")   # kept neurons computed from the fp32 weights
    plan = calibrate(model, tokenizer, max_ppl_increase=0.03)   # quality budget instead of density

CLI: `dejavu-compile calibrate --out DIR [--density D] ...` (see `main_calibrate`).
"""
from __future__ import annotations

import argparse
import time

import torch

from dejavu_compile.calibration import budget
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint, predictor_read_bytes
from dejavu_compile.plan.predictors import (fit_glu_predictor, fit_int4_glu_predictor, glu_scores, int4_glu_scores,
                                       int8_glu_predictor, int8_glu_scores, mass_captured, mass_curve, recall,
                                       train_predictor)

from dejavu_compile.calibration.collect import collect

# Recommended operating point, measured with benchmarks/decode.py on SmolLM2-135M (held-out
# Wikipedia / news, 2 CPU cores, fp32): for gated MLPs on CPU the int8 predictor (the block's own
# gate/up weights in int8: near-oracle selection) with the kept neurons' values taken from it (only
# their down rows are read) at 60% MLP density in every layer: +0.8% / +1.4% perplexity, decode at
# 1.32x dense Inductor with the backend's C++ ops (1.30x and 1.37x in two earlier runs whose plans
# spread the density greedily; 50%: +2.0% / +5.0%, over the news budget). With exact values the same
# selection also reads the kept gate/up rows and only matches dense speed (0.92-1.00x).
# The low-rank lookahead predictor is far from the oracle on this SwiGLU model: within the <= +3%
# budget it stays barely sparse (0.98 -> one sparse layer, +1.9% / +2.4%, 0.95-0.98x). Off the CPU,
# and for plain MLPs (OPT, GPT-2: no gate to quantize), the default stays the low-rank predictor:
# the int8 GEMV has no GPU kernel yet (CUDA runs it as a dequantized matmul).
# The learned int4 predictor (calibrate(predictor="int4"), exact values) selects nearly as the oracle
# does (50%: +2.3% / +6.4% against +2.4% / +5.4%; 60%: +1.0% / +4.1%) but has no kernel yet: its scores
# come from aten ops that dequantize every step (0.5x dense), so it is a quality option.
DEFAULT_MLP_DENSITY = {"int8": 0.6, "int4": 0.6, "lowrank": 0.98}
QUANTIZED_PREDICTORS = ("int8", "int4")  # copies of the block's own gate/up rows: gated MLPs only
DEFAULT_RANK_FRACTION = 0.25  # predictor rank r = fraction * d (per projection of the "glu" predictor)
DEFAULT_MAX_TOKENS = 8192
DEFAULT_SEQ_LEN = 256


def _mlp_blocks(model, blocks=None) -> dict:
    """layer -> matched MLP block record (from collection, else by tracing the model once)."""
    if blocks is None:
        from dejavu_compile.compiler.explain import matched_blocks

        blocks = matched_blocks(model)
    return {b.layer: b for b in blocks if getattr(b, "kind", None) == "mlp"}


def _weight_rows(model, ref) -> torch.Tensor:
    """A projection's weight as (F, d) rows, whatever its layout (nn.Linear, Conv1D, fused)."""
    w = model.get_parameter(ref.name).detach().float()
    if ref.layout == "in_out":
        w = w.t()
    if ref.rows is not None:
        w = w[ref.rows[0] : ref.rows[1]]
    return w


def _activation(cfg):
    from dejavu_compile import activations

    return activations.torch_fn(str(getattr(cfg, "hidden_act", "silu")))


def _split(n: int, frac: float = 0.8, seed: int = 0):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(n * frac)
    return perm[:cut], perm[cut:]


def calibrate(
    model,
    tokenizer,
    texts=None,
    mlp_density: float | None = None,
    attn_density: float = 1.0,
    lookahead: bool | None = None,
    rank: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    min_density: float = 0.125,
    allocation: str = "auto",
    max_ppl_increase: float | None = None,
    predictor: str = "auto",
    values: str = "auto",
    train_steps: int = 400,
    dense_when_unprofitable: bool = True,
    progress: bool = True,
    seed: int = 0,
    samples=None,
    return_builder: bool = False,
) -> SparsityPlan:
    """Calibrate a sparsity plan for `model` on `texts`.

    Gated MLPs (LLaMA, Qwen, Mistral: act(gate(x)) * up(x)) get the low-rank gated predictor or the
    int8 one; plain MLPs (OPT, GPT-2: act(up(x))) get Deja Vu's two-layer low-rank predictor, trained
    with binary cross-entropy to flag each token's top neurons at the target density.

    texts: list of strings, a single string, or None for the bundled Wikipedia calibration split.
    mlp_density / attn_density: target average fraction of MLP neurons / query heads kept (mlp_density
        None: the predictor's recommended point, DEFAULT_MLP_DENSITY: 0.6 for int8 and int4, 0.98 for
        lowrank).
    lookahead: predictors read the previous block's input (can run beside it). None: with the
        low-rank predictor (Deja Vu's setting); not with int4 (on SmolLM2 at 50% it costs +16% /
        +19% perplexity there instead of +2.3% / +6.4%); never with int8 (it is the block's own projection).
    allocation: how the MLP density budget is spread over layers: "uniform" (every layer keeps the
        same share, on a grid of 32 neurons), "greedy" (`budget.allocate` on each layer's curve of
        1 - captured |activation| mass: layers where the predictor is poor stay denser) or "auto"
        (uniform for the int8 and int4 predictors, which are near the oracle everywhere; greedy for
        the low-rank ones). Measured on SmolLM2 at 50%: uniform +2.0% / +5.0% held-out perplexity
        against greedy's +2.8% / +5.7% with int8, +2.3% / +6.4% against +4.1% / +8.1% with int4.
    dense_when_unprofitable: keep a layer dense when its kept rows plus its predictor would read at
        least as many bytes as the dense block (the plan's density can then exceed the target).
    predictor: "lowrank" (Deja Vu-style, rank `rank`, with lookahead), "int8" (the block's own
        gate/up weights in int8: near-oracle selection, reads the block's own input, no lookahead),
        "int4" (gated MLPs: a 4-bit copy of gate/up fitted to the collected activations, see
        `fit_int4_glu_predictor`: the learned predictor closest to the oracle, exact values only) or
        "auto" (int8 when every MLP is gated and the model is on the CPU, else lowrank).
    values: where the kept neurons' act(gate) * up come from: "exact" (the block's own fp32 weights),
        "predictor" (the int8 predictor's own values, which it computes for every neuron anyway: the
        sparse block then reads only the kept rows of its down projection; int8 only) or "auto"
        ("predictor" with the int8 predictor, else "exact").
    train_steps: optimizer steps of each trained (plain-MLP) predictor; more steps, better recall.
    max_ppl_increase: instead of `mlp_density`, the lowest density (grid of 0.05) whose perplexity
        increase on held-back calibration text stays within this relative budget (e.g. 0.03).
    samples: precomputed `collect` output (skips collection; for experiments and tests).
    return_builder: return `build(mlp_density) -> SparsityPlan` instead of a plan, to make plans of
        several densities from one fit (attention density stays `attn_density`).
    """
    from tqdm.auto import tqdm

    from dejavu_compile.assets.data import tokenize_chunks

    if predictor not in ("auto", "lowrank", "int8", "int4"):
        raise ValueError(f"predictor must be 'auto', 'lowrank', 'int8' or 'int4', got {predictor!r}")
    if values not in ("auto", "exact", "predictor"):
        raise ValueError(f"values must be 'auto', 'exact' or 'predictor', got {values!r}")
    if allocation not in ("auto", "uniform", "greedy"):
        raise ValueError(f"allocation must be 'auto', 'uniform' or 'greedy', got {allocation!r}")
    torch.manual_seed(seed)
    t0 = time.time()
    if texts is None:
        from dejavu_compile.assets.data import wiki_articles

        texts = wiki_articles("calibration")
    holdout = []
    blocks = None
    if samples is None:
        extra = 4 * seq_len if max_ppl_increase is not None else 0
        chunks = tokenize_chunks(tokenizer, texts, seq_len, max_tokens + extra)
        if extra:
            holdout, chunks = chunks[-4:], chunks[:-4]
        samples, blocks = collect(model, chunks, max_tokens=max_tokens, progress=progress)
    elif max_ppl_increase is not None:
        holdout = tokenize_chunks(tokenizer, texts, seq_len, 4 * seq_len)
    t_collect = time.time() - t0

    cfg = model.config
    layers = sorted(samples)
    mlp_blocks = _mlp_blocks(model, blocks)
    missing = [l for l in layers if l not in mlp_blocks]
    if missing:
        raise ValueError(f"layers {missing} have samples but no matched MLP block")
    all_gated = all(mlp_blocks[l].gated for l in layers)
    if predictor == "auto":
        on_cpu = next(model.parameters()).device.type == "cpu"
        predictor = "int8" if on_cpu and all_gated else "lowrank"
    if values == "auto":
        values = "predictor" if predictor == "int8" else "exact"
    if values == "predictor" and predictor != "int8":
        raise ValueError("values='predictor' takes the kept neurons' values from the int8 predictor: "
                         "use predictor='int8' (or values='exact')")
    if predictor == "int8":
        lookahead = False  # it is the block's own projection: it needs the block's own input
    elif lookahead is None:
        lookahead = predictor == "lowrank"
    if mlp_density is None:
        mlp_density = DEFAULT_MLP_DENSITY[predictor]
    if allocation == "auto":
        allocation = "uniform" if predictor in QUANTIZED_PREDICTORS else "greedy"
    if predictor in QUANTIZED_PREDICTORS and not all_gated:
        raise ValueError(f"predictor={predictor!r} scores gated MLPs (act(gate(x)) * up(x)) with a copy of their "
                         "weights; this model's MLPs are plain (act(up(x))): use predictor='lowrank'")
    d, H = cfg.hidden_size, cfg.num_attention_heads
    F_ = samples[layers[0]].mlp_importance.shape[1]
    r = rank or max(8, int(round(DEFAULT_RANK_FRACTION * d)))
    n = samples[layers[0]].mlp_input.shape[0]
    fit_idx, val_idx = _split(n, 0.8, seed)
    # k in multiples of 32 (wide models): the sparse kernels split k into equal parts (bags,
    # blocks); another k (e.g. a prime) works too, padded to equal parts.
    multiple = 32 if F_ >= 512 else 1
    grid_mlp = budget.k_grid(F_, min_density, 20, multiple=multiple)
    grid_att = budget.k_grid(H, min(min_density, 1.0 / H), H)

    preds: dict[tuple[int, str], dict] = {}
    val_scores: dict[int, torch.Tensor] = {}
    val_heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (head scores, true importance)
    curves: dict[str, dict[int, dict[int, float]]] = {"mlp": {}, "attention": {}}
    for l in tqdm(layers, desc="train predictors", disable=not progress, unit="layer"):
        s = samples[l]
        # MLP: closed-form low-rank gated predictor; lookahead input = this layer's attention input.
        x_in = s.attn_input if lookahead else s.mlp_input
        block = mlp_blocks[l]
        if not block.gated:  # Deja Vu's predictor, as in its OPT code: linear-linear, BCE on the top set
            p = train_predictor(x_in[fit_idx], s.mlp_importance[fit_idx], max(1, round(mlp_density * F_)),
                                rank=r, loss="bce", steps=train_steps, seed=seed)
            t = p.tensors()
            with torch.no_grad():
                sc = p(x_in[val_idx])
        elif predictor == "int8":
            t = int8_glu_predictor(_weight_rows(model, block.gate), _weight_rows(model, block.up))
            sc = int8_glu_scores(x_in[val_idx], t, _activation(cfg))
        elif predictor == "int4":
            t = fit_int4_glu_predictor(x_in[fit_idx], _weight_rows(model, block.gate), _weight_rows(model, block.up),
                                       x_block=s.mlp_input[fit_idx] if lookahead else None)
            sc = int4_glu_scores(x_in[val_idx], t, _activation(cfg))
        else:
            gate_w, up_w = _weight_rows(model, block.gate), _weight_rows(model, block.up)
            t = fit_glu_predictor(x_in[fit_idx], s.mlp_input[fit_idx], gate_w, up_w, r)
            sc = glu_scores(x_in[val_idx], t, _activation(cfg))
        preds[(l, "mlp")] = t
        val_scores[l] = sc
        imp = s.mlp_importance[val_idx]
        curves["mlp"][l] = {k: 1.0 - m for k, m in mass_curve(sc, imp, grid_mlp).items()}
        # Attention: Deja Vu's two-layer predictor, listwise loss (serves every k), H is tiny.
        if attn_density < 1.0:
            xa = samples[l - 1].mlp_input if (lookahead and l > 0) else s.attn_input
            p = train_predictor(xa[fit_idx], s.attn_importance[fit_idx], max(1, H // 2), rank=min(64, d),
                                loss="soft", steps=150, batch_size=2048, seed=seed)
            preds[(l, "attention")] = p.tensors()
            with torch.no_grad():
                sa = p(xa[val_idx])
            ia = s.attn_importance[val_idx]
            val_heads[l] = (sa, ia)
            curves["attention"][l] = {k: 1.0 - m for k, m in mass_curve(sa, ia, grid_att).items()}

    # Bytes a sparse layer reads for its predictor, as a share of the dense block's bytes.
    element_size = next(model.parameters()).element_size()
    pred_bytes = predictor_read_bytes(preds[(layers[0], "mlp")].values(), predictor in QUANTIZED_PREDICTORS, element_size)
    gated = mlp_blocks[layers[0]].gated
    predictor_cost = pred_bytes / ((3 if gated else 2) * d * F_ * element_size)
    row_share = 1 / 3 if values == "predictor" else 1.0  # of the block's bytes a kept neuron reads

    def build(density: float) -> SparsityPlan:
        if allocation == "uniform":
            kmlp = {l: budget.uniform(F_, density, multiple) for l in layers}
        else:
            kmlp = budget.allocate(curves["mlp"], {l: F_ for l in layers}, density)
        if dense_when_unprofitable:  # a layer whose rows plus predictor outweigh the dense block
            kmlp = {l: (F_ if row_share * k / F_ + predictor_cost >= 1.0 else k) for l, k in kmlp.items()}
        katt = (budget.allocate(curves["attention"], {l: H for l in layers}, attn_density)
                if attn_density < 1.0 else {l: H for l in layers})
        entries = {}
        for l in layers:
            s = samples[l]
            k = kmlp[l]
            t = preds[(l, "mlp")]
            imp = s.mlp_importance[val_idx]
            sc = val_scores[l]
            stats = {"recall": recall(sc, imp, k), "mass": mass_captured(sc, imp, k),
                     "oracle_mass": mass_captured(imp, imp, k)}
            if k >= F_:
                entries[(l, "mlp")] = PlanEntry(l, "mlp", F_, F_, nonlinearity="dense", stats=stats)
            elif not mlp_blocks[l].gated:
                entries[(l, "mlp")] = PlanEntry(l, "mlp", k, F_, t["A"], t["B"], t["a"], t["b"], "none",
                                                mlp_blocks[l].activation, lookahead, stats=stats)
            else:
                entries[(l, "mlp")] = PlanEntry(l, "mlp", k, F_, t["A"], t.get("B"), t["a"], t.get("b"),
                                                {"int8": "glu_int8", "int4": "glu_int4"}.get(predictor, "glu"),
                                                str(getattr(cfg, "hidden_act", "silu")), lookahead, stats=stats,
                                                values=values)
            ka = katt[l]
            if ka >= H:
                entries[(l, "attention")] = PlanEntry(l, "attention", H, H, nonlinearity="dense")
            else:
                ta = preds[(l, "attention")]
                sa, ia = val_heads[l]
                head_stats = {"recall": recall(sa, ia, ka), "mass": mass_captured(sa, ia, ka),
                              "oracle_mass": mass_captured(ia, ia, ka)}
                entries[(l, "attention")] = PlanEntry(l, "attention", ka, H, ta["A"], ta["B"], ta.get("a"), ta.get("b"),
                                                      "none", lookahead=lookahead and l > 0, stats=head_stats)
        settings = {
            "method": f"dejavu-glu-{'lowrank' if predictor == 'lowrank' else predictor}" if gated else "dejavu-lowrank",
            "predictor": predictor, "values": values,
            "target_mlp_density": density, "attn_density": attn_density,
            "lookahead": lookahead, "rank": r, "max_tokens": max_tokens, "seq_len": seq_len,
            "tokens_collected": n, "min_density": min_density, "allocation": allocation, "seed": seed,
            "max_ppl_increase": max_ppl_increase, "predictor_cost": round(predictor_cost, 4),
            "dense_when_unprofitable": dense_when_unprofitable, "collect_s": round(t_collect, 1),
            "total_s": round(time.time() - t0, 1),
        }
        return SparsityPlan(entries, fingerprint, settings)

    fingerprint = model_fingerprint(model)
    if return_builder:  # one fit, many densities (benchmarks)
        return build
    if max_ppl_increase is None:
        return build(mlp_density)

    # Quality budget: lowest density on a 0.05 grid within the budget on held-back calibration text.
    from dejavu_compile.evaluation.perplexity import perplexity

    base = perplexity(model, holdout)
    best = SparsityPlan.dense(model, {"method": "dense", "max_ppl_increase": max_ppl_increase})
    best.fingerprint = fingerprint
    for density in [round(1.0 - 0.05 * i, 2) for i in range(1, 15)]:
        plan = build(density)
        inc = perplexity(model, holdout, plan) / base - 1.0
        if progress:
            print(f"density {density:.2f}: calibration-holdout perplexity {inc:+.2%}")
        if inc > max_ppl_increase:
            break
        plan.settings["holdout_ppl_increase"] = inc
        best = plan
    return best


def main_calibrate(argv=None) -> int:
    """`dejavu-compile calibrate --out DIR [--density D] [--attn-density D] [--texts FILE] ...`"""
    ap = argparse.ArgumentParser(prog="dejavu-compile calibrate", description="Calibrate a Deja Vu sparsity plan.")
    ap.add_argument("--out", required=True, help="directory to write the plan to")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (bundled GGUF) or a local HF model directory")
    ap.add_argument("--density", type=float, default=None,
                    help="average MLP density to keep (default: 0.6 with the int8 and int4 predictors, 0.98 with lowrank)")
    ap.add_argument("--attn-density", type=float, default=1.0, help="average attention head density")
    ap.add_argument("--max-ppl-increase", type=float, default=None, help="quality budget, e.g. 0.03 (overrides --density)")
    ap.add_argument("--texts", default=None, help="text file to calibrate on (default: bundled Wikipedia split)")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--predictor", choices=("auto", "lowrank", "int8", "int4"), default="auto",
                    help="lowrank: Deja Vu-style with lookahead; int8: the block's own gate/up in int8 (near-oracle); "
                         "int4: gate/up in 4 bits fitted to the calibration activations (learned, near-oracle, no "
                         "fast kernel yet); auto: int8 for gated MLPs on CPU, else lowrank")
    ap.add_argument("--values", choices=("auto", "exact", "predictor"), default="auto",
                    help="kept neurons' act(gate)*up: exact (fp32 weights) or from the int8 predictor (reads only "
                         "their down rows); auto: predictor with the int8 predictor")
    ap.add_argument("--allocation", choices=("auto", "uniform", "greedy"), default="auto",
                    help="spread of the MLP density over layers: uniform, or greedy on each layer's captured "
                         "mass; auto: uniform with the int8/int4 predictors, greedy with lowrank")
    ap.add_argument("--no-lookahead", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        from dejavu_compile.assets.models import load_smollm2

        model, tok = load_smollm2()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(args.model)
    texts = None
    if args.texts:
        from dejavu_compile.assets.data import read_text_file

        texts = read_text_file(args.texts)
    plan = calibrate(model, tok, texts, mlp_density=args.density, attn_density=args.attn_density,
                     lookahead=False if args.no_lookahead else None, rank=args.rank, predictor=args.predictor, values=args.values,
                     max_tokens=args.max_tokens, allocation=args.allocation,
                     max_ppl_increase=args.max_ppl_increase)
    plan.save(args.out)
    print(plan.summary())
    print(f"wrote {args.out} (MLP density {plan.mlp_density:.3f}, {plan.settings.get('total_s')} s)")
    return 0
