"""SmolLM2-135M decode on the CPU beside its peers, in one process: speed and quality side by side.

    python benchmarks/peers.py                       # writes benchmarks/results/peers.json
    python benchmarks/peers.py --new-tokens 48 --repeats 5 --threads 2 --eval-tokens 2048
    python benchmarks/peers.py --dtype bfloat16      # the model in bf16: benchmarks/results/peers-bf16.json
    python benchmarks/peers.py --weights int8        # quantize_weights(model, "int8"): peers-int8.json

Variants (the model in --dtype, fp32 by default; batch 1, greedy, static cache, the same prompt):
- HF eager; Inductor dense (default settings); Inductor with its CPU settings for inference
  (freezing + cpp_wrapper);
- dejavu exact: the backend with no plan, every layer dense (projections through its GEMV kernel);
- dejavu default plan: the plan ``dejavu-compile demo`` uses (calibrated on first use, then cached;
  left out with int8 weights: ``benchmarks/frontier.py`` measures the int8 model under it);
- both dejavu variants again through ``dejavu_compile.greedy_decode`` (the same compiled forward, a
  greedy loop without ``generate()``'s per-token Python), and through it with ``skip_guards=True``
  (Dynamo's guards skipped after the second decode step);
- llama.cpp through llama-cpp-python, when it is installed (``pip install -e .[peers]``; it builds
  llama.cpp from source for the CPU it builds on; where that build dies with an illegal instruction,
  as on an Intel Xeon with AMX in a virtual machine, build it with AMX off:
  ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"`` instead), on the same
  weights: the bundled Q4_1 GGUF requantized to the format of --dtype (F32, BF16 or F16: the values
  the torch variants run) and to Q8_0 (the reference of --weights int8).

Speed: decode tokens/s, ``(n - 1) / (t(n tokens) - t(1 token))``, every variant once per round,
rounds interleaved, medians, through ``evaluation.bench.measure_decode`` (a compiled variant that
compiled nothing in the warm-up, or recompiles in a timed round, fails the run). Quality: held-out
perplexity on the bundled Wikipedia evaluation split and news texts, dense and under the default
plan (the backend's masked simulation), against the fp32 dense model where the variants run
another format, and llama.cpp's own perplexity of each of its formats on the same token ids; dejavu
exact computes the dense model. The greedy tokens of each variant are compared with HF eager's.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def torch_variants(plan=None) -> list:
    """The torch variants, each a ``measure_decode`` Variant; the dejavu ones also through
    ``greedy_decode`` (the same compiled forward), with and without Dynamo's guards."""
    from dejavu_compile.evaluation.bench import Variant, compiled_forward

    dejavu = {"dejavu exact": compiled_forward("dejavu")}
    if plan is not None:
        dejavu["dejavu default plan"] = compiled_forward("dejavu", options={"plan": plan})
    variants = [Variant("HF eager"), Variant("Inductor dense", compiled_forward("inductor")),
                Variant("Inductor freezing+cpp_wrapper",
                        compiled_forward("inductor", options={"freezing": True, "cpp_wrapper": True})),
                *(Variant(name, wrap) for name, wrap in dejavu.items())]
    for loop, label in (("greedy_decode", "greedy_decode"),
                        ("greedy_decode_unguarded", "greedy_decode, guards skipped")):
        variants += [Variant(f"{name}, {label}", wrap, loop=loop) for name, wrap in dejavu.items()]
    return variants


LLAMA_CPP_FORMAT = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # llama.cpp's name of each dtype


def llama_cpp_models(threads: int, formats=("F32", "Q8_0")) -> dict:
    """llama.cpp on the bundled weights in each format (converted once into the cache), or {}."""
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
    ftypes = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
              "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
              "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
    for name in formats:
        ftype = ftypes[name]
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


def llama_cpp_run(llm, prompt: str, n: int) -> str:
    """n greedy tokens from llama.cpp after ``prompt``, as text."""
    tokens = llm.tokenize(prompt.encode(), add_bos=False)
    out = []
    for token in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return llm.detokenize(out).decode(errors="replace")


