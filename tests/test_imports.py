"""No import cycle inside jaxdist/ (module-level or deferred imports alike): a cycle is a design knot."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "jaxdist"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from jaxdist.parallel import reduce` imports the submodule reduce
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name and t.startswith("jaxdist")}
        # a package's __init__ is imported with each of its modules; it is not a dependency edge here
        graph[name] = {e for e in edges if modules[e].name != "__init__.py"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_jaxdist_has_no_import_cycle():
    graph = import_graph()
    assert "jaxdist.step" in graph and "jaxdist.gradients" in graph["jaxdist.step"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
