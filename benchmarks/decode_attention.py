"""Decode attention: SmolLM2 decode with SDPA left to Inductor against the backend's decode attention
op (option ``attention_lowering``), over a static cache sized to the sequence and over one
allocated once for longer sequences (what a server that compiles once keeps).

    python benchmarks/decode_attention.py [--dtypes float32 bfloat16] [--cache-lens 0 2048] [--repeats 5]
    python benchmarks/decode_attention.py --dtypes float32 --weights int8   # quantize_weights(model, "int8")

For each dtype and cache length (0: prompt + new tokens), dejavu exact with ``attention_lowering``
"aten" and "auto" (each cache length compiled with a static slot count), timed through
``evaluation.bench.measure_decode`` with ``greedy_decode`` (batch 1, 48 new tokens, interleaved
rounds, medians), and whether the greedy tokens are equal. Writes
benchmarks/results/decode-attention.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--cache-lens", nargs="+", type=int, default=[0, 2048])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="int8: dejavu_compile.quantize_weights(model, 'int8') after the cast")
    ap.add_argument("--out", default=str(RESULTS / "decode-attention.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.cli import DEMO_PROMPT
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, cpu_info, machine_description, measure_decode

    cpu = cpu_info()
    print(f"machine: {machine_description()}; {cpu['cpu']}, {cpu['isa']}")
    rows = []
    for dtype_name in args.dtypes:
        model, tok = load_smollm2(getattr(torch, dtype_name))
        if args.weights == "int8":
            from dejavu_compile.compiler.quantize import quantize_weights

            quantize_weights(model, "int8")
        ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
        # dynamic=False: each cache length compiles its own graph with a static slot count, as a server
        # compiled for one cache size runs (without it the second length would be compiled with a
        # symbolic slot count, shared by every variant of this process)
        wraps = {lowering: compiled_forward("dejavu", options={"attention_lowering": lowering}, dynamic=False)
                 for lowering in ("aten", "auto")}
        variants = [Variant(f"{lowering} {length}", wrap, loop="greedy_decode", max_cache_len=length or None)
                    for length in args.cache_lens for lowering, wrap in wraps.items()]
        results = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats)
        for length in args.cache_lens:
            aten, auto = (next(v for v in variants if v.name == f"{lowering} {length}")
                          for lowering in ("aten", "auto"))
            row = {"dtype": dtype_name, "weights": args.weights, "cache_len": length or ids.shape[1] + args.new_tokens,
                   "aten_tokens_per_s": results[aten.name]["tokens_per_s"],
                   "kernel_tokens_per_s": results[auto.name]["tokens_per_s"],
                   "aten_runs": results[aten.name]["runs"], "kernel_runs": results[auto.name]["runs"],
                   "tokens_equal": bool(torch.equal(aten.outputs, auto.outputs))}
            row["speedup"] = row["kernel_tokens_per_s"] / row["aten_tokens_per_s"]
            rows.append(row)
            print(f"{dtype_name:9s} {args.weights:5s} weights, cache {row['cache_len']:5d} slots: "
                  f"SDPA via Inductor {row['aten_tokens_per_s']:6.1f}"
                  f"  decode attention op {row['kernel_tokens_per_s']:6.1f} tokens/s  ({row['speedup']:.2f}x)"
                  f"  greedy tokens equal: {row['tokens_equal']}", flush=True)
        torch._dynamo.reset()
    pathlib.Path(args.out).write_text(json.dumps(
        {"machine": machine_description(), "cpu": cpu, "prompt_tokens": int(ids.shape[1]),
         "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
