"""The speed-quality frontier of CPU decode: SmolLM2-135M tokens/s against held-out perplexity, dejavu
at each of its weight formats beside llama.cpp at its formats of the same weights, in one process.

    python benchmarks/frontier.py     # benchmarks/results/frontier.json and frontier.png
    python benchmarks/frontier.py --new-tokens 48 --repeats 5 --threads 2 --eval-tokens 2048
    python benchmarks/frontier.py --llama1b   # results/frontier-llama1b.json: the byte bounds (below)
    python benchmarks/frontier.py --skip-module-guards --out benchmarks/results/frontier-avx2-module-guards.json

dejavu: the model in fp32, in bf16 (``model.to(torch.bfloat16)``) and in int8
(``quantize_weights(model, "int8")`` over fp32), each exact (the backend with no plan) and under the
default plan (the plan ``dejavu-compile demo`` uses; in the int8 model its k per layer, each MLP's
own int8 gate/up choosing the kept neurons, attention and the output head dense). llama.cpp
(``pip install -e .[peers]``, which builds it from source): the bundled GGUF, whose values the torch
model loads, requantized to F32, BF16, Q8_0, Q6_K, Q4_K_M and Q4_0.

Speed: every variant through ``generate()`` (a static cache for the torch models, llama-cpp-python's
own loop for llama.cpp), batch 1, greedy, the same prompt, rounds interleaved, medians
(``evaluation.bench.measure_decode``); with ``--skip-module-guards`` the dejavu variants compile
without Dynamo's guards on the model's modules (``benchmarks/module_guards.py`` measures what they
cost). Quality: perplexity on the same held-out token ids (the
bundled Wikipedia evaluation split and news texts, pooled), dejavu's computed by
``evaluation.perplexity`` (the default plan's by the backend's masked simulation), llama.cpp's by
llama.cpp itself with every position's logits; each also as its increase over the fp32 dense
model's. For each llama.cpp point the table names dejavu's fastest point at no worse perplexity
(within 0.002%: the same fp32 weights summed in another order differ by about 0.001%).
The plot draws tokens/s against the perplexity increase with each runtime's frontier (the points
that no faster point of the same runtime beats on perplexity).

``--llama1b``: a Llama-3.2-1B-shaped model (random weights, 16 layers, hidden 2048, 8192 MLP neurons,
32 heads over 8 KV heads, a tied 128,256-row head), where the weights, not the per-step overhead,
set the pace: bf16 and int8, exact and sparse at ``--llama1b-densities`` (bf16: the default plan's
method on these weights, each MLP's training-free int8 predictor built from its own gate/up rows,
values from it, the output head screened; int8: the same k, each MLP's own int8 gate/up choosing and
valuing its kept neurons, the head dense), each against its byte bound: the bytes
its step reads (``bandwidth.bandwidth_bound`` of the plan) over the rate the backend's dense GEMV
reads this model's weights at, measured once before the decode rounds. Speed only: random weights
have no perplexity to speak of.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import torch
from peers import llama_cpp_models, llama_cpp_perplexity, llama_cpp_run  # beside this script

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
LLAMA_CPP_FORMATS = ("F32", "BF16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_0")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)


def dejavu_models(model) -> dict:
    """{format: model}: the fp32 model itself, a bf16 copy and an int8 copy (weights stored as int8)."""
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.compiler.quantize import quantize_weights

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    int8 = copy.deepcopy(model)
    print(quantize_weights(int8, "int8"))
    models = {"fp32": model, "bf16": bf16, "int8": int8}
    for m in models.values():
        prepare_model(m)
    return models


def frontier(points: list[dict]) -> list[dict]:
    """The points that no faster point beats on perplexity, fastest first."""
    best, front = float("inf"), []
    for p in sorted(points, key=lambda p: -p["tokens_per_s"]):
        if p["perplexity"] < best:
            best = p["perplexity"]
            front.append(p)
    return front


# Perplexities this close are the same: the same fp32 weights summed in another order (llama.cpp F32
# against dejavu fp32 exact) differ by about 1e-5 of the perplexity.
SAME_PERPLEXITY = 2e-5


def against_llama_cpp(points: list[dict]) -> list[dict]:
    """For each llama.cpp point, dejavu's fastest point whose perplexity is no worse (within
    ``SAME_PERPLEXITY``, relative)."""
    rows = []
    for peer in (p for p in points if p["runtime"] == "llama.cpp"):
        worst = peer["perplexity"] * (1 + SAME_PERPLEXITY)
        ours = [p for p in points if p["runtime"] == "dejavu" and p["perplexity"] <= worst]
        best = max(ours, key=lambda p: p["tokens_per_s"], default=None)
        rows.append({"llama.cpp": peer["name"], "dejavu": best and best["name"],
                     "speed_ratio": best and best["tokens_per_s"] / peer["tokens_per_s"]})
    return rows


def plot(points: list[dict], info: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for runtime, color in (("dejavu", "tab:blue"), ("llama.cpp", "tab:orange")):
        mine = [p for p in points if p["runtime"] == runtime]
        ax.scatter([100 * p["increase"] for p in mine], [p["tokens_per_s"] for p in mine], color=color, label=runtime)
        front = sorted(frontier(mine), key=lambda p: p["increase"])
        ax.plot([100 * p["increase"] for p in front], [p["tokens_per_s"] for p in front], color=color, alpha=0.6)
        for p in mine:
            ax.annotate(p["config"], (100 * p["increase"], p["tokens_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("held-out perplexity increase over the fp32 dense model (%)")
    ax.set_ylabel("decode tokens/s (generate(), batch 1)")
    ax.set_title(f"SmolLM2-135M, {info['cpu']}, {info['threads']} threads", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def llama1b(args, info: dict) -> dict:
    """The --llama1b run: tokens/s of each variant and its share of its byte bound."""
    from decode import synthetic_int8_plan  # beside this script
    from profile_decode import step_weight_bytes, streaming_rate
    from transformers import AutoConfig, AutoModelForCausalLM

    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.compiler.quantize import quantize_weights, resident_bytes
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, measure_decode
    from dejavu_compile.plan.sparsity_plan import HEAD_CANDIDATES

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_1B)).eval()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    print(quantize_weights(model, "int8"))  # in place: the fp32 projections are dropped
    models = {"bf16": bf16, "int8": model}
    for m in models.values():
        prepare_model(m)
    plans = {}
    for density in args.llama1b_densities:
        plans[density] = synthetic_int8_plan(bf16, density)
        plans[density].head_candidates = HEAD_CANDIDATES
    variants, reads = [], {}  # name -> (format, the bytes a step reads, MLP density or None)
    for fmt, m in models.items():
        dense_bytes = step_weight_bytes(m)
        variants.append(Variant(f"dejavu {fmt} exact", compiled_forward("dejavu"), model=m))
        reads[variants[-1].name] = (fmt, dense_bytes, None)
        for density, plan in plans.items():
            variants.append(Variant(f"dejavu {fmt} MLP density {density:.2f}",
                                    compiled_forward("dejavu", options={"plan": plan}), model=m))
            reads[variants[-1].name] = (fmt, dense_bytes / bandwidth_bound(m, plan), density)
    rates = {fmt: streaming_rate(m) for fmt, m in models.items()}
    ids = torch.randint(3, LLAMA_1B["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    speed = measure_decode(model, ids, variants, new_tokens=args.llama1b_new_tokens, repeats=args.repeats)
    rows = []
    for v in variants:
        fmt, step_bytes, density = reads[v.name]
        tokens_per_s = speed[v.name]["tokens_per_s"]
        bound = rates[fmt] / step_bytes
        rows.append({"name": v.name, "format": fmt, "mlp_density": density, "tokens_per_s": tokens_per_s,
                     "runs": speed[v.name]["runs"], "step_weight_bytes": step_bytes,
                     "gemv_bytes_per_s": rates[fmt], "byte_bound_tokens_per_s": bound,
                     "share_of_byte_bound": tokens_per_s / bound, "resident_weight_bytes": resident_bytes(v.model)})
    print(f"\n{'variant (Llama-3.2-1B-shaped)':<34}{'tokens/s':>10}{'MB/step':>9}{'GEMV GB/s':>11}"
          f"{'bound':>8}{'share':>7}")
    for r in rows:
        print(f"{r['name']:<34}{r['tokens_per_s']:>10.2f}{r['step_weight_bytes'] / 1e6:>9.0f}"
              f"{r['gemv_bytes_per_s'] / 1e9:>11.1f}{r['byte_bound_tokens_per_s']:>8.2f}"
              f"{r['share_of_byte_bound']:>7.2f}")
    return {"machine": {**info, "new_tokens": args.llama1b_new_tokens}, "config": LLAMA_1B,
            "head_candidates": HEAD_CANDIDATES, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per text set")
    ap.add_argument("--out", default=None, help="default results/frontier.json (the plot goes beside it, .png), "
                    "with --llama1b results/frontier-llama1b.json")
    ap.add_argument("--llama1b", action="store_true", help="the Llama-3.2-1B-shaped byte-bound run instead")
    ap.add_argument("--llama1b-densities", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--llama1b-new-tokens", type=int, default=16)
    ap.add_argument("--skip-module-guards", action="store_true",
                    help="compile the dejavu variants with torch.compile's guard_filter_fn="
                         "torch.compiler.skip_guard_on_all_nn_modules_unsafe (docs/usage.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.cli import BUNDLED, DEMO_PROMPT, _default_plan_dir, load_or_calibrate, machine
    from dejavu_compile.compiler.quantize import resident_bytes
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, cpu_info, measure_decode, write_result
    from dejavu_compile.evaluation.perplexity import perplexity
    from dejavu_compile.kernels.cpu import native

    cpu = cpu_info()
    info = {**machine(), "cpu": cpu["cpu"], "isa": cpu["isa"], "avx512_vnni": cpu["avx512_vnni"],
            "kernel_tuning": native.tuning(), "new_tokens": args.new_tokens, "repeats": args.repeats,
            "eval_tokens_per_set": args.eval_tokens}
    print(f"machine: {info}")
    if args.llama1b:
        write_result(args.out or RESULTS / "frontier-llama1b.json",
                     llama1b(args, {k: v for k, v in info.items() if k != "eval_tokens_per_set"}))
        return 0
    model, tok = load_smollm2()
    model.eval()
    plan_dir = _default_plan_dir(model, BUNDLED)
    plan = load_or_calibrate(model, tok, plan_dir)
    models = dejavu_models(model)
    llamas = llama_cpp_models(args.threads, LLAMA_CPP_FORMATS)

    guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if args.skip_module_guards else {}
    info["module_guards"] = "skipped" if args.skip_module_guards else "kept"
    configs = {}  # variant name -> (format, config, plan or None)
    variants = []
    for fmt, m in models.items():
        for config, p in (("exact", None), ("default plan", plan)):
            name = f"dejavu {fmt} {config}"
            configs[name] = ("dejavu", fmt, config, p)
            options = {**({"plan": p} if p is not None else {}), **guards}
            # without the module guards the bf16 and int8 copies would run the fp32 model's graphs (nothing
            # checks their weights' dtype): each compiled forward keeps its graphs apart
            isolate = {"isolate_recompiles": True} if guards else {}
            variants.append(Variant(name, compiled_forward("dejavu", options=options, **isolate), model=m))
    for name, llm in llamas.items():
        configs[name] = ("llama.cpp", name.removeprefix("llama.cpp "), "", None)
        variants.append(Variant(name, run=lambda n, llm=llm: llama_cpp_run(llm, DEMO_PROMPT, n)))
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats, pause_s=0.05)

    chunks = [*tokenize_chunks(tok, wiki_articles("eval"), seq_len=256, max_tokens=args.eval_tokens),
              *tokenize_chunks(tok, news_texts(), seq_len=256, max_tokens=args.eval_tokens)]
    reference = perplexity(model, chunks, progress=True)
    points = []
    for v in variants:
        runtime, fmt, config, p = configs[v.name]
        if runtime == "dejavu":
            ppl = reference if fmt == "fp32" and p is None else perplexity(v.model, chunks, p, progress=True)
        else:
            ppl = llama_cpp_perplexity(llamas[v.name], chunks, args.threads)
        points.append({"name": v.name, "runtime": runtime, "format": fmt,
                       "config": f"{fmt} {config}".strip(), "tokens_per_s": speed[v.name]["tokens_per_s"],
                       "runs": speed[v.name]["runs"], "perplexity": ppl, "increase": ppl / reference - 1,
                       **({"resident_weight_bytes": resident_bytes(v.model)} if runtime == "dejavu" else {})})
    versus = against_llama_cpp(points)
    out = pathlib.Path(args.out or RESULTS / "frontier.json")
    result = {"machine": info, "plan": str(plan_dir), "mlp_density": plan.mlp_density,
              "fp32_dense_perplexity": reference, "eval_tokens": sum(c.numel() for c in chunks),
              "points": points, "frontier": {r: [p["name"] for p in frontier([q for q in points if q["runtime"] == r])]
                                             for r in ("dejavu", "llama.cpp")},
              "against_llama_cpp": versus}
    print(f"\n{'variant':<30}{'tokens/s':>10}{'perplexity':>12}{'vs fp32':>9}")
    for p in points:
        print(f"{p['name']:<30}{p['tokens_per_s']:>10.1f}{p['perplexity']:>12.3f}{p['increase']:>+9.2%}")
    for row in versus:
        best = "none" if row["dejavu"] is None else f"{row['dejavu']} at {row['speed_ratio']:.2f}x its tokens/s"
        print(f"{row['llama.cpp']}: dejavu's fastest point at no worse perplexity: {best}")
    write_result(out, result)
    plot(points, info, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
