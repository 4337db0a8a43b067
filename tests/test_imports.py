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
    assert "jaxdist.training.step" in graph and "jaxdist.reduce.gradients" in graph["jaxdist.training.step"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Optional extras: each is imported only where its feature is used, behind a one-line "install the
# extra" error (tests/test_trackers.py and test_tokenize.py check those lines).
EXTRAS = {"wandb", "mlflow", "pyarrow", "tensorboard"}


def test_every_module_of_the_package_imports():
    """A dependency missing from pyproject.toml fails here, naming the module (CI installs into a fresh venv)."""
    import importlib
    import pkgutil

    import jaxdist

    failed = {}
    names = [m.name for m in pkgutil.walk_packages(jaxdist.__path__, "jaxdist.")]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in EXTRAS:
                continue
            failed[name] = f"{type(e).__name__}: {e}"
        except Exception as e:  # an import that fails for any other reason is as broken
            failed[name] = f"{type(e).__name__}: {e}"
    assert len(names) > 40 and "jaxdist.train" in names and "jaxdist.checkpoint.restoring" in names
    assert not failed, "modules that do not import: " + "; ".join(f"{k} ({v})" for k, v in failed.items())


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists packages (configs/ is mapped in, which packages.find cannot do): none may be missing."""
    import tomllib

    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p) for p in PKG.rglob("__init__.py")}
    assert found - listed == set(), (
        f"packages missing from pyproject.toml's [tool.setuptools] packages: {found - listed}"
    )
    assert listed - found == {"jaxdist.configs"}
