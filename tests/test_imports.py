"""The import rules of jaxdist/ (module-level, deferred and TYPE_CHECKING imports alike): no cycle, and the
layering of docs/architecture.md (a package imports only from packages below it), and every module imports."""

import ast
import re
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


# The layering (docs/architecture.md#the-layering-rule): a module may import from its own package and from
# packages in earlier rows, never from its row or a later one. The commands (the modules at the top of
# jaxdist/ and the packages' __main__.py) import from everything and from no other command.
LAYERS = [
    ("errors",),
    ("config",),
    ("cluster",),
    ("distributed",),
    ("data",),
    ("parallel",),
    ("adapters",),
    ("models",),
    ("optim",),
    ("reduce",),
    ("objectives",),
    ("checkpoint",),
    ("hf",),
    ("planner",),
    ("observe",),
    ("training",),
    ("analysis", "inference"),
    ("evaluation",),
    ("__init__",),  # jaxdist/__init__.py: the public names (from modules that load no JAX; `run` when called)
    ("train", "bench", "plan", "convert", "generate", "eval", "plot", "__main__"),
]
RANK = {unit: row for row, units in enumerate(LAYERS) for unit in units}
RULE = "see docs/architecture.md#the-layering-rule"


def layer_of(module: str) -> str:
    """jaxdist.reduce.dgc -> reduce; jaxdist.train -> train; jaxdist.data.__main__ -> __main__ (a command)."""
    parts = module.split(".") + ["__init__"]
    return "__main__" if parts[-2] == "__main__" else parts[1]


def imported_modules(module: str, tree: ast.AST, is_package: bool = False):
    """(line, imported jaxdist module or name) for every import anywhere in the tree, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield from ((node.lineno, f"{base}.{a.name}") for a in node.names)


def layering_violations(module: str, source: str, filename: str, is_package: bool = False) -> list[str]:
    """`file:line: what imports what, and the rule it breaks`, for each import against LAYERS."""
    unit, out = layer_of(module), []
    assert unit in RANK, f"{filename}: jaxdist.{unit} is in no row of LAYERS (tests/test_imports.py); add it"
    for line, target in imported_modules(module, ast.parse(source, filename), is_package):
        if not target.startswith("jaxdist.") or target.split(".")[1] == unit and unit != "__main__":
            continue
        to = layer_of(target)
        if to not in RANK:
            out.append(f"{filename}:{line}: imports {target}, which is in no row of LAYERS; add its package")
        elif RANK[to] >= RANK[unit]:
            why = "a command imports no other command" if unit == to == "__main__" or RANK[to] == RANK[unit] else ""
            out.append(
                f"{filename}:{line}: {module} imports {target}: {unit} may import only packages below it"
                f" ({to} is {'beside' if RANK[to] == RANK[unit] else 'above'} it){'; ' + why if why else ''}; {RULE}"
            )
    return out


def test_layering_check_fails_on_an_upward_import():
    """The check itself: a planted upward import (deferred, inside a function) and one under TYPE_CHECKING fail,
    naming file and line; downward and same-package imports pass."""
    planted = "import typing\n\ndef f():\n    from jaxdist.observe import trackers\n"
    got = layering_violations("jaxdist.config.checks", planted, "jaxdist/config/checks.py")
    assert len(got) == 1 and got[0].startswith(
        "jaxdist/config/checks.py:4: jaxdist.config.checks imports jaxdist.observe"
    )
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxdist.training.step import Program\n"
    assert layering_violations("jaxdist.checkpoint.saving", typed, "saving.py")[0].startswith("saving.py:3: ")
    peers = "from jaxdist.inference import decode\n"  # same row: neither imports the other
    assert "beside" in layering_violations("jaxdist.analysis.bench", peers, "bench.py")[0]
    assert layering_violations("jaxdist.generate", "from jaxdist import convert\n", "generate.py")  # command -> command
    fine = "from jaxdist.errors import JaxdistError\nfrom jaxdist.config import Config\nfrom . import schema\n"
    assert layering_violations("jaxdist.config.checks", fine, "checks.py") == []
    assert layering_violations("jaxdist.train", "from jaxdist.training import loop\n", "train.py") == []


def test_jaxdist_follows_the_layering():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        found += layering_violations(module_name(path), path.read_text(), rel, path.name == "__init__.py")
    assert not found, "imports against the layering:\n" + "\n".join(found)
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
    commands = set(LAYERS[-1]) - {"__main__"}
    assert set(top) == commands | {"errors"}, (
        f"modules at the top of jaxdist/ that are no command: {set(top) - commands - {'errors'}}"
    )


def unmarked_deferred_imports(source: str, filename: str) -> list[str]:
    """`file:line` of each import inside a function that no `# deferred: <why>` comment explains: one on the
    line above a group of adjacent imports, or on one of the group's lines, covers the group. An import belongs
    at the top of its module unless deferring it does something."""
    lines = source.splitlines()
    out = []
    for func in ast.walk(ast.parse(source, filename)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        bodies = [getattr(n, f, None) for n in ast.walk(func) for f in ("body", "orelse", "finalbody")]
        for body in (b for b in bodies if isinstance(b, list)):
            group: list[ast.stmt] = []
            for st in [*body, None]:
                if isinstance(st, ast.Import | ast.ImportFrom):
                    group.append(st)
                    continue
                if group and not any(
                    "# deferred: " in line for line in lines[group[0].lineno - 2 : group[-1].end_lineno]
                ):
                    out += [f"{filename}:{n.lineno}: {lines[n.lineno - 1].strip()}" for n in group]
                group = []
    return sorted(set(out))


def test_deferred_import_check_fails_on_an_unmarked_one():
    """A comment above a group of adjacent imports covers the group; an import after other code needs its own."""
    source = (
        "import os\n\ndef f():\n    # deferred: loads jax when called\n    import jax\n\n    from jaxdist import config\n"
        "    x = 1\n    from jaxdist import errors\n"
    )
    assert unmarked_deferred_imports(source, "m.py") == ["m.py:9: from jaxdist import errors"]
    marked = source.replace("from jaxdist import errors", "from jaxdist import errors  # deferred: a reason")
    assert unmarked_deferred_imports(marked, "m.py") == []


def test_every_deferred_import_says_why():
    """docs/architecture.md#deferred-imports: each import inside a function carries `# deferred: <why>`."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        found += unmarked_deferred_imports(path.read_text(), str(path.relative_to(PKG.parent)))
    assert not found, "imports inside functions without a `# deferred: <why>` comment:\n" + "\n".join(found)


