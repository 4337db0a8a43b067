"""Work per train step read from the compiled program (issue 42; scripts/memory/step_work.py measures it at
the Llama-3-8B shape): matmul FLOPs with loop bodies times their trip counts, the blockwise loss's
passes over the vocabulary, and all-gathers per weight per pass under full remat."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxdist.analysis import measure
from jaxdist.distributed import hlo, hlo_work
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.models import flops
from jaxdist.parallel import loss_blocks, matmul

FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)
STEP = dict(compute_dtype="bfloat16", remat="full", loss_block=64)  # 4 blocks of the 256-row vocab


def test_matmul_flops_multiply_loop_bodies_by_their_trips():
    """A scan of 5 (8x16)@(16x4) matmuls: 5 x 2·8·16·4 FLOPs; XLA's cost_analysis counts the body once."""

    def f(x, ws):
        return jax.lax.scan(lambda c, w: (c + x @ w, None), jnp.zeros((8, 4)), ws)[0]

    compiled = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((5, 16, 4))).compile()
    assert hlo_work.matmul_flops(compiled.as_text()) == 5 * 2 * 8 * 16 * 4


@pytest.fixture(scope="module")
def programs(small_cfg):
    """fsdp=8 train steps' optimized HLO: blockwise keeping its logits (the default), blockwise
    recomputing them, naive."""
    mesh = mesh_mod.mesh_from_string("fsdp=8")
    out = Programs()
    for name, extra in {"keep": {}, "recompute": dict(loss_keep_mib=0), "naive": dict(loss_impl="naive")}.items():
        cfg = small_cfg.replace(model={**STEP, **extra})
        compiled = measure.compile_train_step(cfg, mesh, FAST_COMPILE)
        out[name], out.temp[name] = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
    return out


class Programs(dict):
    """name -> optimized HLO text, and `temp`: name -> temp bytes per device."""

    def __init__(self):
        super().__init__()
        self.temp = {}


def test_kept_logits_leave_no_second_pass_over_the_vocabulary(small_cfg, programs):
    """Keeping the forward's logits removes exactly one matmul over the vocabulary (2·N·D·V per device,
    N its tokens) from the recomputing step, and leaves the naive loss's three passes."""
    m = small_cfg.model
    tokens = small_cfg.train.global_batch * m.seq_len // 8
    one_pass = 2 * tokens * m.d_model * m.vocab_size
    flops = {k: hlo_work.matmul_flops(v) for k, v in programs.items()}
    assert flops["recompute"] - flops["keep"] == one_pass
    assert flops["keep"] == flops["naive"]


def test_no_matmul_flops_beyond_full_remat(small_cfg, programs):
    """The kept-logits step computes exactly full remat's matmuls (forward, backward, each layer's
    recomputed forward less w_down, attention's four passes: models.flops.full_remat_flops_per_token):
    no pass over the vocabulary or the layers beyond them; the recomputing loss adds one pass over V
    (2·N·D·V per device, N its tokens) and nothing else. At the Llama-3-8B shape the same count is
    scripts/memory/step_work.py's remat_flops (docs/performance.md)."""
    m = small_cfg.replace(model=STEP).model
    tokens = small_cfg.train.global_batch * m.seq_len // 8
    remat = flops.full_remat_flops_per_token(m) * tokens
    assert hlo_work.matmul_flops(programs["keep"]) == remat
    assert hlo_work.matmul_flops(programs["recompute"]) == remat + 2 * tokens * m.d_model * m.vocab_size


def test_kept_logits_are_kept_in_the_compute_dtype(small_cfg, programs):
    """Under bf16 compute the forward's loop over the vocabulary keeps each block's logits as bf16 (a
    bf16 matmul's own values, so the backward reads what a recompute would give), stored as their bits:
    the kept stack (blocks, tokens, shards, rows) passes through every while loop as uint16, never as
    float32 (kept as bf16, XLA:CPU slices it in float32 and converts the whole stack around the loops:
    at the Llama-3-8B shape two 525 MB copies). Its temp is not compared with the recomputing step's:
    that one gathers the head again for its backward, this one does not."""
    m = small_cfg.model
    stack = (
        f"[{m.vocab_size // STEP['loss_block']},{small_cfg.train.global_batch * m.seq_len // 8},1,{STEP['loss_block']}]"
    )
    loops = [line for line in programs["keep"].splitlines() if " while(" in line]
    kept = {dtype for line in loops for dtype in ("bf16", "u16", "f32") if f"{dtype}{stack}" in line}
    assert kept == {"u16"}, (stack, kept)  # as its bits (loss._to_bits), in the forward's and the backward's loops


def gathers(text: str) -> dict[str, int]:
    """All-gather launches per step by what they gather and the pass they run in."""
    out = {}
    for c in hlo.per_step(hlo.collectives(text)):
        if c.kind != "all-gather":
            continue
        what = next((s for s in (loss_blocks.HEAD_GATHER, matmul.WEIGHT_GATHER) if f"/{s}/" in c.line), "other")
        when = "backward" if re.search(r'op_name="[^"]*transpose\(', c.line) else "forward"
        out[f"{what} {when}"] = out.get(f"{what} {when}", 0) + c.count
    return out


def test_one_gather_per_weight_per_pass(small_cfg, programs):
    """Under full remat each layer gathers its 7 matrices once in the forward and once in the backward,
    whose recompute's copies serve the input gradients too (before: 11 matrix and 4 norm gathers per
    layer in the backward); the head (one chunk here) once per step: with its logits kept, the loss's
    forward computes the input gradient and its backward needs no head (recomputing them, the backward
    gathers it again); the norm scales are replicated (mesh rule `norm`), so nothing gathers them."""
    L = small_cfg.model.num_layers
    got = gathers(programs["keep"])
    assert got.pop(f"{loss_blocks.HEAD_GATHER} forward") == 1
    assert f"{loss_blocks.HEAD_GATHER} backward" not in got
    recompute = gathers(programs["recompute"])
    assert recompute[f"{loss_blocks.HEAD_GATHER} forward"] == recompute[f"{loss_blocks.HEAD_GATHER} backward"] == 1
    assert got.pop(f"{matmul.WEIGHT_GATHER} forward") == got.pop(f"{matmul.WEIGHT_GATHER} backward") == 7 * L
    # what is left: the token ids' gather (the embedding lookup), once
    assert got == {"other forward": 1}


def test_sharded_norm_scales_are_gathered_once_per_pass(small_cfg):
    """`mesh.rules.norm=[fsdp]` shards the scales again: 2 per layer and pass, + the final norm's (kept
    for its backward); the rule is what removes them, not a lost gather."""
    cfg = small_cfg.replace(model=STEP, mesh={"rules": {"norm": ["fsdp"]}})
    compiled = measure.compile_train_step(cfg, mesh_mod.mesh_from_string("fsdp=8"), FAST_COMPILE)
    got, L = gathers(compiled.as_text()), small_cfg.model.num_layers
    assert {k: v for k, v in got.items() if k.startswith("other")} == {
        "other forward": 2 * L + 2,
        "other backward": 2 * L,
    }
