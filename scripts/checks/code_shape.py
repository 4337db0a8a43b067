"""Code-shape counts of jaxdist/ (issue 43's before/after numbers), read from the source with `ast`.

    python scripts/checks/code_shape.py            # all of jaxdist/
    python scripts/checks/code_shape.py training   # one package: its longest parameter list and typed share

Prints: deferred imports (import statements inside a function, and the files holding them);
`__getattr__` lazy exports; the longest parameter list (self/cls not counted) and where it is; the share
of parameters with a type annotation; the modules over 350 lines.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "jaxdist"


def counts(root: Path) -> dict:
    deferred: dict[str, int] = {}
    lazy = []
    longest = (0, "")
    typed = total = 0
    big = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        text = path.read_text()
        if (n := len(text.splitlines())) > 350:
            big.append((n, rel))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name == "__getattr__" and node in tree.body:
                lazy.append(rel)
            inner = [
                n for body_node in node.body for n in ast.walk(body_node) if isinstance(n, (ast.Import, ast.ImportFrom))
            ]
            if inner:
                deferred[rel] = deferred.get(rel, 0) + len(inner)
            a = node.args
            params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            total += len(params)
            typed += sum(p.annotation is not None for p in params)
            if len(params) > longest[0]:
                longest = (len(params), f"{rel}:{node.lineno} {node.name}")
    # nested functions are walked twice (once inside their parent): count each import statement once
    return {
        "deferred": deferred,
        "lazy": lazy,
        "longest": longest,
        "typed": typed,
        "params": total,
        "big": sorted(big, reverse=True),
    }


def deferred_once(root: Path) -> dict[str, int]:
    """Import statements inside any function, each counted once (nested functions not double-counted)."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        n = 0

        def visit(node, in_fn):
            nonlocal n
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)) and in_fn:
                    n += 1
                visit(child, in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(tree, False)
        if n:
            out[str(path.relative_to(PKG.parent))] = n
    return out


def main() -> None:
    root = PKG / sys.argv[1] if len(sys.argv) > 1 else PKG
    c = counts(root)
    once = deferred_once(root)
    print(f"deferred imports: {sum(once.values())} in {len(once)} files")
    for f, n in sorted(once.items(), key=lambda x: -x[1]):
        print(f"  {n:3d} {f}")
    print(f"__getattr__ lazy exports: {len(c['lazy'])} {c['lazy']}")
    print(f"longest parameter list: {c['longest'][0]} ({c['longest'][1]})")
    print(f"typed parameters: {c['typed']}/{c['params']} = {c['typed'] / max(c['params'], 1):.0%}")
    print("modules over 350 lines: " + (", ".join(f"{f} {n}" for n, f in c["big"]) or "none"))


if __name__ == "__main__":
    main()
