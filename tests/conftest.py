"""Eight simulated CPU devices for every test; must run before any JAX work."""

import atexit
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Bytecode: where the environment turns its writing off (PYTHONDONTWRITEBYTECODE, as CI images do) and pip
# installed without .pyc (the README's --no-compile), every process of the suite, three workers and dozens
# of subprocess runs, compiled jax, flax, optax, orbax... from source, ~1.9 CPU-s each (CI's suite: 848
# user CPU-s, 772 with this). There the session writes it to a directory of its own, shared by its processes
# and removed at its end, so the user's tree stays free of it as they asked. Only there: Python then reads
# bytecode from that directory alone, and an install that has its .pyc would compile them all once more
# (~3 CPU-s). (jax is found, not imported.)
if sys.dont_write_bytecode and not os.path.exists(
    importlib.util.cache_from_source(importlib.util.find_spec("jax").origin)
):
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="jaxdist-pycache-")
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    atexit.register(shutil.rmtree, sys.pycache_prefix, ignore_errors=True)
# One persistent compilation cache per test session, inherited by subprocess tests: the same program
# compiled again (another fixture, a resumed run) loads instead of recompiling. Fresh each session, and
# removed when the process that made it ends (pytest's own, after its xdist workers: ~60 MB a suite).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdist-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every program, not only those that took 1 s or more (JAX's default): the suite's small steps compile in
# well under a second each, and the same ones recur across files and fixtures (3-8% of a 3-file run's CPU).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Tests check numerics, HLO and memory, not speed: the fast-compile flags (their reasons beside them).
# Subprocesses inherit them. Benchmarks run without them.
from jaxdist.distributed.xla_flags import FAST_CPU_COMPILE as TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()
import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jaxdist import config  # noqa: E402
from jaxdist.distributed.platform import GC_THRESHOLD  # noqa: E402
from jaxdist.hf import export, mapping, tensors  # noqa: E402

# A test's run draws no loss.png unless the test reads it (test_train's CLI run, test_verify's and
# test_plot's plot tests): drawing costs matplotlib's import and a first draw, ~2-3 CPU-s in every
# training process, ~0.3 s per run in-process. In SMALL_ARGS, MICRO_ARGS and tiny_cfg.
NO_PLOT = "train.plot=false"
# The smallest Llama that exercises every path, one shape for the whole suite (a program one test file
# compiled is a cache hit in the next): as overrides for subprocess runs, and as the small_cfg fixture.
SMALL_MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)
SMALL_ARGS = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()] + [NO_PLOT]
# Smaller still, for tests of the loop and its outputs rather than of the model (plots, trackers).
MICRO_MODEL = dict(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, seq_len=16)
# As overrides, for subprocess runs that test process plumbing (signals, resume, peers), not the model.
MICRO_ARGS = [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + [NO_PLOT]
# Every registry consumer runs on these (tests/test_model_registry.py; test_arch_training.py trains them).
SHAPES = {  # family -> a small model of it (the MoE ones with experts), over SMALL_MODEL or MICRO_MODEL
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "mistral": {"sliding_window": 8},
    "mixtral": {"moe_experts": 4, "moe_topk": 2},
    "qwen3_moe": {"qk_norm": True, "moe_experts": 4, "moe_topk": 2, "moe_every": 2, "moe_mlp_dim": 32},
    "gemma3": {"qk_norm": True, "sliding_window": 4, "sliding_window_pattern": 2, "tie_embeddings": True},
    "deepseek_v3": {
        "mla_q_rank": 16,
        "mla_kv_rank": 16,
        "mla_nope_dim": 8,
        "mla_rope_dim": 4,
        "mla_v_dim": 8,
        "moe_experts": 4,
        "moe_topk": 2,
        "moe_router": "sigmoid",
        "moe_groups": 2,
        "moe_topk_groups": 1,
        "moe_shared_experts": 1,
        "moe_mlp_dim": 32,
        "dense_layers": 1,
    },  # fmt: skip
    "gpt_oss": {
        "qkv_bias": True,
        "sliding_window": 4,
        "moe_experts": 4,
        "moe_topk": 2,
        "moe_mlp_dim": 32,
        "rope_scaling": "yarn",
        "rope_factor": 4.0,
        "rope_original_max_len": 16,
    },  # fmt: skip
    "qwen3_next": {
        "full_attention_interval": 2,
        "linear_key_heads": 2,
        "linear_value_heads": 4,
        "linear_key_dim": 16,
        "linear_value_dim": 8,
        "linear_conv_kernel": 4,
        "rope_fraction": 0.5,
        "moe_experts": 4,
        "moe_topk": 2,
        "moe_mlp_dim": 32,
        "moe_shared_dim": 24,
    },  # fmt: skip
}


@pytest.fixture(scope="session")
def tiny_cfg():
    """The CPU default with a short schedule; tests shrink it further with cfg.replace(...)."""
    return config.load(None, ["train.steps=10", "optim.warmup_steps=2", "train.eval_every=0", NO_PLOT])


@pytest.fixture(scope="session")
def small_cfg(tiny_cfg):
    """tiny_cfg with the SMALL_MODEL shape; tests vary it with cfg.replace(model=dict(...))."""
    return tiny_cfg.replace(model=SMALL_MODEL)


def learnable_batches(cfg, steps: int):
    """`steps` global batches of learnable rows (arithmetic progressions mod vocab, random start and
    stride), the same for every equivalence test of that shape."""
    import numpy as np

    rng = np.random.default_rng(7)
    shape = (steps, cfg.train.global_batch, 1)
    start, stride = rng.integers(0, cfg.model.vocab_size, shape), rng.integers(1, 4, shape)
    return ((start + stride * np.arange(cfg.model.seq_len + 1)) % cfg.model.vocab_size).astype(np.int32)


def tokens_spec(prog):
    """The abstract global batch a program's steps take."""
    import jax.numpy as jnp

    shape = (prog.cfg.train.global_batch, prog.cfg.model.seq_len + 1)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=prog.batch_sharding)


