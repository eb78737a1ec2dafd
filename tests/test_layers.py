"""The package's import structure: no import cycles between modules, and subpackages import only
downwards (base <- kernels, assets <- plan <- compiler <- evaluation <- calibration <- experiments
<- cli, testing). Imports inside functions count: a lazy import hides a cycle, it does not remove it."""
import ast
import pathlib

import networkx as nx

import dejavu_compile

ROOT = pathlib.Path(dejavu_compile.__file__).parent
# Lower index = lower layer; a module may import its own layer and the ones below.
LAYERS = [
    {"errors", "activations", "cache"},
    {"kernels", "assets"},
    {"plan"},
    {"compiler"},
    {"evaluation"},
    {"calibration"},
    {"experiments"},
    {"cli", "testing", "__init__"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = ("dejavu_compile", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def _imports(path: pathlib.Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import submodule` or a name
    return {m for m in found if m.startswith("dejavu_compile")}


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path, name):
            while target not in modules and "." in target:  # `from pkg.mod import fn` -> pkg.mod
                target = target.rsplit(".", 1)[0]
            # a package's __init__ runs before its submodules: importing an ancestor is no cycle
            if target in modules and not name.startswith(target + ".") and target != name:
                graph.add_edge(name, target)
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    raise AssertionError(f"module {module} is in no layer of this test: add its subpackage to LAYERS")


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_imports_point_down_the_layers():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, b in import_graph().edges if _layer(b) > _layer(a)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_checks_can_fail():
    graph = import_graph()
    assert graph.number_of_edges() > 50  # the walk sees the package's imports
    graph.add_edge("dejavu_compile.kernels.native", "dejavu_compile.compiler.backend")
    assert _layer("dejavu_compile.compiler.backend") > _layer("dejavu_compile.kernels.native")
    graph.add_edge("dejavu_compile.compiler.backend", "dejavu_compile.kernels.native")
    graph.add_edge("dejavu_compile.kernels.native", "dejavu_compile.compiler.backend")
    assert list(nx.simple_cycles(graph))
