"""What rank would a low-rank gated-MLP predictor need on SmolLM2-135M? Recall, quality and cost by rank.

The learned low-rank predictor (``fit_glu_predictor``: rank-r maps for the gate and the up
projection, scored |act(g~) * u~|) is far from the oracle at the default rank d/4. This sweeps the
rank, without lookahead (the predictor's best case: it reads the block's own input), and reports
for a 50% MLP density: mean top-k recall and captured |activation| mass on held-out calibration
tokens, held-out perplexity (masked dense simulation), and the bytes the predictor reads per token
as a share of the fp32 block's (the int8 predictor: 1/6). At rank d (576) the maps are exact.

    python benchmarks/predictor_rank.py                       # ranks 72, 144, 288, 576
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from dejavu_compile.calibration.calibrate import calibrate
from dejavu_compile.experiments.quality import (
    SIM_LABEL,
    add_harness_arguments,
    increases,
    oracle_selector,
    plan_selector,
    smollm2_harness,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[72, 144, 288, 576])
    ap.add_argument("--density", type=float, default=0.5)
    add_harness_arguments(ap, str(RESULTS / "predictor_rank.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.time()
    harness = smollm2_harness(args.calib_tokens, args.eval_tokens)
    model, tok, samples, sets, dense = harness.model, harness.tokenizer, harness.samples, harness.sets, harness.dense
    cfg = model.config
    block_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * 4
    oracle = increases(model, sets, dense, oracle_selector(args.density))
    print(f"oracle top-k at {args.density}: wiki {oracle['wiki_increase']:+.2%}  news {oracle['news_increase']:+.2%}")
    rows = []
    for rank in args.ranks:
        plan = calibrate(model, tok, mlp_density=args.density, lookahead=False, rank=rank, samples=samples,
                         dense_when_unprofitable=False, progress=False)
        mlp = [plan.entry(l, "mlp") for l in range(plan.num_layers)]
        row = {"rank": rank, "plan_density": plan.mlp_density,
               "recall": sum(e.stats["recall"] for e in mlp) / len(mlp),
               "mass": sum(e.stats["mass"] for e in mlp) / len(mlp),
               "oracle_mass": sum(e.stats["oracle_mass"] for e in mlp) / len(mlp),
               "predictor_bytes_vs_block": mlp[0].read_bytes(4) / block_bytes}
        row.update(increases(model, sets, dense, plan_selector(plan)))
        rows.append(row)
        print(f"rank {rank:4d}: recall {row['recall']:.3f}  mass {row['mass']:.3f} (oracle {row['oracle_mass']:.3f})  "
              f"predictor {row['predictor_bytes_vs_block']:.0%} of the block's bytes  "
              f"wiki {row['wiki_increase']:+.2%}  news {row['news_increase']:+.2%}", flush=True)
    pathlib.Path(args.out).write_text(json.dumps({
        "label": SIM_LABEL, "model": "SmolLM2-135M-Instruct", "density": args.density, "dense": dense,
        "oracle": oracle, "rows": rows, "total_s": time.time() - t0}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