def llama_cpp_perplexity(llm, chunks, threads: int) -> float:
    """llama.cpp's own perplexity of the model behind ``llm`` on the same token ids as the torch
    variants (whole-chunk evaluation with every position's logits, as ``evaluation.perplexity``)."""
    import math

    import llama_cpp
    import numpy as np
    import torch.nn.functional as F

    length = max(c.shape[1] for c in chunks)
    scorer = llama_cpp.Llama(model_path=llm.model_path, n_threads=threads, n_threads_batch=threads, n_ctx=length,
                             n_batch=length, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for chunk in chunks:
        ids = chunk[0].tolist()
        scorer.reset()
        scorer.eval(ids)
        logits = torch.from_numpy(np.asarray(scorer.scores[: len(ids) - 1], dtype=np.float32))
        nll += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per text set (0: no quality)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=list(LLAMA_CPP_FORMAT),
                    help="the model's dtype (llama.cpp runs the same format beside Q8_0)")
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="int8: dejavu_compile.quantize_weights(model, 'int8') after the cast "
                         "(llama.cpp's Q8_0 beside it)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/peers.json (peers-bf16.json, ...)")
    args = ap.parse_args(argv)
    reference = "Q8_0" if args.weights == "int8" else LLAMA_CPP_FORMAT[args.dtype]
    if args.out is None:
        suffix = "-".join(p for p in (args.weights != "float" and args.weights,
                                      args.dtype != "float32" and LLAMA_CPP_FORMAT[args.dtype].lower()) if p)
        args.out = str(RESULTS / (f"peers-{suffix}.json" if suffix else "peers.json"))
    torch.set_num_threads(args.threads)

    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.cli import BUNDLED, DEMO_PROMPT, _default_plan_dir, load_or_calibrate, machine
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.compiler.quantize import resident_bytes
    from dejavu_compile.evaluation.bench import Variant, cpu_info, measure_decode, write_result
    from dejavu_compile.kernels.cpu import native

    cpu = cpu_info()
    info = {**machine(), "cpu": cpu["cpu"], "isa": cpu["isa"], "avx512_vnni": cpu["avx512_vnni"],
            "kernel_tuning": native.tuning(),
            "vector_width": native.vector_width(), "dtype": args.dtype, "weights": args.weights,
            "new_tokens": args.new_tokens, "repeats": args.repeats}
    print(f"machine: {info}")
    model, tok = load_smollm2()
    model.eval()
    plan_dir = _default_plan_dir(model, BUNDLED)
    plan = load_or_calibrate(model, tok, plan_dir)
    fp32 = copy.deepcopy(model) if args.dtype != "float32" or args.weights != "float" else None  # the quality reference
    model.to(getattr(torch, args.dtype))  # the plan was calibrated on the fp32 weights this rounds
    prepare_model(model)
    if args.weights == "int8":
        from dejavu_compile.compiler.quantize import quantize_weights

        print(quantize_weights(model, "int8"))
        plan = None
    info["resident_weight_bytes"] = resident_bytes(model)
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    llamas = {} if args.no_llama_cpp else llama_cpp_models(args.threads, tuple(dict.fromkeys((reference, "Q8_0"))))
    variants = torch_variants(plan) + [Variant(name, run=lambda n, llm=llm: llama_cpp_run(llm, DEMO_PROMPT, n))
                                       for name, llm in llamas.items()]
    # the pause lets the other runtime's spinning threads park
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats, pause_s=0.05)
    texts = {v.name: v.outputs if isinstance(v.outputs, str)
             else tok.decode(v.outputs[0, ids.shape[1]:], skip_special_tokens=True) for v in variants}
    for name, row in speed.items():
        row["same_tokens_as_hf_eager"] = texts[name] == texts["HF eager"]
    base_name = f"llama.cpp {reference}" if f"llama.cpp {reference}" in speed else "Inductor dense"
    ratio_key = "vs_" + base_name.replace("llama.cpp ", "llama_cpp_").replace(" ", "_").lower()
    base = speed[base_name]["tokens_per_s"]
    for row in speed.values():
        row[ratio_key] = row["tokens_per_s"] / base

    quality = {}
    if args.eval_tokens:
        from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
        from dejavu_compile.evaluation.perplexity import perplexity

        for set_name, texts_ in (("wiki", wiki_articles("eval")), ("news", news_texts())):
            chunks = tokenize_chunks(tok, texts_, seq_len=256, max_tokens=args.eval_tokens)
            dense = perplexity(model, chunks, progress=True)
            q = quality[set_name] = {"dense": dense, "tokens": sum(c.numel() for c in chunks)}
            if plan is not None:
                q["default_plan"] = perplexity(model, chunks, plan, progress=True)
                q["increase"] = q["default_plan"] / dense - 1
            if fp32 is not None:
                q["fp32_dense"] = perplexity(fp32, chunks, progress=True)
                q["dense_vs_fp32"] = dense / q["fp32_dense"] - 1
                if plan is not None:
                    q["default_plan_vs_fp32"] = q["default_plan"] / q["fp32_dense"] - 1
            for name, llm in llamas.items():  # llama.cpp's own figure, on the same ids
                q[name] = llama_cpp_perplexity(llm, chunks, args.threads)
                q[f"{name} vs fp32"] = q[name] / q.get("fp32_dense", dense) - 1
    result = {"machine": info, "plan": str(plan_dir) if plan is not None else None,
              "mlp_density": plan.mlp_density if plan is not None else None,
              "compiled_graphs": {v.name: speed[v.name]["graphs"] for v in variants if v.compiled},
              "speed": speed, "perplexity": quality, "outputs": texts}
    print(f"\n{'variant':<44}{'tokens/s':>10}{'ratio':>8}  same tokens as HF eager")
    for name, row in speed.items():
        ratio = row[ratio_key]
        print(f"{name:<44}{row['tokens_per_s']:>10.1f}{ratio:>7.2f}x  {row['same_tokens_as_hf_eager']}")
    for set_name, q in quality.items():
        line = f"perplexity {set_name} ({q['tokens']} tokens): dense {q['dense']:.3f}"
        if "default_plan" in q:
            line += f", default plan {q['default_plan']:.3f} ({q['increase']:+.2%})"
        if "fp32_dense" in q:
            line += f"; against the fp32 dense model ({q['fp32_dense']:.3f}): dense {q['dense_vs_fp32']:+.2%}"
            if "default_plan_vs_fp32" in q:
                line += f", default plan {q['default_plan_vs_fp32']:+.2%}"
        for name in llamas:
            line += f"; {name} {q[name]:.3f} ({q[f'{name} vs fp32']:+.2%} vs fp32)"
        print(line)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
