"""Passes that decide whether a graph is made sparse at all; each stops the run (graph left dense)
with the reason on the report when it must not be."""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from dejavu_compile.compiler.passes.graph_utils import param_name, sdpa_arguments
from dejavu_compile.compiler.passes.plan_check import check_plan_against_blocks


def training_reason(gm: fx.GraphModule, example_inputs) -> str | None:
    """Why this graph must not be made sparse: it is traced for training or needs gradients."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and "dropout" in getattr(node.target, "__name__", ""):
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if training:
                return "the model is in training mode (dropout active)"
        sdpa = sdpa_arguments(node)
        if sdpa is not None:  # HF attention passes its dropout into SDPA in train mode
            dropout_p = sdpa["dropout_p"]
            if not isinstance(dropout_p, (int, float)) or dropout_p > 0:
                return f"the model is in training mode (attention dropout {dropout_p} in scaled_dot_product_attention)"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and value.requires_grad and param_name(node) is None:
            return f"input {node.name} requires grad"
    return None


def needs_gradients(example_inputs) -> bool:
    """Grad mode is on and an input (parameters included) requires grad: the backend's ops have no backward."""
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in example_inputs)


class TrainingGuard:
    """Training graphs and graphs that need gradients stay dense (the sparse ops have no backward),
    with a warning. Without a plan only the training mode is checked (the report still says so)."""

    name = "training_guard"

    def __call__(self, gm, ctx):
        reason = training_reason(gm, ctx.example_inputs)
        if reason is None and ctx.plan is not None and needs_gradients(ctx.example_inputs):
            reason = "gradients are enabled (sparse ops have no backward; use torch.no_grad())"
        ctx.count(self.name, int(reason is not None))
        if reason is not None:
            warnings.warn(f"dejavu: passing the graph through dense because {reason}", stacklevel=2)
            ctx.stop(reason)
        return gm


class PlanCheck:
    """The plan fits the matched blocks (else :class:`PlanMismatchError`, which reaches the user);
    no plan, or no block matched: the run ends here. A plan with sparse entries for blocks of int8
    projections (``quantize_weights``) that no sparse rewrite reaches (attention) warns. Counts the
    blocks with a sparse plan entry."""

    name = "plan_check"

    def __call__(self, gm, ctx):
        plan, match = ctx.plan, ctx.match
        if plan is None:  # matching only, for reports
            ctx.stop()
            return gm
        check_plan_against_blocks(plan, match.blocks)
        refused = sorted(key for key in match.int8_dense if _sparse_entry(plan, key) is not None)
        if refused:  # asked for sparsity where none can apply: say so, not only in the report
            warnings.warn(f"dejavu: the plan's sparse entries for {', '.join(f'layer {l} {k}' for l, k in refused)} "
                          "are not applied: these blocks hold int8 weights (quantize_weights), whose sparse path "
                          "covers gated MLPs only", stacklevel=2)
        if not match.blocks:
            ctx.stop("no MLP or attention block matched")
            return gm
        for block in match.blocks:
            if block.layer < 0:
                match.fallbacks.append((block.module, "the graph holds this block without its layer's path (a graph "
                                                      "break inside the model), so no plan entry applies: dense"))
        ctx.count(self.name, sum(1 for b in match.blocks if _sparse_entry(plan, b) is not None))
        return gm


class DecodeShapeGuard:
    """Only decode graphs (one token per sequence, at most ``max_batch`` sequences) are lowered to
    the sparse kernels; prefill and large batches stay dense."""

    name = "decode_shape"

    def __call__(self, gm, ctx):
        blocks = ctx.match.blocks
        tokens = {b.tokens for b in blocks}
        batch = max(b.batch for b in blocks)
        if tokens != {1}:
            ctx.stop(f"prefill-shaped graph ({max(tokens)} tokens per sequence): dense")
        elif batch > ctx.opts["max_batch"]:
            ctx.stop(f"batch {batch} > max_batch {ctx.opts['max_batch']}: dense")
        ctx.count(self.name, int(ctx.stopped))
        return gm


def _sparse_entry(plan, block):
    """The plan's sparse entry for a block (or a (layer, kind) key), None when dense or absent."""
    key = block if isinstance(block, tuple) else (block.layer, block.kind)
    entry = plan.entries.get(key)
    return entry if entry is not None and not entry.dense else None
