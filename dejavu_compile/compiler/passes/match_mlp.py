"""MLP rule: ``down(f(gate(x), up(x)))`` or ``down(f(up(x)))`` where ``f`` is element-wise.

Rather than spelling out each activation's op sequence (GPT-2 traces GELU as tanh/pow arithmetic,
Gemma as ``gelu(approximate="tanh")``), the rule collects the element-wise region between the
projections and checks it numerically, in float64, against ``act(g) * u`` or ``act(u)`` for each
known activation. A region that matches none stays dense and is reported.
"""
from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from dejavu_compile import activations
from dejavu_compile.compiler.blocks import MLPBlock, MLPNodes
from dejavu_compile.compiler.passes.graph_utils import (
    LinearCall,
    common_module,
    evaluate,
    example_value,
    is_elementwise,
    is_op,
    is_scalar_value,
    layer_index,
    location,
    shape_of,
)

# The built-in rule recognises every activation of the table (numerically, whatever the traced form).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {a.name: a.fn for a in activations.BUILTIN}

_CASTS = {"to", "float", "half", "bfloat16", "type_as"}
_MLP_WORDS = ("mlp", "ffn", "feed_forward", "feedforward", "fc")


def _leaf_rows(node: fx.Node, linears: dict[fx.Node, LinearCall]):
    """(linear, rows) when ``node`` is a projection output or a slice of one along its last dim."""
    if node in linears:
        return linears[node], None
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    base, index = node.args
    if base in linears and isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis \
            and isinstance(index[1], slice) and index[1].step in (None, 1):
        lin = linears[base]
        start, stop, _ = index[1].indices(lin.out_features)
        return lin, (start, stop)
    if isinstance(base, fx.Node) and is_op(base, {torch.chunk, torch.split}, {"chunk", "split"}) \
            and base.args[0] in linears and isinstance(index, int):
        lin = linears[base.args[0]]
        dim = base.kwargs.get("dim", base.args[2] if len(base.args) > 2 else 0)
        ndim = len(shape_of(lin.out))
        if dim not in (-1, ndim - 1):
            return None
        size = lin.out_features
        spec = base.args[1]
        if base.target in ("chunk", torch.chunk):
            step = math.ceil(size / spec)
            bounds = [(i, min(i + step, size)) for i in range(0, size, step)]
        elif isinstance(spec, int):
            bounds = [(i, min(i + spec, size)) for i in range(0, size, spec)]
        else:
            edges = [0, *itertools.accumulate(int(v) for v in spec)]
            bounds = list(zip(edges[:-1], edges[1:]))
        return lin, bounds[index]
    return None


def elementwise_region(hidden: fx.Node, linears: dict[fx.Node, LinearCall]):
    """Walk back from the down projection's input through element-wise ops.

    Returns (region nodes in graph order, leaves {node: (linear, rows)}, blocker) where blocker is
    the first non-element-wise node met (None when the region is closed by projections and constants).
    """
    region, leaves, blocker = [], {}, None
    stack, seen = [hidden], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = _leaf_rows(node, linears)
        if leaf is not None:
            leaves[node] = leaf
        elif is_scalar_value(example_value(node)):
            continue  # a (symbolic) constant such as GPT-2's sqrt(2 / pi) under dynamic shapes
        elif is_elementwise(node):
            region.append(node)
            stack.extend(node.all_input_nodes)
        elif blocker is None:
            blocker = node
    order = {n: i for i, n in enumerate(hidden.graph.nodes)}
    region.sort(key=order.__getitem__)
    return region, leaves, blocker


def _flatten_chain(lin: LinearCall) -> set[fx.Node]:
    """The views between a projection's input and the call (GPT-2's ``x.view(-1, d)`` before addmm)."""
    chain = set()
    node = lin.call.args[1] if lin.layout == "in_out" else lin.call.args[0]
    while node is not lin.x and isinstance(node, fx.Node):
        chain.add(node)
        node = node.args[0]
    return chain


def _probe(region: list[fx.Node], inputs: dict[fx.Node, torch.Tensor]) -> torch.Tensor:
    """Evaluate the region in float64, with dtype casts as identities."""
    env = dict(inputs)
    for node in region:
        if node.op == "call_method" and node.target in _CASTS:
            env[node] = env[node.args[0]]
        else:
            evaluate([node], env)
    return env[region[-1]] if region else env[next(iter(inputs))]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-7, atol=1e-9))


