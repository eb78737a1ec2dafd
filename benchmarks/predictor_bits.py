"""How many bits the quantized-weight predictor needs: recall of its top-k on SmolLM2 (real weights,
real text), by weight precision.

    python benchmarks/predictor_bits.py

The int8 predictor (``calibrate(..., predictor="int8")``) scores neurons with the block's own gate
and up weights quantized per row. On SmolLM2 its bytes are what keeps a sparse CPU decode step near
dense speed (1.8 MB a layer against 6.4 MB of rows at 60% density), so fewer bits would pay if the
selection held. Recall = share of the oracle's top-k (by |act(gate) * up|) that the predictor keeps,
averaged over layers and tokens (512 tokens of calibration-split Wikipedia). The last row is the
learned int4 predictor (``calibrate(..., predictor="int4")``): 4 bits, groups of 32, fitted with
``fit_int4_glu_predictor`` to the inputs of another 1,024 calibration tokens (not those scored).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def quantize(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Symmetric round-to-nearest, one scale per row (or per `group` columns), dequantized."""
    top = 2 ** (bits - 1) - 1
    blocks = w.view(w.shape[0], -1, group or w.shape[1])
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    return ((blocks / scale).round().clamp(-top, top) * scale).view_as(w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.6])
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from dejavu_compile.assets.data import wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.plan.predictors.glu_int4 import fit_int4_glu_predictor, int4_glu_rows
    from dejavu_compile.plan.predictors.metrics import recall

    model, tok = load_smollm2()
    text = tok("\n\n".join(wiki_articles("calibration")[:16]), return_tensors="pt").input_ids
    ids, fit_ids = text[:, :args.tokens], text[:, args.tokens:args.tokens + 1024]
    inputs, fit_inputs = {}, {}
    for store, batch in ((inputs, ids), (fit_inputs, fit_ids)):
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i, store=store: store.__setitem__(i, a[0][0]))
                 for i, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(batch)
        for h in hooks:
            h.remove()
    formats = {"int8": (8, None), "int6": (6, None), "int5": (5, None), "int4": (4, None),
               "int4, groups of 64": (4, 64), "int4, groups of 32": (4, 32), "int4, groups of 32, fitted": (4, "fit")}
    print(f"recall of the top-k against the oracle, SmolLM2-135M, {ids.shape[1]} tokens, mean over 30 layers")
    fitted = {}
    print(f"{'weights':<28}" + "".join(f"{'density ' + str(d):>14}" for d in args.densities))
    with torch.no_grad():
        for name, (bits, group) in formats.items():
            cells = []
            for density in args.densities:
                values = []
                for i, layer in enumerate(model.model.layers):
                    x, wg, wu = inputs[i], layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
                    importance = (F.silu(x @ wg.T) * (x @ wu.T)).abs()
                    if group == "fit":
                        if i not in fitted:
                            fitted[i] = int4_glu_rows(fit_int4_glu_predictor(fit_inputs[i], wg, wu))
                        qg, qu = fitted[i][:wg.shape[0]], fitted[i][wg.shape[0]:]
                    else:
                        qg, qu = quantize(wg, bits, group), quantize(wu, bits, group)
                    scores = (F.silu(x @ qg.T) * (x @ qu.T)).abs()
                    values.append(recall(scores, importance, int(density * wg.shape[0])))
                cells.append(f"{sum(values) / len(values):>14.3f}")
            print(f"{name:<28}" + "".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
