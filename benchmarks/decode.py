"""Decode speed and quality side by side: HF eager, Inductor dense, dejavu over a density sweep.

    python benchmarks/decode.py                 # SmolLM2-135M sweep + synthetic LLaMA-1B-shaped layers
    python benchmarks/decode.py --quick         # fewer densities and tokens
    python benchmarks/decode.py --device cuda --skip-smollm2 --synthetic-shape 7b --mode reduce-overhead

Speed: tokens/s of the decode phase (static cache, batch 1), variants interleaved in one process on
the same prompt, medians over repeats. Quality: held-out Wikipedia perplexity of the same plan
(masked simulation through the backend, which selects exactly the neurons the sparse ops use).
Writes benchmarks/results/decode.json and decode.png (speedup vs perplexity increase).
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def synthetic_plan(model, density: float, rank: int, seed: int = 0, attn_density: float = 1.0):
    """Low-rank predictors fitted for one step on random data (speed only: shapes and k matter, not
    what is selected); the kind is the one the "lowrank" alias fits to plain MLPs and heads."""
    from dejavu_compile.plan import predictors
    from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint

    kind = predictors.option_kinds("lowrank")[1]
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size
    entries = {}
    for layer in range(cfg.num_hidden_layers):
        parts = [("mlp", cfg.intermediate_size, density, rank)]
        if attn_density < 1.0:
            parts.append(("attention", cfg.num_attention_heads, attn_density, 16))
        for block, total, share, r in parts:
            x = torch.randn(64, d, generator=gen)
            data = predictors.FitInputs(x=x, x_block=x, importance=torch.rand(64, total, generator=gen), gate=None,
                                        up=torch.randn(total, d, generator=gen), k=max(1, round(total * share)),
                                        rank=r, steps=1, seed=seed, lookahead=True)
            entries[(layer, block)] = PlanEntry(layer, block, data.k, total, kind.name, kind.fit(data),
                                                lookahead=block == "mlp" or layer > 0)
    return SparsityPlan(entries, model_fingerprint(model))


# --predictors: how each plan is calibrated. "int8" is the default plan's method (values from the
# int8 predictor: only the kept down rows are read); "int8-exact" selects the same neurons but
# computes their values from the fp32 gate/up rows; "int4" is the learned 4-bit predictor (exact values,
# scored by aten ops that dequantize its rows each step: no int4 kernel yet).
PREDICTORS = {"lowrank": {"predictor": "lowrank"}, "int8": {"predictor": "int8", "values": "predictor"},
              "int8-exact": {"predictor": "int8", "values": "exact"}, "int4": {"predictor": "int4"}}


def synthetic_int8_plan(model, density: float):
    """The default plan's method on random weights: the training-free kind built from each MLP's own
    gate/up rows, kept neurons' values from it (speed only)."""
    from dejavu_compile.plan import predictors
    from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint

    kind = predictors.training_free_kind()
    entries = {}
    for layer, block in enumerate(model.model.layers):
        gate, up = block.mlp.gate_proj.weight, block.mlp.up_proj.weight
        total = gate.shape[0]
        entries[(layer, "mlp")] = PlanEntry(layer, "mlp", max(1, round(total * density)), total, kind.name,
                                            kind.from_weights(gate, up), model.config.hidden_act, values="predictor")
    return SparsityPlan(entries, model_fingerprint(model))


def _heads(attn_density: float) -> str:
    return "" if attn_density >= 1.0 else f" h{attn_density:.2f}"