class MLPRule:
    """Element-wise MLPs, gated or plain, with any activation from ``activations``."""

    kind = "mlp"

    def __init__(self, name: str = "mlp", activations: dict[str, Callable] | None = None):
        self.name = name
        self.activations = dict(ACTIVATIONS if activations is None else activations)

    def __repr__(self):
        return f"MLPRule({self.name!r}, activations={sorted(self.activations)})"

    def match(self, ctx):
        for down in list(ctx.linears.values()):
            if ctx.is_claimed(down.call):
                continue
            region, leaves, blocker = elementwise_region(down.x, ctx.linears)
            if not leaves:
                continue
            where = location(down.call)
            if blocker is not None:
                # Not closed by projections: an MLP only if the module path says so, then report.
                if any(w in where.lower().split(".")[-2:] or w in where.lower() for w in _MLP_WORDS) \
                        and down.x not in ctx.linears:
                    ctx.fallback(down.call, where, f"MLP-like region reaches non-element-wise op "
                                 f"'{getattr(blocker.target, '__name__', blocker.target)}' ({blocker.name})")
                continue
            block = self._classify(ctx, down, region, leaves, where)
            if block is not None:
                ctx.claim(down.call, block, region + [lin.call for lin, _ in leaves.values()])
                yield block

    def _classify(self, ctx, down: LinearCall, region, leaves, where):
        """The MLP block closed by ``down``, or None with the reason recorded as a fallback."""
        reason = _structure_reason(ctx, down, region, leaves)
        if reason is not None:
            return ctx.fallback(down.call, where, reason)
        try:
            found = self._identify_activation(region, list(leaves))
        except Exception as exc:  # an op the probe cannot run: not understood, so dense
            return ctx.fallback(down.call, where, f"cannot evaluate the activation region ({exc})")
        if found is None:
            form = "act(up)" if len(leaves) == 1 else "act(gate) * up"
            return ctx.fallback(down.call, where, f"element-wise region is not {form} for any known "
                                f"activation ({', '.join(self.activations)})")
        activation, gate, up_node = found
        return self._block(ctx, down, leaves, activation, gate, up_node)

    def _identify_activation(self, region, leaf_nodes):
        """Which known activation the region computes, found by running it on probe values:
        act(up) for one leaf, act(gate) * up for two (either order). Returns (activation, gate leaf
        or None, up leaf), or None when no activation fits."""
        generator = torch.Generator().manual_seed(0)  # its own: the user's global RNG stays untouched
        n = 4096
        probes = [torch.cat([torch.linspace(-8, 8, n // 2, dtype=torch.float64),
                             torch.randn(n // 2, dtype=torch.float64, generator=generator) * 3]) for _ in leaf_nodes]
        probes[-1] = probes[-1][torch.randperm(n, generator=generator)]
        value = _probe(region, dict(zip(leaf_nodes, probes)))
        if len(leaf_nodes) == 1:
            for name, act in self.activations.items():
                if _close(value, act(probes[0])):
                    return name, None, leaf_nodes[0]
            return None
        for name, act in self.activations.items():
            for g, u in ((0, 1), (1, 0)):
                if _close(value, act(probes[g]) * probes[u]):
                    return name, leaf_nodes[g], leaf_nodes[u]
        return None

    def _block(self, ctx, down: LinearCall, leaves, activation: str, gate, up_node) -> MLPBlock:
        up_lin, up_rows = leaves[up_node]
        gate_ref = ctx.weight_ref(*leaves[gate]) if gate is not None else None
        intermediate = (up_rows[1] - up_rows[0]) if up_rows else up_lin.out_features
        x = ctx.see_through(up_lin.x)
        x_shape = shape_of(x)
        # (batch, tokens, d); a flattened (rows, d) input gets its split from the graph's attention.
        batch, tokens = (x_shape[0], math.prod(x_shape[1:-1])) if len(x_shape) >= 3 else (x_shape[0], 0)
        names = [up_lin.weight_name, down.weight_name] + ([leaves[gate][0].weight_name] if gate else [])
        layer = layer_index(down.weight_name)
        return MLPBlock(
            layer=-1 if layer is None else layer,
            rule=self.name,
            gated=gate is not None,
            activation=activation,
            up=ctx.weight_ref(up_lin, up_rows),
            down=ctx.weight_ref(down, None),
            gate=gate_ref,
            hidden_size=down.out_features,
            intermediate_size=intermediate,
            decode=tokens == 1,
            tokens=tokens,
            batch=batch,
            module=common_module(names),
            nodes=MLPNodes(input=x, hidden=down.x, output=down.out, down=down.call, up=up_lin.call,
                           gate=leaves[gate][0].call if gate else None),
        )


def _structure_reason(ctx, down: LinearCall, region, leaves) -> str | None:
    """Why the region feeding ``down`` is not one MLP's: too many projections, projections of
    different inputs, or an intermediate value used outside the block."""
    if len(leaves) > 2:
        return f"{len(leaves)} projections feed the down projection"
    if len({ctx.see_through(lin.x) for lin, _ in leaves.values()}) != 1:
        return "gate and up projections read different inputs"
    inside = set(region) | {down.call, *leaves} | _flatten_chain(down)
    for node in [*region, *leaves]:
        outside = [u for u in node.users if u not in inside]
        if outside:
            return f"intermediate {node.name} is also used by {outside[0].name} outside the block"
    return None
