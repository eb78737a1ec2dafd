"""Pass ``auto_plan``: option ``mlp_density`` without a plan builds the training-free int8 plan from
the weights the graph computes with.

Each matched gated MLP of float weights gets the registry's training-free predictor (its own gate/up
rows in int8; nothing is fitted, so no data is needed) keeping ``mlp_density`` of its neurons, rounded
as ``calibrate``'s uniform allocation rounds it, and takes the kept neurons' values from the predictor where the block
has no gate/up biases: the plan ``calibrate(model, tokenizer, mlp_density=...)`` makes by default on
CPU, output head screen and bf16 down rows included. A gated MLP of quantize_weights' int8
projections gets an entry with k only: its own int8 gate/up choose the kept neurons (``sparse_mlp``).
Plain MLPs and attention stay dense. Entries
are cached per block weights (and their version), so a model's prefill, decode and recompiled
graphs share one int8 copy.

Without a plan and without ``mlp_density`` the backend compiles dense; it says once how to turn
sparsity on.
"""
from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dejavu_compile.compiler.blocks import MLPBlock, WeightRef
from dejavu_compile.compiler.passes.head_screen import output_head
from dejavu_compile.plan import predictors, rules
from dejavu_compile.plan.sparsity_plan import DEFAULT_DOWN_ROWS, PlanEntry, SparsityPlan, default_head_candidates

log = logging.getLogger("dejavu_compile")

PLAIN_MLP_REASON = "a training-free plan needs gated MLPs; calibrate() trains predictors for plain MLPs: dense"
SPARSITY_HINT = ("dejavu: no sparsity plan, so the matched blocks compile dense. Turn sparsity on with "
                 "options={'mlp_density': 0.6} (a training-free int8 plan built from the weights) or "
                 "options={'plan': dejavu_compile.calibrate(model, tokenizer)}")
_hint_logged = False

# gate weight tensor -> {(weights' state, density): PlanEntry}; weak, so a freed model frees its entries
_entries: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _rows(ref: WeightRef, tensor: torch.Tensor) -> torch.Tensor:
    return rules.weight_rows(tensor, ref.layout, ref.rows)


def _state(tensor: torch.Tensor) -> tuple:
    return id(tensor), tensor._version, tensor.data_ptr(), tensor.dtype


def gated_entry(block: MLPBlock, values: dict, density: float) -> PlanEntry:
    """The int8 entry of one gated MLP block at ``density`` (dense where the kept rows plus the
    predictor would read as many bytes as the dense block, as calibrate decides)."""
    gate, up = values[block.gate.node], values[block.up.node]
    key = (_state(gate), _state(up), block.gate.rows, block.up.rows, block.gate.layout, block.activation,
           block.gate.bias_node is None and block.up.bias_node is None, float(density))
    cached = _entries.setdefault(gate, {})
    if key in cached:
        return cached[key]
    total = block.intermediate_size
    k = rules.uniform_k(total, density, rules.k_multiple(total))
    if block.gate.int8:  # quantize_weights' int8 gate/up choose and value the kept neurons themselves
        entry = PlanEntry(block.layer, "mlp", k, total, activation=block.activation)
        cached[key] = entry
        return entry
    # the int8 rows hold no biases: a block with gate/up biases computes its kept neurons exactly
    values_from = "predictor" if block.gate.bias_node is None and block.up.bias_node is None else "exact"
    kind = predictors.training_free_kind()
    tensors = kind.from_weights(_rows(block.gate, gate), _rows(block.up, up))
    share = rules.predictor_share(kind, tensors, True, block.hidden_size, total, gate.element_size())
    if not rules.sparse_pays(k, total, values_from, share):
        entry = PlanEntry(block.layer, "mlp", total, total)
    else:
        entry = PlanEntry(block.layer, "mlp", k, total, kind.name, tensors, block.activation, lookahead=False,
                          values=values_from)
    cached[key] = entry
    return entry


def training_free_plan(match, values: dict, density: float, head_rows: int | None = None) -> SparsityPlan:
    """The plan for the blocks of one graph: int8 entries for gated MLPs, dense ones for plain MLPs
    (reported) and attention, and calibrate()'s default screen of an output head of ``head_rows``
    rows. Blocks without a layer index (graph breaks) get none."""
    entries = {}
    for block in match.blocks:
        if block.layer < 0:
            continue
        if isinstance(block, MLPBlock):
            if block.gated:
                entries[(block.layer, "mlp")] = gated_entry(block, values, density)
            else:
                match.fallbacks.append((block.module, PLAIN_MLP_REASON))
                entries[(block.layer, "mlp")] = PlanEntry(block.layer, "mlp", block.intermediate_size,
                                                          block.intermediate_size)
        else:
            entries[(block.layer, "attention")] = PlanEntry(block.layer, "attention", block.num_heads, block.num_heads)
    kind = predictors.training_free_kind()
    settings = {"method": f"training-free-{kind.option}", "predictor": kind.option, "values": "auto",
                "allocation": "uniform", "target_mlp_density": density,
                "head_candidates": default_head_candidates(head_rows), "down_rows": DEFAULT_DOWN_ROWS}
    return SparsityPlan(entries, {}, settings)


class TrainingFreePlan:
    """With ``mlp_density`` and no plan: the training-free plan becomes the run's plan. With
    neither: logs once how to turn sparsity on. Counts the sparse MLP entries built."""

    name = "auto_plan"

    def __call__(self, gm, ctx):
        density = ctx.opts.get("mlp_density")
        if ctx.plan is not None or density is None:
            ctx.count(self.name, 0)
            if ctx.plan is None:
                _hint_once(ctx.match)
            return gm
        head = output_head(gm)
        plan = training_free_plan(ctx.match, ctx.values(gm), density, None if head is None else head.out_features)
        ctx.opts["plan"] = plan
        ctx.count(self.name, sum(1 for e in plan.entries.values() if e.kind == "mlp" and not e.dense))
        return gm


def _hint_once(match) -> None:
    global _hint_logged
    if _hint_logged or not match.mlp:
        return
    _hint_logged = True
    log.warning(SPARSITY_HINT)
