"""The package's shape: no import cycle between modules, classes and modules small enough to read.

Read from the source with `ast`, nothing imported. An import counts when it runs as the module
loads (module level, outside `if TYPE_CHECKING:`); a function-level import is a deliberate late one.
Importing `a.b.c` also loads `a` and `a.b`, but when the importer lives inside `a.b` those ran before
it did, so that is no cycle. Generated protobuf modules are left out of the size limits.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tpudist"
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


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


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        statements = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                statements += node.body + node.orelse
            elif isinstance(node, ast.Try):
                statements += node.body
            else:
                statements.append(node)
        edges = set()
        for node in statements:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
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


def test_no_module_level_import_cycle_inside_tpudist():
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
