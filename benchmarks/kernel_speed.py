"""Dense vs sparse decode kernels (batch 1): median times, speedup, efficiency = speedup x density.

    python benchmarks/kernel_speed.py [--quick] [--shapes llama7b smollm2] [--threads N] [--ops mlp bounds]
    THP_MEM_ALLOC_ENABLE=0 python benchmarks/kernel_speed.py ...   # without transparent huge pages
    DEJAVU_CFLAGS=-mno-avx512f python benchmarks/kernel_speed.py ...   # the AVX2 paths of an AVX-512 CPU
    python benchmarks/kernel_speed.py --cpu-paths native torch --prefetch-sweep   # CPU MLP paths, prefetch settings

CPU: fp32 (``--dtype bfloat16`` / ``float16``: weights read as stored; ``--dtype int8``: rows ``gated_mlp/q8``,
the int8 ops of ``quantize_weights``' format, dense and sparse, see ``bench_q8_mlp``), dense = the torch ops a
decoder's MLP runs (three F.linear), sparse = the dejavu ops (efficiency also against the backend's
own dense path, its GEMV op, column "GEMV"); the sparse MLP op runs through each CPU path:
"native" (the C kernel fp32 calls take, rows ``gated_mlp``), "c++" (the same kernel through the
C++-registered op decode graphs call, rows ``gated_mlp/c++``) and "torch" (the Inductor-fused
gather-GEMV + embedding_bag, rows ``gated_mlp/torch``). CUDA (auto-detected): fp16, dense
on cuBLAS, sparse = the Triton kernels (autotuned), both timed as CUDA-graph replays (kernel time,
no launch overhead). Efficiency 1.0 means the sparse op reaches the bandwidth limit (time scales
with the bytes it reads). Each sparse MLP row also
reports its error against a masked dense fp32 reference.

Caches: decode reads every layer's weights once per token, so nothing stays cached between two
calls on the same layer. The script cycles through enough copies of the layer weights to exceed the
last-level cache, draws fresh random indices every call, and interleaves dense and sparse calls.
It also measures the bandwidth of the building blocks (dense GEMV, row gather, embedding_bag) to show
what bounds the sparse path. Results: a table on stdout and JSON under benchmarks/results/.
"""
from __future__ import annotations

import os

# Transparent huge pages for large tensors (c10's allocator reads this): random row gathers over
# hundreds of MB of weights miss the TLB on every 4 KiB page otherwise. Same for dense and sparse.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import json
import platform
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

from dejavu_compile.evaluation.bench import cpu_info
from dejavu_compile.kernels import prepare_gated_mlp_weights, sparse_gated_mlp
from dejavu_compile.kernels.cpu import native
from dejavu_compile.kernels.torch_impl import _FUSED, gather_activate, gather_gemv