def run_smollm2(args, report):
    from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.calibration.calibrate import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN, calibrate
    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.cli import DEMO_PROMPT
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, measure_decode
    from dejavu_compile.evaluation.perplexity import perplexity

    model, tok = load_smollm2()
    samples, _ = collect(model, tokenize_chunks(tok, wiki_articles("calibration"), DEFAULT_SEQ_LEN, DEFAULT_MAX_TOKENS),
                         max_tokens=DEFAULT_MAX_TOKENS)  # one collection for every predictor
    builders = {p: calibrate(model, tok, attn_density=args.attn_density, return_builder=True, samples=samples,
                             **PREDICTORS[p]) for p in args.predictors}
    prepare_model(model)
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    chunks = tokenize_chunks(tok, wiki_articles("eval"), seq_len=256, max_tokens=args.eval_tokens)
    news = tokenize_chunks(tok, news_texts(), seq_len=256, max_tokens=args.eval_tokens)
    dense_ppl, dense_news = perplexity(model, chunks), perplexity(model, news)
    plans = {f"dejavu {p} {d:.2f}{_heads(args.attn_density)}": build(d)
             for p, build in builders.items() for d in args.densities}
    variants = [Variant("HF eager"), Variant("Inductor dense", compiled_forward("inductor"))]
    lowering_of = {}
    for lowering in args.cpu_lowering:  # CPU sparse-MLP lowerings side by side (op: the C kernel)
        for name, plan in plans.items():
            label = name if lowering == "auto" else f"{name} [{lowering}]"
            lowering_of[label] = (name, lowering)
            options = {"plan": plan, "cpu_lowering": lowering}
            variants.append(Variant(label, compiled_forward("dejavu", options=options)))
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats)
    quality = {}
    base = speed["Inductor dense"]["tokens_per_s"]
    rows = []
    for name, row in speed.items():
        entry = {"variant": name, "tokens_per_s": row["tokens_per_s"],
                 "speedup_vs_inductor": row["tokens_per_s"] / base, "runs": row["runs"]}
        if name in lowering_of:
            plan_name, lowering = lowering_of[name]
            plan = plans[plan_name]
            method = plan_name.split()[1]
            if plan_name not in quality:  # the same selection whatever the lowering: evaluate once
                quality[plan_name] = perplexity(model, chunks, plan, progress=True), perplexity(model, news, plan)
            ppl, ppl_news = quality[plan_name]
            entry["cpu_lowering"] = lowering
            bound = bandwidth_bound(model, plan)
            mlp = [e for e in plan.entries.values() if e.kind == "mlp"]
            entry.update(method=method, predictor=plan.settings.get("predictor"), values=plan.settings.get("values"),
                         mlp_density=plan.mlp_density,
                         attn_density=plan.attn_density, perplexity=ppl,
                         ppl_increase=ppl / dense_ppl - 1, news_ppl_increase=ppl_news / dense_news - 1,
                         mean_recall=sum(e.stats.get("recall", 1.0) for e in mlp) / len(mlp),
                         lookahead=any(e.lookahead for e in mlp),
                         bandwidth_bound=bound, efficiency=entry["speedup_vs_inductor"] / bound)
        else:
            entry.update(mlp_density=1.0, perplexity=dense_ppl, ppl_increase=0.0, news_ppl_increase=0.0)
        rows.append(entry)
    report["smollm2"] = rows
    print(f"\nSmolLM2-135M, CPU fp32, batch 1, static cache, {args.new_tokens} new tokens "
          f"(held-out perplexity on {sum(c.numel() for c in chunks)} Wikipedia tokens, dense {dense_ppl:.2f})")
    print(f"{'variant':<34}{'MLP density':>12}{'tokens/s':>10}{'speedup':>9}{'bound':>7}{'eff.':>6}{'recall':>7}"
          f"{'ppl':>8}{'Δppl wiki':>10}{'news':>8}")
    for r in rows:
        print(f"{r['variant']:<34}{r['mlp_density']:>12.2f}{r['tokens_per_s']:>10.2f}{r['speedup_vs_inductor']:>8.2f}x"
              f"{r.get('bandwidth_bound', 1.0):>6.2f}x{r.get('efficiency', 1.0):>6.2f}{r.get('mean_recall', 1.0):>7.2f}"
              f"{r['perplexity']:>8.2f}{r['ppl_increase']:>+10.1%}{r['news_ppl_increase']:>+8.1%}")


SYNTHETIC_SHAPES = {  # LLaMA-3.2-1B-like and LLaMA-7B-like layers
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
}


