"""The bandwidth bound of a plan: how much faster a purely bandwidth-bound decoder could run."""
from __future__ import annotations

import torch

from dejavu_compile.compiler.explain import matched_blocks
from dejavu_compile.compiler.passes.sparse_attention import dense_query_reason, dense_reason


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def bandwidth_bound(model, plan) -> float:
    """Dense weight bytes per decode step over the bytes the plan reads: kept MLP rows (only their
    down rows when the plan takes their values from the int8 predictor, from its bf16 copy where the
    plan has one), kept heads' query and output rows, all other weights, the predictors, and a
    screened output head's int8 copy and candidate rows. The speedup a purely bandwidth-bound
    decoder could reach. (KV-cache reads are left out: small at the short contexts benchmarked
    here.) Attention blocks and query projections count as sparse exactly where the backend lowers
    them so (``sparsify_attention.dense_reason`` / ``dense_query_reason``)."""
    params = dict(model.named_parameters())
    element_size = next(iter(params.values())).element_size()
    total = sum(nbytes(p) for p in {id(p): p for p in model.parameters()}.values())
    # An input embedding reads one row per token; unless the output head shares it, leave it out.
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_weight = getattr(embed, "weight", None)  # an Int8Embedding holds buffers, not a parameter
    if isinstance(embed_weight, torch.nn.Parameter) and getattr(head, "weight", None) is not embed_weight:
        total -= nbytes(embed_weight)
    def ref_bytes(ref) -> float:  # a fused weight (gate_up_proj, c_attn): only the rows this role owns
        p = params[ref.name]
        if ref.rows is None:
            return nbytes(p)
        return nbytes(p) * (ref.rows[1] - ref.rows[0]) / p.shape[0 if ref.layout == "out_in" else 1]

    saved = 0.0
    for block in matched_blocks(model):
        entry = plan.entries.get((block.layer, block.kind))
        if entry is None or entry.dense:
            continue
        down_copy = False  # the kept down rows read from the plan's bf16 copy
        if block.kind == "mlp" and entry.values == "predictor" and block.gated:
            # kept neurons' values from the int8 predictor: gate and up not read, down rows kept
            saved += sum(ref_bytes(ref) for ref in (block.gate, block.up) if ref.name in params)
            sparse_refs = [block.down]
            down_copy = plan.down_rows == "bfloat16" and element_size == 4
        elif block.kind == "mlp":
            sparse_refs = block.weights.values()
        elif dense_reason(block) is not None:
            continue
        else:
            sparse_refs = [block.o] + ([block.q] if dense_query_reason(block) is None else [])
        sparse = sum(ref_bytes(ref) for ref in sparse_refs if ref.name in params)
        kept = entry.k / entry.total / (2 if down_copy else 1)
        saved += sparse * (1.0 - kept) - entry.read_bytes(element_size)
    k = plan.head_candidates
    if head is not None and 0 < k < head.weight.shape[0]:
        rows, d = head.weight.shape
        saved += nbytes(head.weight) * (1.0 - k / rows) - rows * (d + 4)  # int8 rows and an fp32 scale each
    return total / (total - saved)
