"""`--mesh auto`'s decision kept: the layout a run recorded in its config.yaml, read back on resume when
the device count is the present one; else the decision cached by (config, devices) in jaxdist's cache
folder, so the second start of the same config on the same devices searches nothing; else a search
(jaxdist/analysis/mesh_search.py's `run`), then cached. And the planner's hardware entry the search ranks
by: the devices' own, measured here first where it lacks what a CPU ranking needs (measured_here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import jax
import yaml

from jaxdist.analysis import calibrate, mesh_search
from jaxdist.config import Config
from jaxdist.distributed import platform
from jaxdist.errors import JaxdistError
from jaxdist.planner import hardware, search
from jaxdist.planner.hardware import Hardware

# What `--mesh auto` decides, recorded in the run's config.yaml and read back on resume.
LAYOUT_KEYS = (
    ("mesh", "shape"),
    ("mesh", "rules"),
    ("model", "remat"),
    ("train", "grad_accum_steps"),
    ("pipeline", "schedule"),
    ("pipeline", "microbatches"),
    ("pipeline", "repeats"),
)


def recorded_layout(run_dir: Path) -> dict | None:
    """The layout keys of the run's latest recorded config (config.<n>.yaml, else config.yaml), or None."""
    files = sorted(
        (p for p in Path(run_dir).glob("config.*.yaml") if p.name.split(".")[1].isdigit()),
        key=lambda p: int(p.name.split(".")[1]),
    )
    path = files[-1] if files else Path(run_dir) / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("mesh"), dict):
        return None
    out = {f"{s}.{k}": raw.get(s, {}).get(k) for s, k in LAYOUT_KEYS if k in raw.get(s, {})}
    return out if out.get("mesh.shape") not in (None, "auto") else None


def _mesh_devices(shape: str) -> int:
    return math.prod(int(part.split("=")[1]) for part in shape.split(",") if "=" in part)


def auto_layout(
    cfg: Config,
    run_dir: Path,
    hw: Hardware,
    steps: int = 0,
    top_k: int = 3,
    log=print,
    budget_s: float | None = None,
    cache: Path | None = None,
) -> tuple[Config, frozenset[str]]:
    """`--mesh auto`: the layout recorded in `run_dir` when its device count is the present one (a resume
    keeps its layout), else the decision cached in `cache` for this config on these devices (see
    cache_file), else a search (then cached; with timed steps on an entry without measured attention,
    such as the table's CPU one, ranked by this machine's measured figures: measured_here). Returns the
    config with the layout set and the layout keys a resume may now see changed (when it re-decided over a
    recorded layout). Several processes: every
    process compiles and times the same candidates in lock-step; process 0's choice is broadcast to all
    (the cache is read by one process only: it is off for several, see cache_dir)."""
    present = jax.device_count()
    rec = recorded_layout(run_dir)
    if rec is not None:
        was = _mesh_devices(rec["mesh.shape"])
        if was == present:
            chosen = cfg.replace(**_sections(rec))
            log(
                f"--mesh auto: the layout recorded in {run_dir} ({rec['mesh.shape']}, remat "
                f"{chosen.model.remat}, accumulation {chosen.train.grad_accum_steps}), kept on resume"
            )
            return chosen, frozenset()
        log(f"--mesh auto: {run_dir} recorded a layout for {was} devices, {present} are present: searching again")
    changed = frozenset(f"{s}.{k}" for s, k in LAYOUT_KEYS) if rec is not None else frozenset()
    here = devices_here()
    path = cache_file(cache, cfg, hw, steps, top_k, budget_s) if cache is not None else None
    hit = _read_cache(path)
    if hit is not None and hit.get("devices") == here:
        log(f"--mesh auto: the decision cached in {path} for this config on {here}, no search: {hit['reason']}")
        return cfg.replace(**_sections(hit["layout"])), changed
    if hit is not None:
        log(f"--mesh auto: {path} cached a decision for {hit.get('devices')}, {here} are present: searching again")
    ranked_by = ranking_entry(cfg, hw, steps, log)
    result = mesh_search.run(cfg, ranked_by, top_k=top_k, steps=steps, budget_s=budget_s)
    if jax.process_count() > 1:  # timings differ per process: process 0's choice is everyone's
        result.chosen = result.rows[mesh_search.agree(result.rows.index(result.chosen))]
    log(f"--mesh auto: {result.summary()}")
    log(search.table(result.rows, result.budget_bytes))
    log(f"--mesh auto: {result.reason}")
    if needs_measuring(ranked_by):  # no timed steps, or several processes: the table's entry ranked
        log(
            f"--mesh auto: ranked with the {hw.name} entry, whose attention runs at its matmul rate; in one "
            "process --mesh-search-steps N measures this machine first, or python -m jaxdist.plan --calibrate "
            "here.json (same config) does and --hardware here.json ranks with it (docs/planner.md)"
        )
    chosen = result.cfg
    if path is not None:
        layout = {f"{s}.{k}": getattr(getattr(chosen, s), k) for s, k in LAYOUT_KEYS}
        _write_cache(path, dict(devices=here, layout=layout, reason=result.reason))
    return chosen, changed


