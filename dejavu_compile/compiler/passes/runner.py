"""Runs the backend's graph passes in order, each a named step over an FX GraphModule.

A pass is any object with a ``name`` and ``__call__(gm, ctx) -> gm``; it records what it did in
``ctx.report.pass_counts[name]`` and may end the run early with :meth:`PassContext.stop` (the
graph then goes to the inner compiler as it is). The runner lints and recompiles the graph after
each pass, so the next one (and a debugger) sees valid code.

Debugging: ``DEJAVU_DEBUG_GRAPHS=1`` in the environment, or the logger ``dejavu_compile.passes``
at DEBUG, logs each graph before and after each pass.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dejavu_compile.compiler.passes.graph_build import placeholder_values

log = logging.getLogger("dejavu_compile.passes")
DEBUG_ENV = "DEJAVU_DEBUG_GRAPHS"


@dataclass
class PassContext:
    """What the passes share: the backend's inputs and options, its report, and what earlier passes
    computed (the match is on ``report.match``)."""

    example_inputs: list
    opts: dict
    report: Any  # backend.BackendReport
    stopped: bool = False
    cache: dict = field(default_factory=dict)  # values computed once per graph (placeholder values, block order)

    @property
    def match(self):
        return self.report.match

    @property
    def plan(self):
        return self.opts["plan"]

    def stop(self, dense_reason: str | None = None) -> None:
        """End the run: later passes are skipped; ``dense_reason`` says why the graph stays dense."""
        self.stopped = True
        if dense_reason is not None:
            self.report.dense_reason = dense_reason

    def count(self, pass_name: str, n: int) -> None:
        self.report.pass_counts[pass_name] = n

    def values(self, gm: fx.GraphModule) -> dict:
        """The example value of each of the graph's original placeholders (taken before passes add any)."""
        if "values" not in self.cache:
            self.cache["values"] = placeholder_values(gm, self.example_inputs)
        return self.cache["values"]

    def ordered_blocks(self, gm: fx.GraphModule) -> list:
        """The matched blocks in graph order of their inputs (what lookahead reads one block back in),
        taken before any rewrite."""
        if "ordered" not in self.cache:
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            self.cache["ordered"] = sorted(self.match.blocks, key=lambda b: order.get(b.nodes.input, -1))
        return self.cache["ordered"]


def debug_enabled() -> bool:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        if not log.isEnabledFor(logging.DEBUG):  # the variable alone is enough to see the graphs
            log.setLevel(logging.DEBUG)
            if not log.handlers:
                log.addHandler(logging.StreamHandler(sys.stderr))
        return True
    return log.isEnabledFor(logging.DEBUG)


def run_passes(gm: fx.GraphModule, passes, ctx: PassContext) -> fx.GraphModule:
    """Apply ``passes`` in order until one stops the run. Exceptions propagate (with the failing
    pass's name on ``ctx.report.failed_pass``): the backend decides between dense and raising."""
    debug = debug_enabled()
    graph_id = ctx.report.graph_id
    for graph_pass in passes:
        if ctx.stopped:
            break
        name = graph_pass.name
        if debug:
            log.debug("dejavu graph %s before pass %s:\n%s", graph_id, name, _readable(gm))
        ctx.report.failed_pass = name
        gm = graph_pass(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        ctx.report.failed_pass = None
        if debug:
            log.debug("dejavu graph %s after pass %s (count %s%s):\n%s", graph_id, name,
                      ctx.report.pass_counts.get(name), ", stops here" if ctx.stopped else "", _readable(gm))
    return gm


def _readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False)


def dejavu_op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that call a ``torch.ops.dejavu.*`` op."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "dejavu"]