CLAIM = re.compile(r"# deferred: ([\w, ]+?) loads? on first use, not when (.+?) starts")


def start_claims(text: str) -> list[tuple[int, list[str], list[str]]]:
    """Each `# deferred: LIBS load(s) on first use, not when python -m jaxdist.CMD[, ...] starts`:
    (line, libraries, commands)."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if m := CLAIM.search(line):
            libs = [x.strip() for x in m.group(1).split(",")]
            out.append((i, libs, re.findall(r"python -m jaxdist\.(\w+)", m.group(2))))
    return out


def libraries_at_start(commands) -> dict[str, set[str]]:
    """The top-level packages in sys.modules once each command's module is imported, each in a fresh
    interpreter (in parallel), as `python -m jaxdist.CMD` does before its main runs."""
    import subprocess
    import sys

    code = "import importlib, sys; importlib.import_module(sys.argv[1]); print(' '.join({m.split('.')[0] for m in sys.modules}))"
    entry = {c: f"jaxdist.{c}.__main__" if (PKG / c / "__main__.py").exists() else f"jaxdist.{c}" for c in commands}
    procs = {
        c: subprocess.Popen([sys.executable, "-c", code, m], stdout=subprocess.PIPE, text=True, cwd=PKG.parent)
        for c, m in entry.items()
    }
    out = {}
    for c, p in procs.items():
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0, f"importing {entry[c]} failed"
        out[c] = set(stdout.split())
    return out


def test_start_claim_parser_reads_libraries_and_commands():
    text = "x\n    # deferred: flax, jax load on first use, not when python -m jaxdist.plan, python -m jaxdist.train starts\n"
    assert start_claims(text) == [(2, ["flax", "jax"], ["plan", "train"])]


def test_deferred_imports_keep_what_they_say_out_of_start_up():
    """A deferral that says 'jax loads on first use, not when python -m jaxdist.plan starts' is only worth
    its line if importing that command really leaves jax unloaded: checked for every such comment."""
    claims = [(p, *c) for p in sorted(PKG.rglob("*.py")) for c in start_claims(p.read_text())]
    # the parser still reads the comments: each command's one deferred block is among them
    assert {c for *_, cmds in claims for c in cmds} >= {"train", "bench", "generate", "plan", "convert", "eval"}
    loaded = libraries_at_start({c for *_, cmds in claims for c in cmds})
    false = [
        f"{p.relative_to(PKG.parent)}:{line}: python -m jaxdist.{c} loads {sorted(set(libs) & loaded[c])} at start"
        for p, line, libs, cmds in claims
        for c in cmds
        if set(libs) & loaded[c]
    ]
    assert not false, "deferred-import reasons that are not true:\n" + "\n".join(false)


def architecture_tree(text: str) -> dict[str, set[str]]:
    """docs/architecture.md's tree table: package -> the modules its row names (`x.py`), rows in order."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\| `(\w+)/` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([\w]+)\.py`", m.group(2)))
    return rows


