"""The documentation stays true: every relative link in README.md, CONTRIBUTING.md and docs/ resolves
(files and #anchors), every repository path (`jaxdist/hf/hub.py`, `tests/fixtures/...`) and module name
(`jaxdist.parallel.matmul.weight_matmul`) they name exists, every `python -m jaxdist.X ...` command they show parses with that entry point's
own argument parser (and its config overrides load), and docs/configuration.md's key reference is what
the dataclasses generate. Nothing here trains or compiles: the whole file runs in a few seconds."""

from __future__ import annotations

import ast
import functools
import importlib
import math
import re
import shlex
import unicodedata
from pathlib import Path

import jax
import pytest

from jaxdist import config, train
from jaxdist.config.keys import with_reference
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed import sharding
from jaxdist.models.resolve import resolve
from jaxdist.planner import plans
from jaxdist.training import step

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# `python -m jaxdist.X` -> the module whose parse_args(argv) is that command's parser
PARSERS = {"data": "jaxdist.data.prepare", "config": "jaxdist.config.__main__"}


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """(lines outside fenced code blocks, lines inside them)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, -, _ and spaces
    kept), spaces to hyphens; link targets and inline-code marks contribute their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    kept = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_and_code(page.read_text())[0]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    prose = "\n".join(prose_and_code(page.read_text())[0])
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link
    return LINK.findall(prose)


def test_the_pages_exist():
    names = {rel(p) for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/index.md", "docs/configuration.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{rel(page)}: broken links: {broken}"


def test_the_link_checker_can_fail(tmp_path):
    """Planted bad links are caught: a missing file, a missing anchor, and a good one is not."""
    (tmp_path / "a.md").write_text("# A page\n\n## Two words\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words) [no file](c.md) [no anchor](a.md#not-a-heading) `[code](x.md)`\n")
    assert links(page) == ["a.md#two-words", "c.md", "a.md#not-a-heading"]
    assert anchors(tmp_path / "a.md") == {"a-page", "two-words"}
    assert (
        slug("Compressed data parallelism: defaults, `exact` bytes")
        == "compressed-data-parallelism-defaults-exact-bytes"
    )


# Paths into the repository and dotted module names, in prose and code alike: what a move of modules
# (issue 28's packages) leaves stale when a script rewrites imports but not the words around them.
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:jaxdist|tests|scripts|configs|docs)/[\w./-]*\w)(?![\w*<{])")
MODULE_NAME = re.compile(r"(?<![\w./-])(jaxdist(?:\.\w+)+)")
# a run dir's lock file; configs/ as a wheel installs it (pyproject's package-dir)
NOT_MODULES = {"jaxdist.lock", "jaxdist.configs", "jaxdist/configs"}


@functools.cache
def top_level_names(source: Path) -> frozenset[str]:
    """What a module defines or imports at its top level (or lists in a lazy `__getattr__` table)."""
    tree = ast.parse(source.read_text())
    got = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            got |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            got |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            got.add(n.value)  # __all__ / lazy-export tables
    return frozenset(got)


def stale_names(text: str, root: Path = ROOT) -> list[str]:
    """Repository paths that do not exist and `jaxdist.a.b` names that are no module (or no attribute of
    the module they start with)."""
    stale = [m for m in REPO_PATH.findall(text) if not (root / m.rstrip(".")).exists()]
    for name in MODULE_NAME.findall(text):
        parts = name.split(".")
        if any(part.startswith("__") or part.isupper() for part in parts):  # __path__; placeholders X, CMD
            continue
        for k in range(len(parts), 0, -1):
            base = root.joinpath(*parts[:k])
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if source.is_file():
                if k < len(parts) and parts[k] not in top_level_names(source) and not (base / parts[k]).exists():
                    stale.append(name)
                break
        else:
            stale.append(name)
    return [s for s in stale if s not in NOT_MODULES]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_path_and_module_named_exists(page):
    assert not stale_names(page.read_text()), f"{rel(page)}: names that do not exist: {stale_names(page.read_text())}"


def test_every_path_and_module_named_in_code_exists():
    """The same for docstrings and comments of the package, the scripts and the tests."""
    sources = sorted(
        [*(ROOT / "jaxdist").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    )
    stale = {
        str(f.relative_to(ROOT)): got
        for f in sources
        if f.name != "test_docs.py" and (got := stale_names(f.read_text()))
    }
    assert not stale, f"names that do not exist: {stale}"


def test_the_name_checker_can_fail():
    """Names from before the move into packages are caught; their new homes are not."""
    old = "see `jaxdist/step.py`, jaxdist.loop, `jaxdist.models.llama.weight_matmul` and tests/fixtures/hf_nope"
    assert stale_names(old) == [
        "jaxdist/step.py",
        "tests/fixtures/hf_nope",
        "jaxdist.loop",
        "jaxdist.models.llama.weight_matmul",
    ]
    new = "see `jaxdist/training/step.py`, jaxdist.training.loop, `jaxdist.parallel.matmul.weight_matmul`, tests/fixtures/hf_*"
    assert stale_names(new) == []


def commands(page: Path) -> list[str]:
    """Every `python -m jaxdist.X ...` the page shows: in its code blocks (continuation lines joined, without
    the shell around it: `cmd && python -m ...`, a trailing `# comment`) and in inline code in its prose. A
    bare mention (`python -m jaxdist.plan`, `python -m jaxdist.data prepare`) is not a command."""
    prose, code = prose_and_code(page.read_text())
    joined, buf = [], ""
    for line in code:
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        joined.append(buf + line)
        buf = ""
    out = [
        part.strip()
        for line in joined
        for part in re.split(r"&&|\|\||;|\|", line)
        if part.strip().startswith("python -m jaxdist.")
    ]
    inline = re.findall(r"`(python -m jaxdist\.[^`]+)`", " ".join(prose))
    return out + [" ".join(c.split()) for c in inline if any(w.startswith("-") or "=" in w for w in c.split()[3:])]


ALL_COMMANDS = [(rel(p), c) for p in PAGES for c in commands(p)]


def test_the_readme_shows_every_main_command():
    shown = {c.split()[2] for page, c in ALL_COMMANDS if page == "README.md"}
    assert {"jaxdist.train", "jaxdist.plan", "jaxdist.convert", "jaxdist.generate", "jaxdist.plot"} <= shown


@pytest.mark.parametrize(
    ("page", "cmd"), ALL_COMMANDS, ids=[f"{p}:{c.split('#')[0].strip()[:70]}" for p, c in ALL_COMMANDS]
)
def test_every_command_shown_parses(page, cmd, monkeypatch):
    """The entry point's own parser accepts the flags (in-process, nothing runs); train, bench and plan
    overrides and --config names also load as a config, and a train command's mesh passes the start-up
    checks on the test devices."""
    monkeypatch.chdir(ROOT)  # configs/1b.yaml and the like are relative to the checkout
    words = shlex.split(cmd, comments=True)
    name = words[2].removeprefix("jaxdist.")
    module = importlib.import_module(PARSERS.get(name, f"jaxdist.{name}"))
    try:
        args = module.parse_args(words[3:])
    except SystemExit as e:
        assert e.code == 0 and "--help" in words, f"{page}: `{cmd}` does not parse (exit {e.code})"
        return
    if str(getattr(args, "config", None)).startswith("runs/"):
        return  # a config a run wrote (runs/X/config.yaml) exists only after that run
    if name == "train":
        check_on_the_test_devices(train.resolve_config(args))  # --mesh and --steps become overrides there
    elif name == "plan":
        plans.load_config(args.config, list(args.overrides))  # also a Hugging Face model (hf:DIR)
    elif name == "bench":
        config.load(args.config, list(args.overrides))


def check_on_the_test_devices(cfg) -> None:
    """The start-up checks that need the mesh (batch divisibility, MoE and cp rules, every parameter
    divisible by its shards), on the suite's 8 CPU devices, from abstract shapes: nothing is compiled.
    A command for another device count (a cluster's) is only parsed; --mesh auto is decided at start."""
    if cfg.mesh.shape == "auto":
        return
    explicit = [int(v) for _, v in (p.split("=") for p in cfg.mesh.shape.split(",") if p.strip())]
    if -1 not in explicit and math.prod(explicit) != jax.device_count():
        return
    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape)
    rules = sharding.make_rules(cfg.mesh.rules)
    step.check(cfg, mesh, rules)
    resolve(cfg, mesh, rules)


def test_configuration_reference_is_current():
    page = ROOT / "docs" / "configuration.md"
    text = page.read_text()
    assert with_reference(text) == text, (
        "docs/configuration.md is stale: python -m jaxdist.config --write docs/configuration.md"
    )


def test_the_readme_test_line_is_what_ci_runs():
    """README's second command (install, lint, type check, tests) is the chain `.ci/run` runs in its fresh venv."""
    readme = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(readme) == 2 and len(ci) == 1
    assert readme[1].split("#", 1)[0].strip() == ci[0].strip()
    quoted = [
        line
        for p in (ROOT / "docs").glob("*.md")
        for line in p.read_text().splitlines()
        if "(what .ci/run runs)" in line
    ]
    assert quoted and all(line.split("#", 1)[0].strip() == ci[0].strip() for line in quoted), (
        quoted
    )  # the docs' copies too