def compiled_gradients(prog):
    """The program's gradient stage alone, `(params, tokens) -> (mean gradients, loss)`, compiled for its
    shardings."""
    fn = jax.jit(
        lambda p, t: prog.gradients.apply(p, t, (), 0)[:2],
        in_shardings=(prog.state_shardings.params, prog.batch_sharding),
    )
    with prog.activate():
        return fn.lower(prog.abstract_state.params, tokens_spec(prog)).compile()


@contextlib.contextmanager
def unwritable_dir(path):
    """A new folder at `path` that this process cannot write into, even as root (CI runs as root, and
    root ignores permission bits): chmod 555 for other users; as root, `chattr +i` (immutable), else a
    read-only bind mount. Undone on exit so the folder can be cleaned up."""
    path = Path(path)
    path.mkdir()
    ok = lambda *cmd: subprocess.run(cmd, capture_output=True).returncode == 0
    if os.geteuid() != 0:
        path.chmod(0o555)
        undo = lambda: path.chmod(0o755)
    elif ok("chattr", "+i", str(path)):
        undo = lambda: ok("chattr", "-i", str(path))
    elif ok("mount", "--bind", str(path), str(path)):
        undo = lambda: ok("umount", str(path))
        ok("mount", "-o", "remount,ro,bind", str(path))
    else:
        undo = lambda: None
    try:
        if os.access(path, os.W_OK):
            pytest.skip(
                "root here can neither chattr +i nor mount (no CAP_LINUX_IMMUTABLE / CAP_SYS_ADMIN): no folder "
                "is unwritable to it; this runs as any other user, or as root where either is allowed (CI)"
            )
        yield path
    finally:
        undo()


