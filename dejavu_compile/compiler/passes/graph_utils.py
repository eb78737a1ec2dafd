"""Small helpers over Dynamo's torch-level FX graphs: parameter names, linear calls, op classes.

Dynamo (with ``inline_inbuilt_nn_modules``) hands parameters to the backend as placeholders whose
``_dynamo_source`` spells the attribute path; ``_C._nn.linear`` and GPT-2's ``addmm`` are the two
ways a projection shows up.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F

LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
# scaled_dot_product_attention as traced, its arguments in order, and their defaults
SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arguments(node: fx.Node) -> dict | None:
    """The arguments of an SDPA call by name (positional or keywords, defaults filled in), or None
    for another node."""
    if node.op != "call_function" or node.target not in SDPA:
        return None
    args = dict(SDPA_DEFAULTS)
    args.update(zip(SDPA_ARGS, node.args))
    args.update(node.kwargs)
    return args


# Ops that keep every element independent of the others (so a neuron's value depends on that
# neuron's pre-activations only). Used for the region between up/gate and down projections.
ELEMENTWISE_FUNCTIONS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.tanh, torch.sigmoid,
    torch.erf, torch.exp, torch.relu, torch.square, torch.sqrt, torch.rsqrt, torch.abs,
    F.silu, F.gelu, F.relu, F.relu6, F.leaky_relu, F.mish, F.hardswish, F.elu, F.softplus,
    torch._C._nn.gelu, torch.nn.functional.dropout, torch.clamp, torch.clip,
}
ELEMENTWISE_METHODS = {
    "mul", "add", "sub", "div", "neg", "pow", "tanh", "sigmoid", "relu", "square", "exp",
    "to", "float", "half", "bfloat16", "type_as", "contiguous", "clone", "abs", "clamp",
}
# Ops that only move or relabel elements: allowed on the paths between projections and attention.
SHAPE_FUNCTIONS = {operator.getitem, torch.transpose, torch.reshape, torch.flatten, torch.unsqueeze,
                   torch.squeeze, torch.permute, torch.split, torch.chunk, torch.narrow}
SHAPE_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "unsqueeze", "squeeze",
                 "flatten", "split", "chunk", "expand", "to", "float", "type_as", "narrow", "unflatten",
                 "view_as", "reshape_as", "clone"}
MUTATING_METHODS = {"index_copy_", "copy_", "index_put_", "scatter_", "add_"}


def is_op(node: fx.Node, functions=(), methods=()) -> bool:
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def is_elementwise(node: fx.Node) -> bool:
    if node.target is torch.nn.functional.dropout:
        return not _dropout_training(node)
    if node.op == "call_method" and node.target == "to":
        # .to(dtype) is elementwise; .to(device) too, but a device move inside a block is not ours.
        return not any(isinstance(a, (str, torch.device)) for a in node.args[1:]) and "device" not in node.kwargs
    return is_op(node, ELEMENTWISE_FUNCTIONS, ELEMENTWISE_METHODS)


def is_shape_op(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is torch.nn.functional.dropout:
        return not _dropout_training(node)
    return is_op(node, SHAPE_FUNCTIONS, SHAPE_METHODS)


def _dropout_training(node: fx.Node) -> bool:
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    return bool(training) and p != 0


def example_value(node) -> object:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def shape_of(node) -> tuple[int, ...] | None:
    value = example_value(node)
    if isinstance(value, torch.Tensor):
        return tuple(concrete_int(s) for s in value.shape)
    return None


def concrete_int(value) -> int:
    """An int for a (possibly symbolic) size, using the hint Dynamo recorded for the example input."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is not None:
            return int(hint)
    if isinstance(value, fx.Node):
        return concrete_int(example_value(value))
    return int(value)


def is_scalar_value(value) -> bool:
    return isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def concrete_scalar(value):
    """A Python number for a (possibly symbolic) scalar, from the hint of the example input."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"symbolic value {value} has no hint")
        return hint
    return value


# ---------------------------------------------------------------------------------------------
# Parameter names


_CONTAINERS = ("_modules", "_parameters", "_buffers")


def _source_path(source) -> str | None:
    """``model.layers.0.mlp.up_proj.weight`` from Dynamo's chain of attribute/dict-item sources."""
    parts: list[str] = []
    while source is not None:
        base = getattr(source, "base", None)
        index, member = getattr(source, "index", None), getattr(source, "member", None)
        if index is not None and getattr(base, "member", None) in _CONTAINERS:
            parts.append(str(index))
        elif isinstance(member, str) and not member.startswith("_"):
            parts.append(member)
        source = base
    return ".".join(reversed(parts)) or None


