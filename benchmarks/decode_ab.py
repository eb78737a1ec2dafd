"""Decode speed of two source trees of this package, side by side in one run (A/B of a change).

    git worktree add /tmp/base <commit>
    python benchmarks/decode_ab.py /tmp/base . --rounds 3 --out benchmarks/results/decode-ab.json

Each round starts one process per tree (alternating which goes first), each loading SmolLM2-135M,
the same plan directory (calibrated once with the first tree's defaults, unless --plan names one),
and measuring Inductor dense and dejavu decode interleaved with the tree's own
``evaluation.bench.measure_decode`` (static cache, greedy, medians). Only
the public API is used (``dejavu_compile.calibrate``, ``SparsityPlan``, ``prepare_model``), so any
two versions compare. Reported: tokens/s per tree and the dejavu/dense ratio, which cancels most
of the machine's drift between processes. Then one process per tree measures held-out perplexity (dense
and the plan through the masked simulation) on the bundled Wikipedia and news texts.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROMPT = "The history of the city begins in the Roman period, when"


def _use_tree(tree: str):
    """Import dejavu_compile from ``tree`` (ahead of any installed copy)."""
    sys.path.insert(0, str(pathlib.Path(tree).resolve()))
    for name in [m for m in sys.modules if m == "dejavu_compile" or m.startswith("dejavu_compile.")]:
        del sys.modules[name]
    import torch

    import dejavu_compile

    # backend="dejavu" inside the tree (its perplexity) must mean this tree's backend, not the
    # installed package's entry point
    torch._dynamo.register_backend(compiler_fn=dejavu_compile.dejavu_backend, name="dejavu")
    return dejavu_compile


def _load_smollm2():
    try:
        from dejavu_compile.assets.models import load_smollm2
    except ImportError:  # trees laid out before the assets/ subpackage
        from dejavu_compile.models import load_smollm2
    return load_smollm2()


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    dv = _use_tree(args.tree)
    torch._dynamo.config.recompile_limit = 64
    model, tok = _load_smollm2()
    plan = dv.SparsityPlan.load(args.plan)
    plan.check(model)
    dv.prepare_model(model)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    from dejavu_compile.evaluation.bench import Variant, measure_decode  # the tree's own harness

    variants = [Variant("dense", lambda f: torch.compile(f, backend="inductor")),
                # the tree's own backend object, not the installed entry point
                Variant("dejavu", lambda f: torch.compile(f, backend=dv.dejavu_backend, options={"plan": plan}))]
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats, progress=False)
    result = {name: row["tokens_per_s"] for name, row in speed.items()}
    result["ratio"] = result["dejavu"] / result["dense"]
    result["tokens"] = variants[1].outputs[0, ids.shape[1]:].tolist()
    print("RESULT " + json.dumps(result))


def quality_worker(args) -> None:
    """Held-out perplexity, dense and under the plan (the backend's masked simulation)."""
    import torch

    torch.set_num_threads(args.threads)
    dv = _use_tree(args.tree)
    try:
        from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
        from dejavu_compile.evaluation.perplexity import perplexity
    except ImportError:  # trees laid out before the assets/ and evaluation/ subpackages
        from dejavu_compile.data import news_texts, tokenize_chunks, wiki_articles
        from dejavu_compile.evaluate import perplexity
    model, tok = _load_smollm2()
    plan = dv.SparsityPlan.load(args.plan)
    result = {}
    for name, texts, tokens in (("wiki", wiki_articles("eval"), args.eval_tokens),
                                ("news", news_texts(), args.eval_tokens)):
        chunks = tokenize_chunks(tok, texts, seq_len=256, max_tokens=tokens)
        dense, sparse = perplexity(model, chunks), perplexity(model, chunks, plan)
        result[name] = {"dense": dense, "plan": sparse, "increase": sparse / dense - 1}
    print("RESULT " + json.dumps(result))


def calibrate_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    dv = _use_tree(args.tree)
    model, tok = _load_smollm2()
    dv.calibrate(model, tok).save(args.plan)


def _run_worker(mode: str, tree: str, plan_dir: pathlib.Path, args) -> dict:
    """One worker process on ``tree``; its RESULT line."""
    proc = subprocess.run([sys.executable, __file__, mode, "--tree", tree, "--plan", str(plan_dir),
                           "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens),
                           "--threads", str(args.threads), "--eval-tokens", str(args.eval_tokens)],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(plan_dir.parent / "inductor-ab")})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{mode} for {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _cpu_model() -> str:
    """The CPU's model name and widest vector extension (from /proc/cpuinfo where there is one)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name or platform.machine()} ({vector})"


def _git(tree: str, *cmd) -> str:
    try:
        return subprocess.run(["git", "-C", tree, *cmd], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", help="two source trees (A then B)")
    ap.add_argument("--plan", default=None, help="plan directory (default: calibrate once with tree A)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per variant in each process")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "decode-ab.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per text set (0: no quality)")
    ap.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quality-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.calibrate_worker:
        return calibrate_worker(args)
    if args.quality_worker:
        return quality_worker(args)
    if len(args.trees) != 2:
        ap.error("give two source trees")
    plan_dir = pathlib.Path(args.plan) if args.plan else RESULTS.parent.parent / ".cache" / "decode-ab-plan"
    if not (plan_dir / "plan.json").exists():
        print(f"calibrating the default plan with {args.trees[0]} into {plan_dir} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--calibrate-worker", "--tree", args.trees[0], "--plan",
                        str(plan_dir), "--threads", str(args.threads)], check=True)
    runs = {tree: [] for tree in args.trees}
    for rnd in range(args.rounds):
        order = args.trees if rnd % 2 == 0 else args.trees[::-1]
        for tree in order:
            result = _run_worker("--worker", tree, plan_dir, args)
            runs[tree].append(result)
            print(f"round {rnd + 1}: {tree:<24} dense {result['dense']:6.1f} tok/s  dejavu {result['dejavu']:6.1f} "
                  f"tok/s  ratio {result['ratio']:.3f}", flush=True)
    quality = {tree: _run_worker("--quality-worker", tree, plan_dir, args) for tree in args.trees} \
        if args.eval_tokens else {}
    summary = {}
    for tree, rs in runs.items():
        summary[tree] = {"commit": _git(tree, "rev-parse", "HEAD"), "dirty": bool(_git(tree, "status", "--porcelain")),
                         "dense_tokens_per_s": statistics.median(r["dense"] for r in rs),
                         "dejavu_tokens_per_s": statistics.median(r["dejavu"] for r in rs),
                         "ratio": statistics.median(r["ratio"] for r in rs), "runs": rs,
                         "perplexity": quality.get(tree)}
    a, b = (summary[t] for t in args.trees)
    same_tokens = all(r["tokens"] == runs[args.trees[0]][0]["tokens"] for rs in runs.values() for r in rs)
    import torch

    record = {"machine": f"{_cpu_model()}, {args.threads} threads, torch {torch.__version__}",
              "command": "python benchmarks/decode_ab.py " + " ".join(sys.argv[1:]), "plan": str(plan_dir),
              "new_tokens": args.new_tokens, "rounds": args.rounds, "repeats": args.repeats,
              "trees": summary, "ratio_b_over_a": b["ratio"] / a["ratio"], "same_greedy_tokens": same_tokens}
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{record['machine']}")
    for tree in args.trees:
        s = summary[tree]
        q = s["perplexity"]
        ppl = f"  Δppl wiki {q['wiki']['increase']:+.2%} news {q['news']['increase']:+.2%}" if q else ""
        print(f"{tree:<24} {s['commit'][:8]}{'+' if s['dirty'] else ' '} dense {s['dense_tokens_per_s']:6.1f} "
              f"dejavu {s['dejavu_tokens_per_s']:6.1f} tok/s  dejavu/dense {s['ratio']:.3f}x{ppl}")
    print(f"B/A of dejavu/dense: {record['ratio_b_over_a']:.3f}; same greedy tokens: {same_tokens}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