@contextlib.contextmanager
def full_disk(path, size_kb: int):
    """A tmpfs of `size_kb` KiB at the new folder `path`, a disk that fills; `grow(kb)` makes room (as freeing
    space would). Skipped where mounting is not allowed; unmounted on exit."""
    path = Path(path)
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}): full-disk test not run")

    def grow(kb: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={kb}k", str(path)], check=True, capture_output=True)

    try:
        yield grow
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# Python's cyclic garbage collector, as every command sets it (platform.tune_gc): JAX's tracing allocates
# millions of objects, and every full collection walked all of them, the imported libraries' included
# (test_loss.py: 3.8 s of 68 CPU-s in the collector, 9 full collections of ~0.3 s; 0.75 s tuned). Here the
# freeze waits until the tests are collected (their modules imported).
gc.set_threshold(*GC_THRESHOLD)


def pytest_collection_finish(session):
    gc.freeze()


# Balance under `-n 3 --dist loadfile` (.ci/run): a file runs whole on one worker, so a heavy file handed
# out last leaves the other workers idle until it ends. Files are queued heaviest first, by their summed
# --durations seconds in tests/durations.json (scripts/checks/test_durations.py writes it from a
# --durations=0 log); a file the table lacks goes first, as if heavy. xdist's own reordering (by test
# count) is turned off so that this order is the queue's. Three workers on CI's two cores: the third
# computes while a test waits on its subprocesses (paired runs: 431 -> 416 s, and 420 -> 412 s swapped).
FILE_SECONDS = json.loads((Path(__file__).parent / "durations.json").read_text())


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, float("inf")))  # stable: files stay whole


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The skip count, after -rs's list of skips with their reasons and just above pytest's closing
    line: a skip that CI always takes must say in its reason on which machine the test does run."""
    result = yield  # the outermost wrapper: the short test summary has been written
    terminalreporter.write_line(f"skipped tests: {len(terminalreporter.stats.get('skipped', []))}")
    return result


def gone(pid: int, within: float = 10) -> bool:
    """The process has ended (a zombie counts: nothing of it runs) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


def _key(arg: str) -> str | None:
    key = arg.split("=", 1)[0]
    return key if "=" in arg and "." in key and not arg.startswith("-") else None


def overriding(args, *new: str) -> list[str]:
    """`args` then `new`, each `section.key=` given once: an earlier value of a key in `new` is dropped, as
    a user editing the command would (a key given twice is a warning, jaxdist/config/files.py)."""
    keys = {_key(a) for a in new} - {None}
    return [a for a in args if _key(a) not in keys] + list(new)


def flat_params(params) -> dict:
    """{key path: numpy array} of a parameter tree."""
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_export_round_trip(params, cfg, mesh, fixture: Path, out: Path, architecture: str, model_type: str):
    """An imported HF fixture exported again: the fixture's tensors bit for bit, its config fields, its
    architecture; and the export imported again gives the same parameters bit for bit."""
    export.export(params, cfg.model, out, "float32", log=lambda *a: None)
    original, exported = load_file(str(fixture / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(np.array_equal(original[k], exported[k]) for k in original)
    assert mapping.model_fields(out) == mapping.model_fields(fixture)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [architecture] and written["model_type"] == model_type
    again, _ = tensors.import_params(out, cfg, mesh)
    a, b = flat_params(params), flat_params(again)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def greedy_gaps(cfg, params, graphdef, mesh, prompts, ref_tokens, tol: float) -> np.ndarray:
    """(B, N): the top-1 minus top-2 logit at each step of the reference's greedy paths, from one
    teacher-forced forward of our model over prompt + the reference's tokens (rows right-padded: the model
    is causal, so padding after a position never reaches it). The fixtures keep only the chosen tokens'
    log-probs, so the gap is measured on our side (whose logits the tests bound against the reference).
    Our argmax must be the reference's token wherever the gap is at least 2 * tol (assert_same_greedy's
    margin): so the steps line up, and the forward the gaps come from is itself checked."""
    from flax import nnx

    from jaxdist.distributed import sharding
    from jaxdist.inference import decode

    ref = [[int(t) for t in r] for r in ref_tokens]
    rows = [[int(t) for t in p] + r[:-1] for p, r in zip(prompts, ref, strict=True)]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    with sharding.activate(mesh, decode.generation_rules(cfg)):
        logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens), np.float32)
    gaps = np.zeros((len(ref), len(ref[0])), np.float32)
    for i, (p, r) in enumerate(zip(prompts, ref)):
        top2 = np.sort(logits[i, len(p) - 1 : len(p) - 1 + len(r)], -1)[:, -2:]
        gaps[i] = top2[:, 1] - top2[:, 0]
        ours = logits[i, len(p) - 1 : len(p) - 1 + len(r)].argmax(-1)
        wide = gaps[i] >= 2 * tol
        assert (ours == np.array(r))[wide].all(), f"row {i}: our argmax {ours.tolist()} vs the reference's {r}"
    return gaps