_PLACEHOLDER_NAME = re.compile(r"^l_(?:self|args_\d+)_(.*)_$", re.IGNORECASE)


def param_name(node: fx.Node) -> str | None:
    """The attribute path of a parameter or buffer placeholder (``model.layers.0.mlp.up_proj.weight``)."""
    if node.op == "get_attr":
        return str(node.target)
    if node.op != "placeholder":
        return None
    value = example_value(node)
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
    if source is not None:
        kinds = set()
        walk = source
        while walk is not None:
            kinds.add(getattr(walk, "member", None))
            walk = getattr(walk, "base", None)
        if "_parameters" in kinds or "_buffers" in kinds or isinstance(value, torch.nn.Parameter):
            return _source_path(source)
        return None
    match = _PLACEHOLDER_NAME.match(str(node.target))
    if match and "_parameters_" in match.group(1):
        body = match.group(1).removeprefix("modules_")
        return re.sub(r"_(?:modules|parameters|buffers)_", ".", body)
    return None


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to: the first integer component of its path that
    names a container of modules (``layers.3.mlp.up.weight``), not a module itself (``4.weight``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and len(parts) - i >= 3:
            return int(part)
    return None


def module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def common_module(names: list[str]) -> str:
    split = [module_of(n).split(".") for n in names]
    prefix = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return ".".join(prefix)


# ---------------------------------------------------------------------------------------------
# Projections


@dataclass
class LinearCall:
    """One projection ``out = x @ W^T + b`` however it was traced."""

    call: fx.Node  # the linear/addmm node
    out: fx.Node  # the node carrying the full-shaped output (after addmm's view back)
    x: fx.Node  # the input, seen through the flattening view addmm needs
    weight: fx.Node
    bias: fx.Node | None
    layout: str  # "out_in" | "in_out"
    weight_name: str
    bias_name: str | None
    # quantize_weights' int8 projections (dejavu::cpu_q8_linear): weight is the int8 (out, in) values,
    # scales their per-group fp32 scales; None for float weights
    scales: fx.Node | None = None

    @property
    def out_features(self) -> int:
        shape = shape_of(self.weight)
        return shape[0] if self.layout == "out_in" else shape[1]

    @property
    def in_features(self) -> int:
        shape = shape_of(self.weight)
        return shape[1] if self.layout == "out_in" else shape[0]


def _weight_param(node) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    return param_name(node)


def _see_through_flatten(node: fx.Node) -> fx.Node:
    while is_op(node, {torch.reshape}, {"view", "reshape"}) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def int8_projection_ops() -> tuple:
    """``dejavu::cpu_q8_linear`` as a graph may call it (the packet or its overload); () before the
    C++ ops load."""
    op = getattr(torch.ops.dejavu, "cpu_q8_linear", None) if hasattr(torch.ops, "dejavu") else None
    return (op, op.default) if op is not None else ()


def _int8_linear(node: fx.Node) -> LinearCall | None:
    """``cpu_q8_linear(x, q, scales, b)``: quantize_weights' int8 projection, (out, in) like nn.Linear."""
    x, q, scales = (list(node.args) + [None] * 3)[:3]
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("b")
    qname, sname = _weight_param(q), _weight_param(scales)
    if qname is None or sname is None or not isinstance(x, fx.Node):
        return None
    bname = _weight_param(bias) if isinstance(bias, fx.Node) else None
    if isinstance(bias, fx.Node) and bname is None:
        return None
    return LinearCall(node, node, x, q, bias, "out_in", qname, bname, scales=scales)


def as_linear(node: fx.Node, int8: bool = False) -> LinearCall | None:
    """Recognise ``linear(x, W, b)`` and ``addmm(b, x.view(-1, in), W).view(...)``; with ``int8``,
    also quantize_weights' ``cpu_q8_linear(x, q, scales, b)`` (a LinearCall with ``scales``)."""
    if node.op != "call_function":
        return None
    if int8 and node.target in int8_projection_ops():
        return _int8_linear(node)
    if node.target in LINEAR_TARGETS:
        x = node.args[0]
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        wname = _weight_param(weight)
        if wname is None or not isinstance(x, fx.Node):
            return None
        bname = _weight_param(bias) if isinstance(bias, fx.Node) else None
        if isinstance(bias, fx.Node) and bname is None:
            return None
        return LinearCall(node, node, x, weight, bias, "out_in", wname, bname)
    if node.target in (torch.matmul, operator.matmul) and len(node.args) == 2:
        return _matmul_linear(node)
    if node.target is torch.addmm and len(node.args) >= 3 and not node.kwargs:
        bias, x2d, weight = node.args[:3]
        wname, bname = _weight_param(weight), _weight_param(bias)
        if wname is None or bname is None or not isinstance(x2d, fx.Node):
            return None
        out = node
        users = list(node.users)
        if len(users) == 1 and is_op(users[0], {torch.reshape}, {"view", "reshape"}):
            out = users[0]
        return LinearCall(node, out, _see_through_flatten(x2d), weight, bias, "in_out", wname, bname)
    return None


def _matmul_linear(node: fx.Node) -> LinearCall | None:
    """``x @ W.T`` (+ bias) as custom Linear classes (Falcon's) write it."""
    x, w = node.args
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        return None
    layout = "in_out"
    if is_op(w, {torch.t}, {"t"}) or (is_op(w, {torch.transpose}, {"transpose"}) and
                                      {d % 2 for d in w.args[1:3]} == {0, 1}):
        w, layout = w.args[0], "out_in"
    elif w.op == "call_function" and w.target is getattr and w.args[1] in ("T", "mT"):
        w, layout = w.args[0], "out_in"
    wname = _weight_param(w)
    if wname is None or len(shape_of(w) or ()) != 2:
        return None
    out, bias, bname = node, None, None
    users = list(node.users)
    if len(users) == 1 and is_op(users[0], {operator.add, torch.add}, {"add"}) and len(users[0].args) == 2:
        other = users[0].args[1] if users[0].args[0] is node else users[0].args[0]
        if _weight_param(other) is not None and len(shape_of(other) or ()) == 1:
            out, bias, bname = users[0], other, _weight_param(other)
    return LinearCall(node, out, x, w, bias, layout, wname, bname)


def find_linears(gm: fx.GraphModule, int8: bool = False) -> dict[fx.Node, LinearCall]:
    """All projections of the graph, keyed by their output node; quantize_weights' int8 ones only
    with ``int8`` (a pass that reads a projection's weight as floats must not see them)."""
    found = {}
    for node in gm.graph.nodes:
        lin = as_linear(node, int8)
        if lin is not None:
            found[lin.out] = lin
    return found


# ---------------------------------------------------------------------------------------------
# Graph analysis


def to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    """Data-flow graph of ``gm``; an in-place cache write also feeds the cache tensor itself and
    every later read of it (so a StaticCache read depends on the projection written into it)."""
    graph = nx.DiGraph()
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        graph.add_node(node)
        for arg in node.all_input_nodes:
            graph.add_edge(arg, node)
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in MUTATING_METHODS and node.args and \
                isinstance(node.args[0], fx.Node):
            graph.add_edge(node, node.args[0])
            for reader in node.args[0].users:
                if order[reader] > order[node] and reader is not node:
                    graph.add_edge(node, reader)
    return graph


def evaluate(nodes: list[fx.Node], env: dict[fx.Node, object]) -> dict[fx.Node, object]:
    """Run ``nodes`` (in graph order) on concrete values; inputs not in ``env`` must be sizes."""

    def load(arg):
        if isinstance(arg, fx.Node):
            if arg in env:
                return env[arg]
            value = example_value(arg)
            if is_scalar_value(value):
                return concrete_scalar(value)
            raise KeyError(f"no value for {arg.name}")
        if isinstance(arg, (list, tuple)):
            return type(arg)(load(a) for a in arg)
        if isinstance(arg, dict):
            return {k: load(v) for k, v in arg.items()}
        if isinstance(arg, torch.SymInt):
            return concrete_int(arg)
        return arg

    for node in nodes:
        args, kwargs = load(node.args), load(node.kwargs)
        if node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        elif node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            raise ValueError(f"cannot evaluate {node.op} {node.name}")
    return env


def location(node: fx.Node) -> str:
    """A readable place for reports: the innermost module that produced ``node``."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        path = re.sub(r"^L\['(?:self|args)'\](?:\[0\])?\.?", "", str(path))
        path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
        return path.strip(".") or node.name
    return node.name
