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
    plan has one; all of gate and up and the kept down rows in MLPs of quantize_weights' int8
    projections), kept heads' query and output rows, all other weights, the predictors, and a
    screened output head's int8 copy and candidate rows. The speedup a purely bandwidth-bound
    decoder could reach. (KV-cache reads are left out: small at the short contexts benchmarked
    here.) Attention blocks and query projections count as sparse exactly where the backend lowers
    them so (``sparsify_attention.dense_reason`` / ``dense_query_reason``)."""
    from dejavu_compile.compiler.quantize import Int8Embedding, Int8Linear

    params = dict(model.named_parameters())
    params.update((f"{name}.{b}", t) for name, m in model.named_modules() if isinstance(m, (Int8Linear, Int8Embedding))
                  for b, t in m.named_buffers(recurse=False))  # int8 weights: buffers (values and scales)
    element_size = next(iter(model.parameters())).element_size()
    total = sum(nbytes(p) for p in {p.data_ptr(): p for p in params.values()}.values())
    # An input embedding reads one row per token; unless the output head shares it, leave it out.
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    def stored(module):  # the weight a module reads: an Int8Embedding's and Int8Linear's are int8 buffers
        return getattr(module, "weight", None) if hasattr(module, "weight") else getattr(module, "qweight", None)

    embed_weight = stored(embed)
    if isinstance(embed_weight, torch.Tensor) and stored(head) is not embed_weight:
        total -= nbytes(embed_weight) + (nbytes(embed.scales) if hasattr(embed, "scales") else 0)
    def ref_bytes(ref) -> float:  # a fused weight (gate_up_proj, c_attn): only the rows this role owns
        p = params[ref.name]
        if ref.rows is None:
            return nbytes(p)  # an int8 weight's values (its scales are read whole either way)
        return nbytes(p) * (ref.rows[1] - ref.rows[0]) / p.shape[0 if ref.layout == "out_in" else 1]

    saved = 0.0
    for block in matched_blocks(model):
        entry = plan.entries.get((block.layer, block.kind))
        if entry is None or entry.dense:
            continue
        down_copy = False  # the kept down rows read from the plan's bf16 copy
        if block.kind == "mlp" and block.up.int8:  # its own int8 gate/up read whole, the kept down rows
            sparse_refs = [block.down]
        elif block.kind == "mlp" and entry.values == "predictor" and block.gated:
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
        own_int8 = block.kind == "mlp" and block.up.int8  # no predictor read: its own gate/up, counted whole
        saved += sparse * (1.0 - kept) - (0 if own_int8 else entry.read_bytes(element_size))
    k = plan.head_candidates
    if isinstance(getattr(head, "weight", None), torch.Tensor) and 0 < k < head.weight.shape[0]:  # a float head
        rows, d = head.weight.shape
        saved += nbytes(head.weight) * (1.0 - k / rows) - rows * (d + 4)  # int8 rows and an fp32 scale each
    return total / (total - saved)