def assert_generation_matches_fixture(cfg, params, graphdef, mesh, ref, what: str) -> None:
    """A family's generation through its cache against a transformers fixture (`ref` holds prompt0/1,
    greedy0/1, logprobs0/1): greedy tokens tie-aware (tol 2e-4: our forward, whence the gaps, and the
    decode are each held to 1e-4 of transformers), the chosen tokens' log-probs within 1e-4."""
    from jaxdist.inference import decode

    prompts = [ref["prompt0"].tolist(), ref["prompt1"].tolist()]
    new, logp, _, _ = decode.generate(cfg, params, graphdef, mesh, prompts, len(ref["greedy0"]))
    want = np.stack([ref["greedy0"], ref["greedy1"]])
    gaps = greedy_gaps(cfg, params, graphdef, mesh, prompts, want, tol=2e-4)
    assert_same_greedy(new, want, gaps, tol=2e-4, what=f"{what} greedy tokens")  # every token unless a near-tie
    for k in (0, 1):
        assert np.abs(logp[k] - ref[f"logprobs{k}"]).max() <= 1e-4


def assert_refused_in_one_line(fixture: Path, overrides: list[str], named: str) -> None:
    """The fixture's architecture, with `overrides` (model.* ones applied after the import), is refused by its
    registry entry's start-up check in one line matching `named`."""
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.errors import JaxdistError
    from jaxdist.models import registry

    cfg = mapping.apply(config.load(None, [o for o in overrides if not o.startswith("model.")]), fixture)
    cfg = cfg.replace(model=mapping.model_overrides(overrides))
    mesh = mesh_from_string(cfg.mesh.shape)
    with pytest.raises(JaxdistError, match=named) as e:
        registry.of(cfg.model).validate(cfg, {a: int(n) for a, n in mesh.shape.items()})
    assert "\n" not in str(e.value)


def assert_same_greedy(tokens, ref_tokens, gaps, tol: float, what: str = "greedy tokens") -> int:
    """Greedy tokens of two differently compiled programs compared without flaking on a near-tie: per row,
    the tokens must equal the reference's at every position before the first whose top-1/top-2 gap (`gaps`,
    greedy_gaps along the reference's path) is below 2 * tol, where tol bounds how far each program's
    logits may lie from those the gaps came from (then the argmax cannot differ). From a near-tie on
    nothing is asserted (either choice is right and the paths part). Fails when every row starts with a
    near-tie (it would check nothing). Prints and returns the number of positions checked."""
    tokens, ref_tokens, gaps = np.asarray(tokens), np.asarray(ref_tokens), np.asarray(gaps)
    assert tokens.shape == ref_tokens.shape == gaps.shape, (tokens.shape, ref_tokens.shape, gaps.shape)
    margin, checked, smallest = 2 * tol, 0, np.inf
    for k, (row, ref, gap) in enumerate(zip(tokens, ref_tokens, gaps)):
        tie = gap < margin
        n = int(np.argmax(tie)) if tie.any() else len(gap)
        assert row[:n].tolist() == ref[:n].tolist(), f"{what}, row {k}: {row.tolist()} != {ref.tolist()}"
        checked, smallest = checked + n, min(smallest, float(gap[:n].min(initial=np.inf)))
    assert checked > 0, f"{what}: every row starts with a near-tie (top-2 gap < {margin:g}); nothing was checked"
    print(
        f"{what}: {checked} of {tokens.size} positions checked (margin {margin:g}); smallest top-2 gap {smallest:.4g}"
    )
    return checked


