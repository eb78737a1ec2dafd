"""Prefill speed of SmolLM2 in each weight format: a prompt's forward pass (one call over all its
tokens, filling the KV cache), fp32, bf16 and int8 (``quantize_weights(model, "int8")`` on the fp32
model), with the model's logits on the prompt checked against the fp32 model's.

    python benchmarks/prefill.py [--lengths 32 128 512] [--rounds 7] [--threads 2]

The prompts are bundled held-out Wikipedia text. Each round times every (format, length) once,
formats interleaved; the figures are medians over rounds, in prompt tokens per second. The forward
runs eagerly: a prompt is dense in the compiled model too (the backend lowers decode-shaped graphs
only), and its projections are the same ops either way (aten's GEMM for fp32 and bf16,
``dejavu::cpu_q8_linear`` for int8). Also reported: each format's parameter and buffer bytes and
its logits' largest deviation from fp32's on the longest prompt, relative to fp32's largest logit.
Writes ``benchmarks/results/prefill.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prefill.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from tqdm import tqdm

    from dejavu_compile import quantize_weights
    from dejavu_compile.assets.data import tokenize_chunks, wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.evaluation.bench import cpu_info, machine_description

    fp32, tokenizer = load_smollm2(torch.float32)
    bf16, _ = load_smollm2(torch.bfloat16)
    int8, _ = load_smollm2(torch.float32)
    quantize_weights(int8, "int8")
    models = {"fp32": fp32, "bf16": bf16, "int8": int8}
    text = tokenize_chunks(tokenizer, wiki_articles("eval"), seq_len=max(args.lengths))[0]
    prompts = {n: text[:, :n] for n in args.lengths}
    cpu = cpu_info()
    print(f"machine: {machine_description()}; CPU: {cpu['cpu']}, {cpu['isa']}")

    def prefill(model, ids):
        start = time.perf_counter()
        model(ids, use_cache=True)
        return time.perf_counter() - start

    for model in models.values():  # warm-up: first calls allocate and build the C++ ops
        prefill(model, prompts[min(args.lengths)])
    times = {(f, n): [] for f in models for n in args.lengths}
    for _ in tqdm(range(args.rounds), desc="prefill rounds", unit="round"):
        for n, ids in prompts.items():
            for f, model in models.items():
                times[(f, n)].append(prefill(model, ids))

    longest = prompts[max(args.lengths)]
    logits = {f: model(longest, use_cache=False).logits.double() for f, model in models.items()}
    reference = logits["fp32"]
    rows = []
    for f, model in models.items():
        deviation = float((logits[f] - reference).abs().max() / reference.abs().max())
        nbytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        for n in args.lengths:
            median = statistics.median(times[(f, n)])
            rows.append(dict(format=f, tokens=n, median_s=median, tokens_per_s=n / median,
                             rounds_s=times[(f, n)], model_bytes=nbytes, logits_deviation_vs_fp32=deviation))

    print(f"\n{'format':<8}{'MB':>7}{'|dlogit|/max':>14}" + "".join(f"{f'{n} tok/s':>13}" for n in args.lengths))
    for f in models:
        mine = [r for r in rows if r["format"] == f]
        print(f"{f:<8}{mine[0]['model_bytes'] / 1e6:>7.0f}{mine[0]['logits_deviation_vs_fp32']:>14.2e}"
              + "".join(f"{r['tokens_per_s']:>13.0f}" for r in mine))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(machine=dict(description=machine_description(), cpu=cpu["cpu"], isa=cpu["isa"],
                                    threads=args.threads, torch=torch.__version__),
                       command="python benchmarks/prefill.py " + " ".join(argv or []), rows=rows), fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