def run_synthetic(args, report):
    """LLaMA-shaped layers with random weights: how the gain scales with model width (and on GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dejavu_compile import dejavu_backend
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, measure_decode

    shape = SYNTHETIC_SHAPES[args.synthetic_shape]
    config = AutoConfig.for_model("llama", num_hidden_layers=args.synthetic_layers, vocab_size=32000,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(config).eval().to(args.device, dtype)
    prepare_model(model)
    ids = torch.randint(3, 32000, (1, 8), device=args.device)
    densities = (0.5, 0.25)
    kwargs = {"mode": args.mode} if args.mode else {}

    head_densities = dict.fromkeys((1.0, args.attn_density))  # with heads: also without, in the same process
    plans = {f"dejavu {d:.2f}{_heads(a)}": synthetic_plan(model, d, 64, attn_density=a)
             for d in densities for a in head_densities}
    if args.device == "cpu" and dtype == torch.float32:  # the int8 method is a CPU fp32 lowering
        plans.update({f"dejavu int8 {d:.2f}": synthetic_int8_plan(model, d) for d in densities})
    bounds = {name: bandwidth_bound(model, plan) for name, plan in plans.items()}

    def dejavu(name, lowering):  # torch.compile refuses mode with options: give both to the backend
        backend = functools.partial(dejavu_backend, mode=args.mode,
                                    options={"plan": plans[name], "cpu_lowering": lowering})
        return Variant(name if lowering == "auto" else f"{name} [{lowering}]", compiled_forward(backend))

    variants = [Variant("HF eager"), Variant("Inductor dense", compiled_forward("inductor", **kwargs))]
    variants += [dejavu(name, lowering) for lowering in args.cpu_lowering for name in plans]
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens // 2, repeats=args.repeats)
    base = speed["Inductor dense"]["tokens_per_s"]
    rows = [{"variant": n, "tokens_per_s": r["tokens_per_s"], "speedup_vs_inductor": r["tokens_per_s"] / base,
             "bandwidth_bound": bounds.get(n.split(" [")[0], 1.0)} for n, r in speed.items()]
    key = f"synthetic_llama{args.synthetic_shape}_layers" + ("" if args.device == "cpu" else f"_{args.device}")
    report[key] = {"layers": args.synthetic_layers, **shape, "attn_density": args.attn_density,
                   "device": args.device, "dtype": args.dtype,
                   "mode": args.mode, "predictor_rank": 64, "rows": rows}
    print(f"\nLLaMA-{args.synthetic_shape}-shaped, {args.synthetic_layers} layers, random weights and predictors "
          f"(speed only; 'dejavu D': low-rank predictors, 'dejavu int8 D': the default plan's method), "
          f"{args.device} {args.dtype}, mode={args.mode}")
    for r in rows:
        print(f"{r['variant']:<34}{r['tokens_per_s']:>10.2f} tokens/s{r['speedup_vs_inductor']:>8.2f}x"
              f"   (bandwidth bound {r['bandwidth_bound']:.2f}x)")


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.get("smollm2", [])
            if r["variant"].startswith("dejavu") and r.get("cpu_lowering", "auto") == "auto"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"lowrank": "low-rank predictor", "int8": "int8 predictor, its values",
              "int8-exact": "int8 predictor, exact values"}
    for method in dict.fromkeys(r.get("method", r.get("predictor")) for r in rows):
        mine = sorted((r for r in rows if r.get("method", r.get("predictor")) == method),
                      key=lambda r: r["mlp_density"])
        ax.plot([100 * r["ppl_increase"] for r in mine], [r["speedup_vs_inductor"] for r in mine], "o-",
                label=f"dejavu, {labels.get(method, method)}")
    for r in rows:
        ax.annotate(f"{r['mlp_density']:.2f}", (100 * r["ppl_increase"], r["speedup_vs_inductor"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot([0], [1.0], "s", label="Inductor dense")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("symlog", linthresh=5)  # the low-rank plans reach +90%; the int8 ones stay under +6%
    ax.set_xlabel("held-out perplexity increase (%, Wikipedia; log scale above 5%)")
    ax.set_ylabel("decode speedup over Inductor dense")
    ax.set_title("SmolLM2-135M, CPU fp32, batch 1 (labels: MLP density)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.98])
    ap.add_argument("--predictors", nargs="+", default=list(PREDICTORS), choices=list(PREDICTORS),
                    help="int8: the default plan (kept neurons' values from the int8 predictor); int8-exact: the same "
                         "selection, values from the fp32 weights; int4: the learned 4-bit predictor (exact values); "
                         "lowrank: Deja Vu's low-rank lookahead predictor")
    ap.add_argument("--attn-density", type=float, default=1.0,
                    help="share of query heads kept (head predictors trained by calibration; 1.0: attention dense)")
    ap.add_argument("--cpu-lowering", nargs="+", default=["auto"], choices=["auto", "native", "op", "decomposed"],
                    help="CPU sparse-MLP lowerings to compare "
                         "(auto = decomposed under Inductor; op: the custom op, its C kernel)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--synthetic-layers", type=int, default=4)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true", help="synthetic shapes only (e.g. on a GPU machine)")
    ap.add_argument("--synthetic-shape", choices=list(SYNTHETIC_SHAPES), default="1b")
    ap.add_argument("--device", default="cpu", help="device of the synthetic model (SmolLM2 runs on CPU)")
    ap.add_argument("--dtype", default="float32", help="dtype of the synthetic model")
    ap.add_argument("--mode", default=None,
                    help="torch.compile mode for the synthetic run (reduce-overhead: CUDA graphs)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode.json)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.densities, args.new_tokens, args.repeats, args.eval_tokens = [0.5], 24, 2, 1024
    torch.set_num_threads(args.threads)
    from dejavu_compile.evaluation.bench import machine_description, write_result

    report = {"machine": machine_description(), "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    if not args.skip_smollm2:
        run_smollm2(args, report)
    if not args.skip_synthetic:
        run_synthetic(args, report)
    out = pathlib.Path(args.out) if args.out else RESULTS / "decode.json"
    print(f"\nmachine: {report['machine']}")
    write_result(out, report)
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