def test_the_architecture_tree_is_the_real_one():
    """Every package under jaxdist/ has its row in docs/architecture.md's tree, naming each of its modules,
    in the order of the layering the import test enforces (tests/test_imports.py LAYERS)."""
    rows = architecture_tree((PKG.parent / "docs" / "architecture.md").read_text())
    real = {
        d.name: {p.stem for p in d.glob("*.py") if p.stem != "__init__"}
        for d in sorted(PKG.iterdir())
        if (d / "__init__.py").exists()
    }
    missing = {
        name: sorted(mods - rows.get(name, set())) for name, mods in real.items() if mods - rows.get(name, set())
    }
    assert not missing, f"docs/architecture.md's tree lacks these modules (package: modules): {missing}"
    assert not set(rows) - set(real), f"rows for packages that do not exist: {set(rows) - set(real)}"
    order = [u for units in LAYERS for u in units if u in rows]
    assert list(rows) == order, f"the tree's rows should run in the layering order {order}"


def test_the_tree_check_can_fail():
    text = "| `data/` | `loader.py`, `files.py` | what |\n| `hf/` | `mapping.py` | what |\n"
    assert architecture_tree(text) == {"data": {"loader", "files"}, "hf": {"mapping"}}


# Optional extras: each is imported only where its feature is used, behind a one-line "install the
# extra" error (tests/test_trackers.py and test_tokenize.py check those lines).
EXTRAS = {"wandb", "mlflow", "pyarrow", "tensorboard", "lm_eval"}


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


def test_the_public_api():
    """docs/getting-started.md#from-python: `jaxdist.run`, `.config`, `.RunResult`, `.setup_platform` and
    `.JaxdistError` are the real objects, and `import jaxdist` alone loads no JAX (every jaxdist module,
    the supervisor's and the platform set-up's included, imports the package first)."""
    import inspect
    import subprocess
    import sys

    import jaxdist
    from jaxdist import checkpoint, config, errors
    from jaxdist.distributed import platform
    from jaxdist.training import loop, state

    assert (jaxdist.RunResult, jaxdist.config) == (state.RunResult, config)
    assert (jaxdist.JaxdistError, jaxdist.setup_platform) == (errors.JaxdistError, platform.setup_platform)
    assert callable(jaxdist.config.load) and set(jaxdist.__all__) == {
        "run",
        "RunResult",
        "config",
        "JaxdistError",
        "setup_platform",
    }
    # jaxdist.run is loop.run's: the same parameters, forwarded (a plain function, no module __getattr__)
    assert "from jaxdist.training.loop import run as train" in inspect.getsource(jaxdist.run) and callable(loop.run)
    assert not hasattr(jaxdist, "__getattr__") and not hasattr(checkpoint, "__getattr__")
    code = "import sys, jaxdist; print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert not hasattr(jaxdist, "nothing_here")  # an unknown name is an AttributeError


def test_platform_set_up_tunes_the_garbage_collector():
    """Every command's platform set-up (jaxdist.setup_platform) freezes what is loaded (here JAX, which it
    imports) out of the collector's walks and collects the young generation every 20,000 allocations, not 700."""
    import os
    import subprocess
    import sys

    code = (
        "import gc, jaxdist; n = gc.get_freeze_count(); "
        "jaxdist.setup_platform(1); print(gc.get_threshold(), n, gc.get_freeze_count() > n + 10_000)"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split("\n")[0] == "(20000, 10, 10) 0 True"


def test_the_suites_processes_share_their_bytecode():
    """Every process of the suite reads jax's bytecode, so its dozens of subprocess runs do not each compile jax,
    flax, optax... from source again (~1.9 CPU-s a process). Where pip installed none (--no-compile) and the
    environment turned writing off (PYTHONDONTWRITEBYTECODE, as CI does), tests/conftest.py has the session
    write it to a directory of its own; this fails there without that."""
    import subprocess
    import sys

    code = "import jax; print(jax.__spec__.cached)"  # where this process reads jax's bytecode from
    cached = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(cached).is_file()
