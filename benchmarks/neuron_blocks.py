"""Could the MLP keep neurons in blocks of b adjacent rows instead of one by one? (SmolLM2-135M)

Short rows are what makes SmolLM2's sparse gathers slow on CPU (576 floats: 2.3 KB each, read at
about half the dense bandwidth); b rows in a row stream like dense ones. Permuting an MLP's neurons
is free (gate/up rows and down columns together, outputs unchanged), so neurons that are important
together could be put side by side. This measures the quality cost with a perfect selector: per
token, the top blocks by their true summed |act(gate)*up|, after a co-activation permutation found
on calibration tokens (greedy: the most important unplaced neuron and the b-1 unplaced neurons
whose per-token importance is most similar to it), against the per-neuron oracle and against
blocks of the unpermuted order. Perplexity on held-out text, masked dense simulation.

    python benchmarks/neuron_blocks.py                 # b = 4, 8, 16 at densities 0.5 and 0.7
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from dejavu_compile.experiments.quality import (
    SIM_LABEL,
    add_harness_arguments,
    increases,
    oracle_selector,
    smollm2_harness,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def coactivation_order(importance: torch.Tensor, block: int) -> torch.Tensor:
    """(N, F) per-token importance -> a permutation of F whose consecutive `block`-tuples co-activate."""
    x = importance / importance.sum(1, keepdim=True).clamp_min(1e-12)
    x = x / x.norm(dim=0, keepdim=True).clamp_min(1e-12)
    similarity = x.T @ x
    free = torch.ones(similarity.shape[0], dtype=torch.bool)
    order = []
    for j in importance.mean(0).argsort(descending=True).tolist():
        if not free[j]:
            continue
        free[j] = False
        candidates = similarity[j].masked_fill(~free, float("-inf"))
        mates = candidates.topk(block - 1).indices
        free[mates] = False
        order += [j, *mates.tolist()]
    return torch.tensor(order)


def block_mask(importance: torch.Tensor, order: torch.Tensor, block: int, density: float) -> torch.Tensor:
    """0/1 (N, F) mask of the top blocks (of `order`'s consecutive `block`-tuples) per token."""
    n, total = importance.shape
    sums = importance[:, order].reshape(n, total // block, block).sum(-1)
    top = sums.topk(max(1, round(density * total / block)), dim=-1).indices
    kept = torch.zeros(n, total // block).scatter(1, top, 1.0).repeat_interleave(block, 1)
    mask = torch.empty_like(kept)
    mask[:, order] = kept
    return mask


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.7])
    add_harness_arguments(ap, str(RESULTS / "neuron_blocks.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.time()
    harness = smollm2_harness(args.calib_tokens, args.eval_tokens)
    model, samples, sets, dense = harness.model, harness.samples, harness.sets, harness.dense
    total = samples[0].mlp_importance.shape[1]
    orders = {(b, layer): coactivation_order(s.mlp_importance.float(), b)
              for b in args.blocks for layer, s in samples.items()}

    rows = []

    def record(selection, block, density, selector):
        row = {"selection": selection, "block": block, "density": density, **increases(model, sets, dense, selector)}
        rows.append(row)
        print(f"{selection:22s} b={block:<3d} density {density:.2f}: wiki {row['wiki_increase']:+8.2%}  "
              f"news {row['news_increase']:+8.2%}", flush=True)

    for density in args.densities:
        record("neuron oracle", 1, density, oracle_selector(density))
        for b in args.blocks:
            for selection in ("block oracle, permuted", "block oracle, as stored"):
                def selector(layer, kind, x, look, *, importance, b=b, density=density, selection=selection):
                    if kind != "mlp":
                        return None
                    order = orders[(b, layer)] if selection.endswith("permuted") else torch.arange(total)
                    return block_mask(importance.float(), order, b, density)
                record(selection, b, density, selector)
    pathlib.Path(args.out).write_text(json.dumps({
        "label": SIM_LABEL, "model": "SmolLM2-135M-Instruct", "dense": dense, "rows": rows,
        "note": "permutation found on the calibration split; perplexity on held-out Wikipedia and news",
        "total_s": time.time() - t0}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
