"""What one op call costs on CPU, kernel included, in the cache state of a decode step.

    python benchmarks/op_overhead.py              # 2 threads, L2 flushed before each call
    python benchmarks/op_overhead.py --flush-mb 0 # caches warm

Each call works on a tiny problem (8 of SmolLM2's 1536 neurons), so the time is almost all call
overhead: Python, the dispatcher, argument checks. Before each timed call the script streams
--flush-mb of memory, as a decode step streams a layer's weights (SmolLM2: ~14 MB a layer) between
two calls of the same op, which pushes the interpreter's and the dispatcher's working set out of L2.
Medians of --calls, variants interleaved.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flush-mb", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dejavu_compile.evaluation.bench import machine_description
    from dejavu_compile.kernels import prepare_gated_mlp_weights
    from dejavu_compile.kernels.cpu import native

    d, ff = 576, 1536
    gen = torch.Generator().manual_seed(0)
    w = prepare_gated_mlp_weights(torch.randn(ff, d, generator=gen), torch.randn(ff, d, generator=gen),
                                  torch.randn(d, ff, generator=gen))
    x, idx = torch.randn(1, d, generator=gen), torch.arange(8)
    w_int8 = torch.randint(-127, 128, (2 * ff, d), generator=gen, dtype=torch.int8)
    scale = torch.rand(2 * ff, generator=gen) * 0.01
    scores = torch.randn(1, ff, generator=gen)
    mlp_args = (x, w["w_gate"], w["w_up"], w["w_down_t"], idx, "silu")
    variants = {
        "dejavu::sparse_gated_mlp (custom_op, Python kernel -> C via ctypes)":
            lambda: torch.ops.dejavu.sparse_gated_mlp.default(*mlp_args, None, None, None, False),
        "the same C kernel called from Python directly (ctypes)":
            lambda: native.sparse_mlp_f32(*mlp_args, None, None, None),
        "dejavu::int8_linear (custom_op) + torch.topk":
            lambda: torch.topk(torch.ops.dejavu.int8_linear.default(x, w_int8, scale)[:, :ff], 922, sorted=False),
        "torch.topk alone (1536 scores, k=922)": lambda: torch.topk(scores, 922, sorted=False),
        "aten add of two (1, 576) tensors": lambda: torch.add(x, x),
    }
    if native.load_ops():
        variants["dejavu::cpu_sparse_mlp (C++ op)"] = lambda: torch.ops.dejavu.cpu_sparse_mlp.default(*mlp_args)
        variants["dejavu::cpu_glu_int8_topk (C++ op, k=922; reads 1.8 MB)"] = \
            lambda: torch.ops.dejavu.cpu_glu_int8_topk.default(x, w_int8, scale, 922, "silu")
    flush = torch.ones(max(1, args.flush_mb << 18))  # float32: MB * 2^20 / 4
    times = {name: [] for name in variants}
    with torch.no_grad():  # as in generate(): the autograd dispatch key is still on
        for i in range(args.calls + 5):
            for name, fn in variants.items():
                if args.flush_mb:
                    flush.sum()
                start = time.perf_counter()
                fn()
                if i >= 5:
                    times[name].append(time.perf_counter() - start)
    print(f"machine: {machine_description()}; {args.flush_mb} MB streamed before each call; "
          f"median of {args.calls} calls")
    for name, t in times.items():
        print(f"  {statistics.median(t) * 1e6:8.1f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
