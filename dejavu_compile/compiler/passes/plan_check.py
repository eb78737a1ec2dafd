"""Does a plan fit the blocks matched in a graph? (:class:`PlanMismatchError` when not.)"""
from __future__ import annotations

import logging

from dejavu_compile import activations
from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_utils import shape_of
from dejavu_compile.errors import PlanMismatchError

log = logging.getLogger("dejavu_compile")


def check_plan_against_blocks(plan, blocks) -> None:
    """Raise :class:`PlanMismatchError` when the plan's entries do not fit the matched blocks."""
    problems = []
    by_key = {(b.layer, b.kind): b for b in blocks}
    for (layer, kind), entry in plan.entries.items():
        block = by_key.get((layer, kind))
        if block is None:
            continue  # the graph may hold only part of the model (graph breaks): checked per graph
        mlp = isinstance(block, MLPBlock)
        total = block.intermediate_size if mlp else block.num_heads
        if entry.total != total:
            problems.append(f"layer {layer} {kind}: plan has {entry.total} {'neurons' if kind == 'mlp' else 'heads'},"
                            f" model has {total}")
        predictor = entry.predictor_kind
        if predictor is not None:
            width = block.hidden_size if mlp else (shape_of(block.nodes.input) or [None])[-1]
            reason = predictor.fits_block(entry.tensors, block.gated if mlp else None, width)
            if reason is None and not mlp and predictor.needs_gate:
                reason = f"predictor {entry.predictor!r} models a gated MLP, not attention heads"
            if reason is not None:
                problems.append(f"layer {layer} {kind}: {reason}")
            if mlp and not entry.dense:
                reason = _activation_mismatch(entry, block)
                if reason is not None:
                    problems.append(f"layer {layer} {kind}: {reason}")
            if entry.values == "predictor" and not entry.dense and not predictor.gives_values:
                problems.append(f"layer {layer} {kind}: values 'predictor' needs the int8 gate/up predictor (a kind "
                                f"that gives the neurons' values), the entry has {entry.predictor!r}")
    layers = {b.layer for b in blocks if b.layer >= 0}  # -1: a graph of one layer's frame (graph break)
    plan_layers = {layer for layer, _ in plan.entries}
    if layers and max(layers) >= plan.num_layers:
        problems.append(f"model has layer {max(layers)} but the plan covers {plan.num_layers} layers")
    if layers and not (layers & plan_layers):
        problems.append("no layer of the model has a plan entry")
    if problems:
        raise PlanMismatchError("sparsity plan does not fit this model: " + "; ".join(problems[:6]))


def _activation_mismatch(entry, block: MLPBlock) -> str | None:
    """Why the entry's activation cannot serve the block, or None. Only gate/up kinds compute with it
    (their scores, and the kept neurons' values with values "predictor"); a wrong one silently picks
    and weights the wrong neurons."""
    if not entry.predictor_kind.needs_gate:
        return None
    try:
        planned = activations.canonical(entry.activation)
    except ValueError:
        return f"plan activation {entry.activation!r} is unknown, the block's is {block.activation!r}"
    try:
        matched = activations.canonical(block.activation)
    except ValueError:  # a user rule's own activation: only its exact name fits
        matched = block.activation
    if planned != matched:
        return f"plan activation {entry.activation!r} but the block computes {block.activation!r}"
    return None