def peft_lora_reference(fixture: Path, peft_fixture: Path, overrides: list[str], mesh_text: str) -> dict:
    """A peft-written adapter (`peft_fixture`: adapter files + reference.npz) read onto the Hugging Face
    base `fixture` imported on `mesh_text`: the LoRA program's logits, loss and adapter gradients on the
    reference's sequences in one compile (the families' LoRA-vs-peft tests share it)."""
    import jax.numpy as jnp

    from jaxdist.adapters import peft_read
    from jaxdist.adapters import tree as adapters
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.parallel.loss import logits as head_logits
    from jaxdist.training import step

    plain_cfg = mapping.hf_config(None, overrides, fixture, mesh_text)
    lora, read = peft_read.read_tree(peft_fixture, plain_cfg.model)
    cfg, mesh = plain_cfg.replace(lora=lora), mesh_from_string(mesh_text)
    prog = step.build_program(cfg, mesh)
    base, model = tensors.import_params(fixture, plain_cfg, mesh)
    # peft's adapter covers every adapted matrix and a float32 base is stored as imported: the LoRA
    # parameters are the two trees side by side (no compile of the state's initialisation)
    read = jax.device_put(read, adapters.trainable(prog.state_shardings.params))
    params = adapters.combine(read, base)
    assert jax.tree.structure(params) == jax.tree.structure(prog.abstract_state.params)
    ref = dict(np.load(peft_fixture / "reference.npz"))

    def loss(trained, frozen, tokens):
        logits = head_logits(prog.apply_fn(adapters.combine(trained, frozen), tokens)[0])
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean(), logits

    with prog.activate():
        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            adapters.trainable(params), adapters.frozen(params), jnp.asarray(ref["sequences"])
        )
    return dict(cfg=cfg, params=params, ref=ref, loss=float(value), logits=np.asarray(logits), grads=grads,
                model=model, mesh=mesh, base=base)  # fmt: skip


def assert_lora_matches_peft(got: dict, base_logits, m=None) -> dict:
    """`peft_lora_reference`'s run against peft's reference.npz: the adapter moves the logits (by over 1000x
    the bound), the logits equal peft's to 1e-5 of the largest, the mean next-token cross-entropy to a
    relative 1e-5, and each adapter tensor's gradient has torch's norm (relative 1e-5) and torch's dot
    product with the tensor (1e-5 of the largest), under peft's key names. -> jaxdist's adapters as peft's
    tensors (`m`: the model config, for grouped layers)."""
    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters

    ref, lora = got["ref"], got["cfg"].lora
    tol = 1e-5 * np.abs(ref["logits"]).max()
    assert np.abs(ref["logits"] - base_logits).max() > 1000 * tol  # the adapter matters
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=tol, rtol=0)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    g = peft.tree_tensors(jax.device_get(got["grads"]), lora, m=m)
    w = peft.tree_tensors(jax.device_get(adapters.trainable(got["params"])), lora, m=m)
    keys = [str(k) for k in ref["grad_keys"]]
    assert sorted(g) == keys and ref["grad_norm"].min() > 0
    np.testing.assert_allclose([np.linalg.norm(g[k]) for k in keys], ref["grad_norm"], rtol=1e-5)
    dot = np.array([(g[k].astype(np.float64) * w[k]).sum() for k in keys])
    np.testing.assert_allclose(dot, ref["grad_dot"], rtol=0, atol=1e-5 * np.abs(ref["grad_dot"]).max())
    return w


