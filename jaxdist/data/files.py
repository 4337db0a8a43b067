"""Which files a data path names: a folder, a glob, or the standard library (a leaf module)."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig

from jaxdist.errors import JaxdistError

# training/rundir.py's lock file. A folder holding one is a run (checkpoints, metrics.jsonl, config.yaml),
# never data: a run folder inside a data folder would otherwise join the corpus, and its growing files
# would make every resume refuse a "changed corpus".
RUN_LOCK = "jaxdist.lock"


@functools.cache
def stdlib_files() -> list[str]:
    """The standard library's .py files, sorted (hidden ones skipped, as a glob would). The walk never
    enters site-packages/dist-packages: globbing them and filtering afterwards took ~3 s per call with a
    few large packages installed."""
    root, out = sysconfig.get_paths()["stdlib"], []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("site-packages", "dist-packages")]
        out += [os.path.join(folder, f) for f in names if f.endswith(".py") and not f.startswith(".")]
    return sorted(out)


def expand_path(pattern: str, what: str = "data.path") -> list[str]:
    """A folder (every file under it, sorted; hidden ones and run folders skipped) or a glob -> sorted file list."""
    path = os.path.expanduser(pattern)
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            if RUN_LOCK in names and root != path:  # a run folder below the data: not data
                dirs[:] = []
                continue
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .cache, ...
            files += [os.path.join(root, f) for f in names if not f.startswith(".")]
        files.sort()
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise JaxdistError(
            f"{what}={pattern!r} matches no files; give a folder or a glob of existing files"
            + (" (or leave data.path empty for the built-in corpus)" if what == "data.path" else "")
        )
    return files
