"""Where a Hugging Face model is: a local directory, or a Hub id resolved through huggingface_hub's cache.

`hf:meta-llama/Llama-3.2-1B` (optionally `@REVISION`) is what people type; huggingface_hub owns the cache
layout (`HF_HOME`, `HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE=1`) and revisions, so it is asked, not
imitated. A directory that exists always wins over a Hub id of the same spelling. Only the files jaxdist
reads are fetched: the weights in safetensors, the configs and the tokenizer, never `original/*.pth` or
`*.bin` copies that would double the download.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants, errors
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import validate_repo_id

from jaxdist.errors import JaxdistError

WANTED = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
# ORG/NAME as the Hub spells repository ids, with an optional @revision (branch, tag or commit)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def local_dir(spec: str, patterns: list[str] | None = None) -> Path:
    """A local model directory for `spec` (a path, or ORG/NAME[@REVISION]), or a one-line error.
    `patterns`: the files to fetch of a Hub id (default WANTED; `plan` needs config.json alone)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise JaxdistError(f"{spec} is a file; pass a Hugging Face model directory or a Hub id ORG/NAME")
    match = _HUB_ID.match(spec)
    if match is None or spec.startswith((".", "/", "~")):
        raise JaxdistError(f"{spec}: no such directory, and not a Hub id (ORG/NAME[@REVISION])")
    return _snapshot(match["repo"], match["revision"], patterns or WANTED)


def _snapshot(repo: str, revision: str | None, patterns: list[str] = WANTED) -> Path:
    name = repo + (f"@{revision}" if revision else "")
    download = f"`hf download {repo}{f' --revision {revision}' if revision else ''}`"
    try:
        validate_repo_id(repo)
        if revision and ".." in revision.split("/"):
            raise errors.HFValidationError(f"revision {revision!r} contains '..'")
        path = Path(
            huggingface_hub.snapshot_download(
                repo, revision=revision, allow_patterns=patterns, local_files_only=constants.HF_HUB_OFFLINE
            )
        )
    except errors.HFValidationError as e:
        raise JaxdistError(
            f"hf:{name[:200]} is not a Hub id ({str(e).splitlines()[0][:200]}); give ORG/NAME[@REVISION] as "
            "huggingface.co spells it, or a local directory"
        ) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as e:
        raise JaxdistError(
            f"hf:{name}: the Hub refused it ({type(e).__name__}); check the id, or `hf auth login` for a gated model"
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError) as e:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"the Hub is unreachable ({type(e).__name__})"
        raise JaxdistError(
            f"hf:{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
            f"run {download} where the Hub is reachable (HF_HOME selects the cache), or pass a local directory"
        ) from None
    return _in_cache(path, repo, name, download, revision)


def _in_cache(path: Path, repo: str, name: str, download: str, revision: str | None) -> Path:
    """The snapshot folder huggingface_hub returned must be one of the repository's snapshots: a
    `refs/<revision>` file holding `../../etc` (or nothing) would make it any folder (or snapshots/)."""
    snapshots = Path(constants.HF_HUB_CACHE).expanduser().resolve() / repo_folder_name(repo_id=repo, repo_type="model")
    snapshots = snapshots / "snapshots"
    got = Path(os.path.normpath(path))  # lexical: the snapshot's files are links into blobs/ by design
    if got.parent == snapshots and got.name:
        return path
    ref = snapshots.parent / "refs" / (revision or "main")
    what = "is empty" if got == snapshots else f"leads outside the repository's snapshots ({str(path)[:200]})"
    raise JaxdistError(
        f"hf:{name}: {ref} in the Hugging Face cache {what}; run {download} to repair the cache (nothing was read)"
    )


def base_model_name(local: Path) -> tuple[str, str | None]:
    """(what `base_model_name_or_path` should say, the revision) for a model read from `local`: the Hub id
    ORG/NAME and the snapshot's commit when `local` is a snapshot in huggingface_hub's cache
    (`.../models--ORG--NAME/snapshots/COMMIT`), else the folder's absolute path."""
    local = Path(local).expanduser().resolve()
    snapshots, repo = local.parent, local.parent.parent.name
    if snapshots.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--") :].replace("--", "/", 1), local.name
    return str(local), None
