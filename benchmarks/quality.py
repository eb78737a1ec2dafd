"""Quality harness: held-out perplexity, dense vs sparse, per selection method and MLP density.

All sparse numbers are a *masked dense simulation* (dense model, per-token 0/1 masks applied by
forward hooks, see dejavu_compile.experiments.quality): they measure quality, not speed. Plans whose kept
neurons take the int8 predictor's values ("int8_values", the default plan) and the learned int4
plans are evaluated through the backend's own masked simulation (dejavu_compile.evaluation.perplexity), the
graph the backend compiles with the decode step's predictor and top-k.

    python benchmarks/quality.py            # full sweep (~15-25 min on 2 CPU cores)
    python benchmarks/quality.py --quick    # 0.5 density only, fewer tokens

Writes benchmarks/results/quality.json, quality.png and prints a table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.evaluation.perplexity import perplexity as backend_perplexity
from dejavu_compile.experiments.quality import (
    SIM_LABEL,
    TealSelector,
    cats_selector,
    oracle_selector,
    perplexity,
    plan_selector,
    smollm2_harness,
)

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--densities", type=float, nargs="*", default=None)
    ap.add_argument("--eval-tokens", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--methods", nargs="*",
                    default=["oracle", "int8_values", "int8", "int4", "int4_lookahead", "learned_lookahead", "learned",
                             "cats", "teal"],
                    help="int8_values: the default plan's method (kept neurons' values from the int8 predictor); "
                         "int8: the same selection with exact values; int4(_lookahead): the learned 4-bit predictor; "
                         "learned(_lookahead): the learned low-rank predictor")
    ap.add_argument("--head-densities", type=float, nargs="*", default=[],
                    help="also sweep attention head density (MLP dense): oracle heads vs learned head predictors")
    ap.add_argument("--allocation", choices=("auto", "uniform", "greedy"), default="auto",
                    help="how calibrate() spreads each plan's MLP density over layers (auto: uniform for int8/int4)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="quality", help="file stem of the JSON and PNG written under --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    densities = args.densities or ([0.5] if args.quick else [0.3, 0.4, 0.5, 0.6, 0.75])
    eval_tokens = args.eval_tokens or (1024 if args.quick else 2048)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    # Collect once; every learned plan below is calibrated from the same samples.
    harness = smollm2_harness(args.calib_tokens, eval_tokens, args.seq_len)
    model, tok, samples, sets, dense = harness.model, harness.tokenizer, harness.samples, harness.sets, harness.dense
    collect_s = harness.collect_s

    rows = []
    plans = {}

    def record(method, density, selector, extra=None, plan=None):
        """selector: masks by forward hooks; plan with predictor values: the backend's simulation."""
        row = {"method": method, "mlp_density": density, **(extra or {})}
        # int4 scores are dequantized in the graph: simulated through the backend like predictor values
        through_backend = plan is not None and (method.startswith("int4")
                                                or any(e.values == "predictor" for e in plan.entries.values()))
        for name, chunks in sets.items():
            ppl = backend_perplexity(model, chunks, plan) if through_backend else perplexity(model, chunks, selector)
            row[f"{name}_ppl"] = ppl
            row[f"{name}_increase"] = ppl / dense[name] - 1.0
        rows.append(row)
        print(f"{method:24s} density {row.get('attn_density', density):.2f}  wiki {row['wiki_increase']:+7.2%}"
              f"  news {row['news_increase']:+7.2%}", flush=True)

    builders = {}
    for method in args.methods:
        if method in ("learned", "learned_lookahead", "int8", "int8_values", "int4", "int4_lookahead"):
            tt = time.time()
            predictor = method.split("_")[0] if method.startswith("int") else "lowrank"
            builders[method] = calibrate(model, tok, lookahead=method.endswith("_lookahead"), samples=samples,
                                         predictor=predictor, allocation=args.allocation,
                                         values="predictor" if method == "int8_values" else "exact",
                                         progress=True, return_builder=True)
            print(f"{method}: predictors fitted in {time.time() - tt:.0f} s", flush=True)

    for density in densities:
        for method in args.methods:
            if method == "oracle":
                record(method, density, oracle_selector(density))
            elif method == "cats":
                record(method, density, cats_selector(model, density))
            elif method == "teal":  # density = share of MLP *input channels* kept
                record(method, density, TealSelector(density))
            elif method in builders:
                plan = builders[method](density)
                plans[(method, density)] = plan
                mlp = [plan.entry(l, "mlp") for l in range(plan.num_layers)]
                sparse = [e for e in mlp if not e.dense]
                extra = {
                    "plan_density": plan.mlp_density,
                    "mean_recall": sum(e.stats["recall"] for e in mlp) / len(mlp),
                    "mean_mass": sum(e.stats["mass"] for e in mlp) / len(mlp),
                    "mean_oracle_mass": sum(e.stats["oracle_mass"] for e in mlp) / len(mlp),
                    "dense_layers": len(mlp) - len(sparse),
                    "predictor_flops_vs_block": (
                        sparse[0].predictor_flops() / (6 * sparse[0].total * model.config.hidden_size)
                        if sparse else 0.0),
                    "predictor_bytes_vs_fp32_block": (
                        sparse[0].read_bytes(4) / (12 * sparse[0].total * model.config.hidden_size) if sparse else 0.0),
                }
                record(method, density, plan_selector(plan), extra, plan)

    # Attention heads (MLP dense): the true top heads per token vs the learned head predictors.
    head_rows = []
    for density in args.head_densities:
        record("oracle_heads", 1.0, oracle_selector(1.0, density), {"attn_density": density})
        for lookahead in (False, True):
            plan = calibrate(model, tok, attn_density=density, lookahead=lookahead, samples=samples, progress=False,
                             return_builder=True)(1.0)
            heads = [plan.entry(l, "attention") for l in range(plan.num_layers)]
            record("learned_heads" + ("_lookahead" if lookahead else ""), 1.0, plan_selector(plan),
                   {"attn_density": density, "plan_attn_density": plan.attn_density,
                    "mean_recall": sum(e.stats.get("recall", 1.0) for e in heads) / len(heads)})
    head_rows = [r for r in rows if "attn_density" in r]
    rows = [r for r in rows if "attn_density" not in r]

    # Default operating point: what `calibrate()` returns with its defaults (on CPU: the int8 predictor).
    default_plan = calibrate(model, tok, samples=samples, progress=False)
    record("default_plan", default_plan.mlp_density, plan_selector(default_plan), {"collect_s": collect_s},
           default_plan)

    # Per-layer recall/mass, with and without lookahead, at 0.5 (or the first density) if calibrated.
    per_layer = []
    ref = 0.5 if 0.5 in densities else densities[0]
    for own, ahead in (("learned", "learned_lookahead"), ("int4", "int4_lookahead")):
        if (own, ref) not in plans or (ahead, ref) not in plans:
            continue
        a, b = plans[(own, ref)], plans[(ahead, ref)]
        print(f"\nper-layer MLP predictor quality, {own}, at target density {ref} (validation tokens)")
        print(" layer   k(own)  recall  mass | k(look) recall  mass | oracle mass")
        for l in range(a.num_layers):
            ea, eb = a.entry(l, "mlp"), b.entry(l, "mlp")
            per_layer.append({"method": own, "layer": l, "own": {"k": ea.k, **ea.stats},
                              "lookahead": {"k": eb.k, **eb.stats}})
            print(f" {l:5d} {ea.k:7d} {ea.stats['recall']:7.3f} {ea.stats['mass']:5.3f} | {eb.k:7d} "
                  f"{eb.stats['recall']:6.3f} {eb.stats['mass']:5.3f} | {ea.stats['oracle_mass']:.3f}")

    # Table
    print(f"\nHeld-out perplexity increase vs dense ({SIM_LABEL}); "
          f"dense wiki {dense['wiki']:.3f}, news {dense['news']:.3f}")
    print(f"{'method':18s} {'density':>7s} {'wiki':>8s} {'news':>8s}")
    for r in rows:
        print(f"{r['method']:18s} {r['mlp_density']:7.3f} {r['wiki_increase']:+8.2%} {r['news_increase']:+8.2%}")
    if head_rows:
        print(f"\n{'heads (MLP dense)':24s} {'density':>7s} {'recall':>7s} {'wiki':>8s} {'news':>8s}")
        for r in head_rows:
            print(f"{r['method']:24s} {r.get('plan_attn_density', r['attn_density']):7.3f}"
                  f" {r.get('mean_recall', 1.0):7.3f} {r['wiki_increase']:+8.2%} {r['news_increase']:+8.2%}")
    cfg = model.config
    d, F = cfg.hidden_size, cfg.intermediate_size
    cost = {"block_params": 3 * d * F, "block_flops_per_token": 6 * d * F,
            "predictor_params": default_plan.entry(cfg.num_hidden_layers - 1, "mlp").predictor_params()}
    result = {
        "label": SIM_LABEL, "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized fp32)",
        "eval_tokens": {k: sum(c.numel() for c in v) for k, v in sets.items()}, "dense": dense,
        "rows": rows, "head_rows": head_rows, "per_layer": per_layer, "default_plan": default_plan.settings,
        "cost": cost,
        "collect_s": collect_s, "total_s": time.time() - t0,
        "notes": {
            "teal": "density = share of the MLP input channels kept (largest |x|), gate/up/down run on "
                    "the masked input; not a neuron selector",
            "cats": "top-k by |act(gate(x))|, needs the full gate GEMV",
            "learned": "glu low-rank predictor (rank d/4 per projection), k per layer by greedy budget",
            "int8": "the block's own gate/up weights in int8 (per-row scales) as predictor, block's own input, "
                    "k per layer by greedy budget; predictor reads 1/6 of the fp32 block's bytes",
            "int4": "learned: the block's gate/up in 4 bits (fp16 scale per 32 columns) fitted to the calibration "
                    "activations with error feedback (fit_int4_glu_predictor), exact values, through the backend's "
                    "simulation; _lookahead reads the attention input through a fitted linear map",
            "int8_values": "int8's selection, the kept neurons' act(g~)*u~ taken from the int8 predictor "
                           "(the sparse block reads only their down rows); through the backend's simulation",
        },
    }
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    if rows:
        _plot(rows, out / f"{args.name}.png")
    print(f"\nwrote {out / args.name}.json in {time.time()-t0:.0f} s")
    return 0


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, name in zip(axes, ("wiki", "news")):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["mlp_density"], 100 * r[f"{name}_increase"]) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_title(f"held-out {name} ({SIM_LABEL})")
        ax.set_xlabel("MLP density (teal: input-channel density)")
        ax.set_yscale("symlog", linthresh=5)
        ax.axhline(3, color="grey", ls=":")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity increase vs dense (%)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
