"""The package's shape: no import cycle between modules, classes and modules small enough to read.

Read from the source with `ast`, nothing imported. Every import counts, at module level or inside a
function (a late import hides a cycle, it does not remove one), except under `if TYPE_CHECKING:`.
Importing `a.b.c` also loads `a` and `a.b`, but when the importer lives inside `a.b` those ran before
it did, so that is no cycle. Generated protobuf modules are left out of the size limits.

The torch wing (`tpudist/compile/_torch/`) is three rooms on one floor, and serving above them: `lowering/` (capture, the op
registry and ops), `module/` (`tpudist.compile(module)`) and `train/` (the fused step, its state, `fit`);
the floor is the package's own modules (conversion, placement, packing, sync, layouts). The floor imports
no room, `lowering` neither sibling, and `module` and `train` nothing of each other; `serve/`
(generation, predict) stands on both and nothing imports it.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tpudist"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 200
TORCH = "tpudist.compile._torch"
ROOMS = ("lowering", "module", "train", "serve")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, pathlib.Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
            for a in node.names if f"{base}.{a.name}" in modules or base in modules}


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the module, at any depth, except those under `if TYPE_CHECKING:`."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            for target in _imported(module, node, modules):
                edges.add(target)
                parts = target.split(".")
                for i in range(1, len(parts)):  # the packages loaded on the way, unless they enclose us
                    ancestor = ".".join(parts[:i])
                    if ancestor in modules and module != ancestor and not module.startswith(ancestor + "."):
                        edges.add(ancestor)
        edges.discard(module)
        graph[module] = edges
    return graph


def test_no_import_cycle_inside_tpudist():
    graph = _import_graph()
    assert "tpudist.launch.supervisor" in graph and "tpudist.launch.attempt" in graph["tpudist.launch.supervisor"]
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [module, target]))
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_no_module_or_class_too_long_to_read_in_one_sitting():
    too_long = []
    for module, path in _modules().items():
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"module {module}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"class {module}.{node.name}: {node.end_lineno - node.lineno + 1} lines "
                                f"> {MAX_CLASS_LINES}")
    assert not too_long, "\n".join(too_long)


def test_nothing_below_the_package_imports_the_package_itself():
    # `import tpudist` inside tpudist would run the public façade from below it; import the module instead
    importers = sorted(module for module, edges in _import_graph().items() if "tpudist" in edges and module != "tpudist")
    assert not importers, f"import the defining module, not `tpudist`: {importers}"


def _room(module: str) -> str | None:
    """'floor', a room's name, or None outside the torch wing."""
    if module == TORCH or not module.startswith(TORCH + "."):
        return None
    part = module[len(TORCH) + 1:].split(".")[0]
    return part if part in ROOMS else "floor"


def test_torch_rooms_stand_side_by_side_on_one_floor():
    graph = _import_graph()
    assert {_room(m) for m in graph} >= {"floor", *ROOMS}, "the torch wing lost a room: update ROOMS"
    allowed = {"floor": {"floor"}, "lowering": {"floor", "lowering"}, "module": {"floor", "lowering", "module"},
               "train": {"floor", "lowering", "train"},
               "serve": {"floor", "lowering", "module", "train", "serve"}}
    crossings = [f"{module} ({_room(module)}) imports {target} ({_room(target)})"
                 for module, edges in sorted(graph.items()) if _room(module) not in (None,)
                 for target in sorted(edges) if _room(target) is not None and _room(target) not in allowed[_room(module)]]
    assert not crossings, "\n".join(crossings)


def test_jaxcompat_is_a_leaf():
    # the JAX version shims sit under everything; they import nothing of tpudist
    assert not _import_graph()["tpudist._jaxcompat"]