def assert_qlora_trains(
    fixture: Path,
    peft_fixture: Path,
    overrides: list[str],
    mesh_text: str,
    steps: int = 4,
    targets: str = "q,k,v,o",
    block_size: int = 8,
    also: tuple[str, ...] = (),
):
    """QLoRA (an NF4 base, r=4 on the architecture's `targets`: attention, and gate/up/down on routed experts
    over their bfloat16 weights) from the Hugging Face base `fixture` on `mesh_text`, one compiled train step run `steps` times on learnable rows: the loss falls; every adapted
    matrix is stored as packed NF4 codes (uint8, half the entries) with float32 scales, everything else
    frozen in bfloat16 (experts included) and bit-identical after training; only the adapters moved; the
    trained adapters export to exactly the keys, shapes and dtype of the peft-made adapter of the same
    targets (`peft_fixture`), i.e. the structure of the float-base LoRA's export. `also`: matrices quantised
    beside the targets' (DeepSeek-V3's dense MLP)."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters
    from jaxdist.adapters.lora import SCALE, TARGETS
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.training import step

    lora = [
        "lora.rank=4",
        "lora.alpha=8",
        f"lora.targets=[{targets}]",
        "lora.base_dtype=nf4",
        f"lora.block_size={block_size}",
    ]
    train = ["train.global_batch=8", "optim.lr=0.02", "optim.warmup_steps=0", f"optim.schedule_steps={steps}"]
    cfg = mapping.hf_config(None, [*lora, *train, *overrides], fixture, mesh_text)  # overrides win
    mesh = mesh_from_string(mesh_text)
    prog = step.build_program(cfg, mesh)
    base, _ = tensors.import_params(fixture, cfg.replace(lora=dict(rank=0, base_dtype="float32")), mesh)
    state = prog.state_from_params(base)
    flat = flat_params(state.params)
    codes = {k: v for k, v in flat.items() if k[:-2] + f"{SCALE}']" in flat}
    experts = ("gate", "up", "down")  # the routed experts' targets: their weights stay bfloat16
    assert {k.split("'")[-2] for k in codes} == {TARGETS[t][1] for t in targets.split(",") if t not in experts} | set(
        also
    )
    assert all(v.dtype == np.uint8 for v in codes.values())
    named = flat_params(base)
    assert all(named[k].size == 2 * v.size for k, v in codes.items())  # two NF4 codes per byte
    rest = [v for k, v in flat.items() if k not in codes and "lora" not in k and SCALE not in k]
    assert rest and all(v.dtype == jnp.bfloat16 for v in rest)  # experts, norms, embedding, head
    frozen_before = jax.device_get(adapters.frozen(state.params))
    adapters_before = flat_params(adapters.trainable(state.params))
    losses = []
    with prog.activate():
        for tokens in learnable_batches(cfg, steps):
            state, metrics = prog.train_step(state, jax.device_put(tokens, prog.batch_sharding))
            losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses
    after = jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(adapters.frozen(after))):
        np.testing.assert_array_equal(a, b)
    moved = flat_params(adapters.trainable(after))
    assert all(not np.array_equal(moved[k], v) for k, v in adapters_before.items() if k.endswith("_lora_b']"))
    written = peft.tree_tensors(adapters.trainable(after), cfg.lora, m=cfg.model)
    original = load_file(str(peft_fixture / "adapter_model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in written.items()} == {k: (v.shape, v.dtype) for k, v in original.items()}
    return losses


def assert_export_is_peft_file(written_dir, peft_dir) -> tuple[dict, dict]:
    """A PEFT export in `written_dir` is peft's own in `peft_dir`: the same tensor names, each bit for bit, and
    the config's target_modules, r and lora_alpha. Returns (ours, theirs) adapter_config.json dicts."""
    from safetensors.numpy import load_file

    written = load_file(str(Path(written_dir) / "adapter_model.safetensors"))
    original = load_file(str(Path(peft_dir) / "adapter_model.safetensors"))
    assert sorted(written) == sorted(original)
    for k, v in original.items():
        np.testing.assert_array_equal(written[k], v)
    ours = json.loads((Path(written_dir) / "adapter_config.json").read_text())
    theirs = json.loads((Path(peft_dir) / "adapter_config.json").read_text())
    assert sorted(ours["target_modules"]) == theirs["target_modules"]
    assert (ours["r"], ours["lora_alpha"]) == (theirs["r"], theirs["lora_alpha"])
    return ours, theirs


class SignalOnLine:
    """A stdout that sends `sig` to this process once, as a written text matches `when` (a str -> bool): a
    real signal at a chosen point of an in-process `main`, through the handler main installs."""

    def __init__(self, out, when, sig):
        self.out, self.when, self.sig, self.sent = out, when, sig, False

    def write(self, text):
        n = self.out.write(text)
        if not self.sent and self.when(text):
            self.sent = True
            os.kill(os.getpid(), self.sig)
        return n

    def __getattr__(self, name):
        return getattr(self.out, name)