def needs_measuring(hw: Hardware) -> bool:
    """A device without a fused attention whose entry has no measured attention (the table's CPU entry):
    its attention is ranked at the matmul rate, which on CPU misorders context parallelism."""
    return not hw.flash_attention and not hw.attention_rates


def ranking_entry(cfg: Config, hw: Hardware, steps: int, log) -> Hardware:
    """The entry a search with `steps` timed steps ranks by (train, plan --search and bench --mesh auto
    alike): `hw` measured here where it needs it (needs_measuring, measured_here), else `hw`."""
    return measured_here(cfg, hw, log) if steps and needs_measuring(hw) else hw


def measured_here(cfg: Config, hw: Hardware, log) -> Hardware:
    """`hw` with this machine's figures (plan --calibrate's, attention by query tile included) for the
    search's ranking; one process only: several would each rank by their own figures, and the search
    needs every process to compile and time the same candidates (they keep `hw`)."""
    if jax.process_count() > 1:
        return hw
    t0 = time.perf_counter()
    measured = calibrate.measure(cfg, jax.devices())
    spent = time.perf_counter() - t0
    log(f"--mesh auto: measured this machine for the ranking in {spent:.1f} s (plan --calibrate's figures)")
    return calibrate.entry(hw, measured, f"{hw.name}, measured here")


def devices_here() -> str:
    """'8 x cpu in 1 process': what a cached decision was made on."""
    return f"{jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} process(es)"


def cache_dir() -> Path | None:
    """Where `train --mesh auto` caches decisions: `mesh_search/` in jaxdist's cache folder (platform.
    cache_folder: the persistent compilation cache's, whose compiled candidates a repeated search loads
    where that cache is on); None for several processes, whose choice process 0 broadcasts."""
    return Path(platform.cache_folder()) / "mesh_search" if jax.process_count() == 1 else None


def cache_file(folder: Path, cfg: Config, hw: Hardware, steps: int, top_k: int, budget_s: float | None) -> Path:
    """The decision's file: keyed by the config with its layout keys and train.steps left out (they do
    not change the search), the hardware entry and the search's settings. The devices are checked
    inside, so a decision for other devices is seen, and replaced, rather than missed."""
    blank = {s: {k: None for ss, k in LAYOUT_KEYS if ss == s} for s, _ in LAYOUT_KEYS}
    raw = dataclasses.asdict(cfg)
    for section, keys in blank.items():
        raw[section] = {**raw[section], **keys}
    raw["train"] = {**raw["train"], "steps": None}
    key = json.dumps([raw, dataclasses.asdict(hw), steps, top_k, budget_s], sort_keys=True, default=str)
    return Path(folder) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_cache(path: Path | None) -> dict | None:
    try:
        doc = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None  # none yet, or unreadable: search (and write a fresh one)
    ok = isinstance(doc, dict) and isinstance(doc.get("layout"), dict) and "reason" in doc
    return doc if ok else None


def _write_cache(path: Path, doc: dict) -> None:
    """Whole or not at all: written beside, then renamed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _sections(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def hardware_here(budget_bytes: float | None = None, name: str | None = None) -> Hardware:
    """The planner's entry for the devices present (on CPU the `cpu` entry), or the one `name`d (a table
    name, or a FILE.json that `plan --calibrate` measured), with `budget_bytes` usable."""
    from jaxdist.observe import report  # deferred: report reads the devices, present only after set-up

    hw = hardware.get(name) if name else report.hardware_for(jax.devices()[0])
    if hw is None:
        raise JaxdistError(
            f"--mesh auto: the planner has no entry for {jax.devices()[0].device_kind}; give --mesh explicitly "
            "(python -m jaxdist.plan --help lists the entries)"
        )
    return search.with_budget(hw, budget_bytes)
