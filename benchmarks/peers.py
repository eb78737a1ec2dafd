"""SmolLM2-135M decode on the CPU beside its peers, in one process: speed and quality side by side.

    python benchmarks/peers.py                       # writes benchmarks/results/peers.json
    python benchmarks/peers.py --new-tokens 48 --repeats 5 --threads 2 --eval-tokens 2048

Variants (fp32, batch 1, greedy, static cache, the same prompt):
- HF eager; Inductor dense (default settings); Inductor with its CPU settings for inference
  (freezing + cpp_wrapper);
- dejavu exact: the backend with no plan, every layer dense (projections through its GEMV kernel);
- dejavu default plan: the plan ``dejavu-compile demo`` uses (calibrated on first use, then cached);
- both dejavu variants again through ``dejavu_compile.greedy_decode`` (the same compiled forward, a
  greedy loop without ``generate()``'s per-token Python), and through it with ``skip_guards=True``
  (Dynamo's guards skipped after the second decode step);
- llama.cpp through llama-cpp-python, when it is installed (``pip install -e .[peers]``; it builds
  llama.cpp from source), on the same weights: the bundled Q4_1 GGUF requantized to F32 (the values
  the torch variants run) and to Q8_0.

Speed: decode tokens/s, ``(n - 1) / (t(n tokens) - t(1 token))``, every variant once per round,
rounds interleaved, medians. Every compiled variant is checked to have compiled its graphs in the
warm-up, and the timed rounds run with Dynamo's ``error_on_recompile`` (a variant that fell back to
eager, or recompiles, fails the run). Quality: held-out perplexity on the bundled Wikipedia
evaluation split and news texts, dense and under the default plan (the backend's masked
simulation); dejavu exact computes the dense model. The greedy tokens of each variant are compared
with HF eager's.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class CountingBackend:
    """A backend that counts the graphs it compiles (a variant past Dynamo's recompile limit would
    silently run eager: zero graphs)."""

    def __init__(self, name, compile_graph):
        self.name, self.compile_graph, self.graphs = name, compile_graph, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.compile_graph(gm, example_inputs)


def torch_variants(plan):
    from torch._inductor.compile_fx import compile_fx

    from dejavu_compile.compiler.backend import dejavu_backend

    def inductor(patches=None):
        return lambda gm, ex: compile_fx(gm, ex, config_patches=patches)

    def dejavu(options):
        return lambda gm, ex: dejavu_backend(gm, ex, options=options)

    return {
        "HF eager": None,
        "Inductor dense": CountingBackend("Inductor dense", inductor()),
        "Inductor freezing+cpp_wrapper": CountingBackend("Inductor freezing+cpp_wrapper",
                                                         inductor({"freezing": True, "cpp_wrapper": True})),
        "dejavu exact": CountingBackend("dejavu exact", dejavu({})),
        "dejavu default plan": CountingBackend("dejavu default plan", dejavu({"plan": plan})),
    }


def llama_cpp_models(threads: int) -> dict:
    """llama.cpp on the bundled weights at F32 and Q8_0 (converted once into the cache), or {}."""
    try:
        import ctypes

        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e .[peers]): llama.cpp rows left out")
        return {}
    from dejavu_compile.assets.models import smollm2_gguf_path
    from dejavu_compile.cache import cache_dir

    folder = cache_dir() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    models = {}
    for name, ftype in (("F32", llama_cpp.LLAMA_FTYPE_ALL_F32), ("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)):
        path = folder / f"smollm2-135m-instruct-{name}.gguf"
        if not path.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
            tmp = path.with_suffix(".tmp")
            if llama_cpp.llama_model_quantize(str(smollm2_gguf_path()).encode(), str(tmp).encode(),
                                              ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama_model_quantize to {name} failed")
            os.replace(tmp, path)
        models[f"llama.cpp {name}"] = llama_cpp.Llama(model_path=str(path), n_threads=threads,
                                                      n_threads_batch=threads, n_ctx=512, verbose=False)
    return models


def llama_cpp_run(llm, prompt: str, n: int):
    tokens = llm.tokenize(prompt.encode(), add_bos=False)
    out = []
    start = time.perf_counter()
    for token in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return time.perf_counter() - start, llm.detokenize(out).decode(errors="replace")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per text set (0: no quality)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "peers.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    from dejavu_compile.cli import BUNDLED, DEMO_PROMPT, _default_plan_dir, load_or_calibrate, machine
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bench import cpu_info
    from dejavu_compile.kernels.cpu import native

    cpu = cpu_info()
    info = {**machine(), "cpu": cpu["cpu"], "isa": cpu["isa"], "avx512_vnni": cpu["avx512_vnni"],
            "kernel_tuning": native.tuning(),
            "new_tokens": args.new_tokens, "repeats": args.repeats}
    print(f"machine: {info}")
    model, tok = load_smollm2()
    model.eval()
    plan_dir = _default_plan_dir(model, BUNDLED)
    plan = load_or_calibrate(model, tok, plan_dir)
    prepare_model(model)
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    backends = torch_variants(plan)
    original = model.forward
    forwards = {name: original if b is None else torch.compile(original, backend=b) for name, b in backends.items()}
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 * len(forwards))
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * len(forwards))
    llamas = {} if args.no_llama_cpp else llama_cpp_models(args.threads)

    from dejavu_compile.evaluation.decode import greedy_decode

    lean = {f"{name}, greedy_decode": name for name in forwards if name.startswith("dejavu")}
    unguarded = {f"{name}, greedy_decode, guards skipped": name for name in forwards if name.startswith("dejavu")}
    lean.update(unguarded)

    def run_torch(name, n):
        model.forward = forwards[lean.get(name, name)]
        try:
            start = time.perf_counter()
            if name in lean:
                out = greedy_decode(model, ids, n, skip_guards=name in unguarded)
            else:
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                         cache_implementation="static", pad_token_id=model.config.eos_token_id)
            return time.perf_counter() - start, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        finally:
            model.forward = original

    names = [*forwards, *lean, *llamas]
    times = {name: {1: [], args.new_tokens: []} for name in names}
    texts = {}
    rounds = [(r, name, n) for r in range(args.repeats + 1) for name in names for n in (1, args.new_tokens)]
    for rep, name, n in tqdm(rounds, desc="decode rounds", unit="run"):
        if rep == 1 and name == names[0] and n == 1:  # warm-up over: every compiled variant compiled
            for b in backends.values():
                if b is not None and b.graphs < 2:
                    raise RuntimeError(f"{b.name} compiled {b.graphs} graph(s) in the warm-up (prefill and decode "
                                       "expected): it would run eager")
            config.error_on_recompile = True
        time.sleep(0.05)  # let the other runtime's spinning threads park
        elapsed, text = llama_cpp_run(llamas[name], DEMO_PROMPT, n) if name in llamas else run_torch(name, n)
        if rep == 0:
            if n == args.new_tokens:
                texts[name] = text
            continue
        times[name][n].append(elapsed)
    config.error_on_recompile = False

    speed = {}
    for name in names:
        rates = [(args.new_tokens - 1) / (tn - t1) for t1, tn in zip(times[name][1], times[name][args.new_tokens])]
        speed[name] = {"tokens_per_s": statistics.median(rates), "runs": rates,
                       "same_tokens_as_hf_eager": texts[name] == texts["HF eager"]}
    base = speed.get("llama.cpp F32", speed["Inductor dense"])["tokens_per_s"]
    for row in speed.values():
        row["vs_llama_cpp_f32" if "llama.cpp F32" in speed else "vs_inductor"] = row["tokens_per_s"] / base

    quality = {}
    if args.eval_tokens:
        from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
        from dejavu_compile.evaluation.perplexity import perplexity

        for set_name, texts_ in (("wiki", wiki_articles("eval")), ("news", news_texts())):
            chunks = tokenize_chunks(tok, texts_, seq_len=256, max_tokens=args.eval_tokens)
            dense, sparse = perplexity(model, chunks, progress=True), perplexity(model, chunks, plan, progress=True)
            quality[set_name] = {"dense": dense, "default_plan": sparse, "increase": sparse / dense - 1,
                                 "tokens": sum(c.numel() for c in chunks)}
    result = {"machine": info, "plan": str(plan_dir), "mlp_density": plan.mlp_density,
              "compiled_graphs": {b.name: b.graphs for b in backends.values() if b is not None},
              "speed": speed, "perplexity": quality, "outputs": texts}
    print(f"\n{'variant':<44}{'tokens/s':>10}{'ratio':>8}  same tokens as HF eager")
    for name, row in speed.items():
        ratio = row.get("vs_llama_cpp_f32", row.get("vs_inductor"))
        print(f"{name:<44}{row['tokens_per_s']:>10.1f}{ratio:>7.2f}x  {row['same_tokens_as_hf_eager']}")
    for set_name, q in quality.items():
        print(f"perplexity {set_name}: dense {q['dense']:.3f}, default plan {q['default_plan']:.3f} "
              f"({q['increase']:+.2%}, {q['tokens']} tokens)")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