SHAPES = {
    "llama7b": dict(d=4096, ff=11008),
    "smollm2": dict(d=576, ff=1536),
}
DENSITIES = (0.05, 0.1, 0.25, 0.5, 0.75)
CACHE_BYTES = 512 << 20  # cycle through more weight bytes than this (above the 260 MiB LLC here)
POOL = 64  # fresh random indices per call, so selected rows are not reused from cache


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e-3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def n_copies(layer_bytes):
    return max(2, -(-CACHE_BYTES // layer_bytes))


GRAPH_CALLS = 16  # CUDA: at least this many calls (and every weight copy) in one timed graph replay


def graphed(fn, calls):
    """A CUDA graph of fn(0..calls-1): replaying it times the kernels alone, without Python and
    launch overhead (what a decode step under CUDA graphs pays). Warm-up first: autotuning runs
    there, never inside the capture."""
    for j in range(2):
        fn(j)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            fn(j)
    return graph


def interleaved(timer, dense, sparse, reps, copies):
    """Alternate dense and sparse calls, each on the next weight copy; all timings (s) of each.
    On CUDA each timing is one graph replay of GRAPH_CALLS calls over the copies, per call."""
    if timer.cuda:
        calls = copies * max(1, GRAPH_CALLS // copies)
        gd = graphed(lambda j: dense(j % copies), calls)
        gs = graphed(lambda j: sparse((j + copies // 2) % copies), calls)
        td, ts = [], []
        for i in range(reps + 2):
            d, s = timer(gd.replay) / calls, timer(gs.replay) / calls
            if i >= 2:
                td.append(d)
                ts.append(s)
        return td, ts
    td, ts = [], []
    for i in range(reps + 2):
        d = timer(lambda: dense(i % copies))
        s = timer(lambda: sparse((i + copies // 2) % copies))
        if i >= 2:  # warm-up
            td.append(d)
            ts.append(s)
    return td, ts


def summarize(op, k, total, td, ts):
    """Medians (the figures) and minimums (less sensitive to other processes on the machine)."""
    dm, sm = statistics.median(td), statistics.median(ts)
    return dict(op=op, density=k / total, k=k, dense_ms=dm * 1e3, sparse_ms=sm * 1e3, speedup=dm / sm,
                efficiency=dm / sm * k / total, dense_min_ms=min(td) * 1e3, sparse_min_ms=min(ts) * 1e3,
                efficiency_of_min=min(td) / min(ts) * k / total)


def bench_mlp(shape, dtype, device, reps, densities, timer, label="gated_mlp", op=sparse_gated_mlp):
    d, ff = shape["d"], shape["ff"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    layer_bytes = 3 * d * ff * torch.finfo(dtype).bits // 8
    layers = []
    for _ in range(n_copies(layer_bytes)):
        w = [torch.randn(*s, generator=gen).div_(s[1] ** 0.5).to(device, dtype) for s in ((ff, d), (ff, d), (d, ff))]
        layers.append(prepare_gated_mlp_weights(*w))
        # the dense baselines read the weights as a model stores them: gate and up each contiguous
        # (the views into the stacked (F, 2, d) storage interleave them, which slows a GEMV's stream)
        layers[-1]["model"] = dict(w_gate=w[0], w_up=w[1], w_down=layers[-1]["dense"]["w_down"])
        del w
    x = torch.randn(1, d, generator=gen).to(device, dtype)

    def dense(i):
        w = layers[i]["model"]
        return F.linear(F.silu(F.linear(x, w["w_gate"])) * F.linear(x, w["w_up"]), w["w_down"])

    # The backend's own dense decode path on CPU (fp32, bf16, fp16): the same three projections through
    # its GEMV op (dejavu::cpu_linear). Efficiency is also reported against it, the faster dense baseline here.
    gemv_ms = None
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and native.load_ops():
        def dense_gemv(i):
            w, lin = layers[i]["model"], torch.ops.dejavu.cpu_linear
            return lin(F.silu(lin(x, w["w_gate"])) * lin(x, w["w_up"]), w["w_down"])

        gemv_ms = statistics.median(interleaved(timer, dense_gemv, dense, reps, len(layers))[0]) * 1e3
    rows = []
    for dens in densities:
        k = max(1, round(dens * ff))
        pool = [torch.randperm(ff, generator=gen)[:k].sort().values.to(device) for _ in range(POOL)]
        calls = [0]

        def sparse(i):
            calls[0] += 1
            p = layers[i]
            return op(x, p["w_gate"], p["w_up"], p["w_down_t"], pool[calls[0] % POOL], "silu")

        row = summarize(label, k, ff, *interleaved(timer, dense, sparse, reps, len(layers)))
        row["rel_err"] = mlp_error(x, layers[0], pool[0], op)
        row.update(dense_GBps=layer_bytes / row["dense_ms"] / 1e6,
                   sparse_GBps=layer_bytes * k / ff / row["sparse_ms"] / 1e6)
        if gemv_ms is not None:
            row.update(dense_gemv_ms=gemv_ms, efficiency_vs_gemv=gemv_ms / row["sparse_ms"] * k / ff,
                       dense_gemv_GBps=layer_bytes / gemv_ms / 1e6)
        rows.append(row)
    return rows


def bench_q8_mlp(shape, reps, densities, timer):
    """An MLP with int8 weights in quantize_weights' format (groups of 32, fp32 scales), CPU: dense =
    the three projections through the backend's int8 GEMV (dejavu::cpu_q8_linear, what a quantized
    model runs), sparse = dejavu::cpu_q8_sparse_mlp over the same gate and up rows and the down
    weight stored transposed (quantized along d_out). Bytes: the int8 values and their scales."""
    from dejavu_compile.compiler.quantize import dequantize_rows_grouped, quantize_rows_grouped

    d, ff, group = shape["d"], shape["ff"], 32
    gen = torch.Generator(device="cpu").manual_seed(0)
    layer_bytes = 3 * d * ff * (group + 4) // group
    layers = []
    for _ in range(n_copies(layer_bytes)):
        w = [torch.randn(*s, generator=gen).div_(s[1] ** 0.5) for s in ((ff, d), (ff, d), (d, ff))]
        layers.append(dict(gate=quantize_rows_grouped(w[0], group), up=quantize_rows_grouped(w[1], group),
                           down=quantize_rows_grouped(w[2], group),
                           down_t=quantize_rows_grouped(w[2].t().contiguous(), group)))
        del w
    x = torch.randn(1, d, generator=gen)
    lin, sparse_op = torch.ops.dejavu.cpu_q8_linear, torch.ops.dejavu.cpu_q8_sparse_mlp

    def dense(i):
        p = layers[i]
        return lin(F.silu(lin(x, *p["gate"], None)) * lin(x, *p["up"], None), *p["down"], None)

    p0 = layers[0]
    h0 = F.silu(x @ dequantize_rows_grouped(*p0["gate"]).T) * (x @ dequantize_rows_grouped(*p0["up"]).T)
    rows = []
    for dens in densities:
        k = max(1, round(dens * ff))
        pool = [torch.randperm(ff, generator=gen)[:k].sort().values for _ in range(POOL)]
        calls = [0]

        def sparse(i):
            calls[0] += 1
            p = layers[i]
            return sparse_op(x, *p["gate"], *p["up"], *p["down_t"], pool[calls[0] % POOL], "silu")

        row = summarize("gated_mlp/q8", k, ff, *interleaved(timer, dense, sparse, reps, len(layers)))
        ref = h0[:, pool[0]] @ dequantize_rows_grouped(*p0["down_t"])[pool[0]]
        out = sparse_op(x, *p0["gate"], *p0["up"], *p0["down_t"], pool[0], "silu")
        row["rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
        dense_gbps = layer_bytes / row["dense_ms"] / 1e6
        row.update(dense_GBps=dense_gbps, sparse_GBps=layer_bytes * k / ff / row["sparse_ms"] / 1e6,
                   dense_gemv_ms=row["dense_ms"], efficiency_vs_gemv=row["efficiency"], dense_gemv_GBps=dense_gbps)
        rows.append(row)
        rows.append(_bench_q8_glu(layers, x, k, ff, h0, timer, reps, dense, layer_bytes))
    return rows


def _bench_q8_glu(layers, x, k, ff, h0, timer, reps, dense, layer_bytes):
    """dejavu::cpu_q8_glu_mlp, what the compiler emits for a gated int8 MLP: its own gate and up read
    whole (they choose the k neurons), the kept rows of the down weight's int8 values transposed.
    Its byte count is 2/3 + k / (3 ff) of the block's, so it is measured against that share of the
    dense GEMVs' time ("share_of_byte_bound")."""
    op = torch.ops.dejavu.cpu_q8_glu_mlp
    transposed = [(p["down"][0].t().contiguous(), p["down"][1].t().contiguous()) for p in layers]

    def glu(i):
        p = layers[i]
        return op(x, *p["gate"], *p["up"], *transposed[i], k, "silu", None)

    row = summarize("gated_mlp/q8 own gate-up", k, ff, *interleaved(timer, dense, glu, reps, len(layers)))
    share = 2 / 3 + k / (3 * ff)
    row.update(bytes_share=share, share_of_byte_bound=row["speedup"] * share,
               sparse_GBps=layer_bytes * share / row["sparse_ms"] / 1e6)
    out, idx = op(x, *layers[0]["gate"], *layers[0]["up"], *transposed[0], k, "silu", None)
    from dejavu_compile.compiler.quantize import dequantize_rows_grouped

    ref = (h0.gather(1, idx) @ dequantize_rows_grouped(*layers[0]["down"]).T[idx[0]])
    row["rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
    return row


def bench_cpu_paths(shape, dtype, device, reps, densities, timer, paths):
    """The CPU sparse MLP through each path: "native" (the public op, C kernel: what fp32 calls
    take), "c++" (the same kernel through the C++-registered op the backend's decode graphs call,
    without the Python custom-op call) and "torch" (the Inductor-fused gather-GEMV + embedding_bag,
    still the path of other dtypes and machines without a C compiler)."""
    rows = []
    for path in paths:
        if path in ("native", "c++") and not (native.load_ops() if path == "c++" else native.available()):
            print(f"# {path} kernel unavailable ({native._OPS['error'] or native._STATE['error']}): skipping")
            continue
        op = sparse_gated_mlp
        if path == "c++":
            def op(x, wg, wu, wdt, idx, act):
                return torch.ops.dejavu.cpu_sparse_mlp(x, wg, wu, wdt, idx, act)
        with mock.patch.dict(native._STATE, enabled=path != "torch"):
            label = {"native": "gated_mlp", "c++": "gated_mlp/c++", "torch": "gated_mlp/torch"}[path]
            rows += bench_mlp(shape, dtype, device, reps, densities, timer, label, op)
    return rows


def prefetch_sweep(shape, dtype, device, reps, timer, densities=(0.25, 0.5)):
    """Efficiency of the C kernel over its prefetch settings (rows ahead x bytes per row)."""
    out = []
    for rows_ahead, nbytes in [(0, 0), (2, 64), (4, 64), (2, 256), (4, 256), (8, 256), (4, 1024), (4, 1 << 20)]:
        with mock.patch.multiple(native, PREFETCH_ROWS=rows_ahead, PREFETCH_BYTES=nbytes):
            for r in bench_mlp(shape, dtype, device, reps, densities, timer, f"prefetch {rows_ahead}x{nbytes}B"):
                out.append(dict(prefetch_rows=rows_ahead, prefetch_bytes=nbytes, density=r["density"],
                                efficiency=r["efficiency"], efficiency_of_min=r["efficiency_of_min"]))
                print(f"  prefetch {rows_ahead} rows x {nbytes} B, density {r['density']:.2f}: "
                      f"efficiency {r['efficiency']:.2f} (of minimums {r['efficiency_of_min']:.2f})")
    return out


def mlp_error(x, p, idx, op):
    """max |sparse - masked dense| / max |masked dense|, reference in fp32: a wrong kernel is never
    reported as a fast one."""
    w = {n: t.float() for n, t in p["dense"].items()}
    xf = x.float()
    h = F.silu(xf @ w["w_gate"].T) * (xf @ w["w_up"].T)
    mask = torch.zeros_like(h)
    mask[:, idx] = 1.0
    ref = (h * mask) @ w["w_down"].T
    out = op(x, p["w_gate"], p["w_up"], p["w_down_t"], idx, "silu").float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def bench_bounds(shape, dtype, device, reps, densities, timer):
    """GB/s of the building blocks on cold weights (bytes of the selected rows / time): dense GEMV;
    a plain row gather (index_select copy); the gate/up part as the Inductor-fused gather-GEMV and as
    the chunked gather + GEMV (the no-compiler fallback); the embedding_bag weighted row sum of the
    down part."""
    d, ff = shape["d"], shape["ff"]
    gen = torch.Generator(device="cpu").manual_seed(2)
    mat_bytes = d * ff * torch.finfo(dtype).bits // 8
    mats = [torch.randn(ff, d, generator=gen).to(device, dtype) for _ in range(n_copies(mat_bytes))]
    x = torch.randn(1, d, generator=gen).to(device, dtype)
    out = {}
    def med(fn):
        return statistics.median([timer(lambda i=i: fn(i)) for i in range(reps + 2)][2:])
    out["dense_gemv_GBps"] = mat_bytes / med(lambda i: F.linear(x, mats[i % len(mats)])) / 1e9
    fused = (torch.compile(gather_activate, dynamic=True, fullgraph=True)
             if _FUSED["enabled"] and device.type == "cpu" else None)
    for dens in densities:
        k = max(1, round(dens * ff))
        pool = [torch.randperm(ff, generator=gen)[:k].sort().values.to(device) for _ in range(POOL)]
        buf = torch.empty(k, d, dtype=dtype, device=device)
        h = torch.randn(k, generator=gen).to(device, dtype)
        offs = torch.arange(0, k, -(-k // (2 * torch.get_num_threads())), device=device)
        sel = mat_bytes * k / ff
        out[f"row_gather_GBps@{dens}"] = sel / med(
            lambda i: torch.index_select(mats[i % len(mats)], 0, pool[i % POOL], out=buf)) / 1e9
        pre = torch.empty(k, 1, 1, dtype=dtype, device=device)
        out[f"chunked_gather_gemv_GBps@{dens}"] = sel / med(
            lambda i: gather_gemv([mats[i % len(mats)]], pool[i % POOL], x.t(), pre)) / 1e9
        if fused is not None:
            out[f"fused_gather_gemv_GBps@{dens}"] = sel / med(
                lambda i: fused(x, mats[i % len(mats)], None, pool[i % POOL][None], None, None, "relu")) / 1e9
        out[f"embedding_bag_GBps@{dens}"] = sel / med(
            lambda i: F.embedding_bag(pool[i % POOL], mats[i % len(mats)], offs, mode="sum",
                                      per_sample_weights=h)) / 1e9
    return out


def plot(paths, out):
    """Efficiency (speedup x density) of the sparse MLP op vs density, one line per results file
    and shape: where the kernels stand against the bandwidth limit (1.0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for path in paths:
        result = json.load(open(path))
        m = result["machine"]
        where = m.get("gpu") or f"CPU {m['threads']} thread{'s' if m['threads'] > 1 else ''}"
        for name, shape in result["shapes"].items():
            for op in ("gated_mlp", "gated_mlp/c++", "gated_mlp/torch"):
                rows = [r for r in shape["rows"] if r["op"] == op]
                if rows:
                    path_name = {"gated_mlp": "", "gated_mlp/c++": " (C++ op)",
                                 "gated_mlp/torch": " (Inductor-fused torch path)"}[op]
                    ax.plot([r["density"] for r in rows], [r["efficiency"] for r in rows],
                            {"": "o-", " (C++ op)": "s:", " (Inductor-fused torch path)": "o--"}[path_name],
                            label=f"{name}, {where}, {m['dtype'].replace('torch.', '')}{path_name}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("MLP density (fraction of neurons kept)")
    ax.set_ylabel("efficiency = speedup x density")
    ax.set_title("sparse_gated_mlp vs dense, batch 1 (1.0 = bandwidth limit)")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions, LLaMA MLP at 0.1/0.5 only + SmolLM2")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ops", nargs="+", default=["mlp", "bounds"], choices=["mlp", "bounds"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--cpu-paths", nargs="+", default=["native", "c++", "torch"], choices=["native", "c++", "torch"],
                    help="CPU sparse MLP paths to measure (native: the public op, C kernel; c++: the same kernel "
                         "through the backend's C++ op; torch: Inductor-fused)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "int8"],
                    help="weights and activations (default: float32 on CPU, float16 on CUDA); int8: CPU weights "
                         "in quantize_weights' format, fp32 activations, dense and sparse through the int8 ops")
    ap.add_argument("--prefetch-sweep", action="store_true", help="also sweep the C kernel's prefetch settings")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/kernels-<device>-t<threads>.json)")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these results files (to --out, a .png)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot, args.out or os.path.join(os.path.dirname(__file__), "results", "kernels.png"))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q8 = args.dtype == "int8"
    if q8 and (device.type != "cpu" or not native.load_ops()):
        ap.error("--dtype int8 measures the CPU int8 ops: it needs a CPU run and the C++ ops")
    dtype = torch.int8 if q8 else getattr(torch, args.dtype) if args.dtype else \
        torch.float16 if device.type == "cuda" else torch.float32
    reps = 5 if args.quick else 21
    densities = (0.1, 0.5) if args.quick else DENSITIES
    timer = Timer(device)
    if device.type == "cuda":  # the idx range check syncs with the GPU; a compiled backend turns it off
        from dejavu_compile.kernels import _common
        _common.CHECK_INDICES = False
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"# WARNING: load average {os.getloadavg()} - other processes share the CPUs; "
              "multi-threaded CPU timings will be noisy (OpenMP barriers wait for descheduled threads)")
    machine = dict(device=str(device), gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                   platform=platform.platform(), processor=platform.processor() or platform.machine(),
                   threads=torch.get_num_threads(), cpus=os.cpu_count(), loadavg_at_start=os.getloadavg(),
                   torch=torch.__version__, dtype=str(dtype), reps=reps, cflags=os.environ.get("DEJAVU_CFLAGS", ""),
                   cpu_model="{cpu}, {isa}".format(**cpu_info()),
                   thp_mem_alloc=os.environ.get("THP_MEM_ALLOC_ENABLE"), cpu_fused_gather=_FUSED["enabled"],
                   cpu_c_kernel=device.type == "cpu" and native.available(),
                   c_kernel_prefetch=native.prefetch_default() if device.type == "cpu" and native.available() else None)
    print(f"# {machine}")
    result = dict(machine=machine, shapes={})
    torch.set_grad_enabled(False)
    for name in args.shapes:
        shape = SHAPES[name]
        rows = []
        if "mlp" in args.ops and q8:
            rows = bench_q8_mlp(shape, reps, densities, timer)
        elif "mlp" in args.ops:
            rows = (bench_cpu_paths(shape, dtype, device, reps, densities, timer, args.cpu_paths)
                    if device.type == "cpu" else bench_mlp(shape, dtype, device, reps, densities, timer))
        bounds = (bench_bounds(shape, dtype, device, reps, densities, timer)
                  if device.type == "cpu" and "bounds" in args.ops and not q8 else {})
        result["shapes"][name] = dict(shape=shape, rows=rows, bounds=bounds)
        if args.prefetch_sweep and device.type == "cpu" and native.available() and not q8:
            result["shapes"][name]["prefetch_sweep"] = prefetch_sweep(shape, dtype, device, reps, timer)
        print(f"\n## {name} {shape}")
        print(f"{'op':<15}{'density':>8}{'dense ms':>10}{'sparse ms':>11}{'speedup':>9}{'effic.':>8}"
              f"{'| min: dense':>13}{'sparse':>9}{'effic.':>8}{'rel.err':>9}{'| GEMV ms':>10}{'effic.':>8}")
        for r in rows:
            print(f"{r['op']:<15}{r['density']:>8.3f}{r['dense_ms']:>10.3f}{r['sparse_ms']:>11.3f}"
                  f"{r['speedup']:>9.2f}{r['efficiency']:>8.2f}{r['dense_min_ms']:>13.3f}"
                  f"{r['sparse_min_ms']:>9.3f}{r['efficiency_of_min']:>8.2f}"
                  + (f"{r['rel_err']:>9.1e}" if "rel_err" in r else "")
                  + (f"{r['dense_gemv_ms']:>10.3f}{r['efficiency_vs_gemv']:>8.2f}" if "dense_gemv_ms" in r else ""))
        for key, val in bounds.items():
            print(f"  {key}: {val:.1f}")
    name = f"kernels-{device.type}-t{torch.get_num_threads()}.json"
    path = args.out or os.path.join(os.path.dirname(__file__), "results", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    print(f"# load average at end: {os.getloadavg()}")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
