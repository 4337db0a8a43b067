"""Static schedule tables (parallel/schedules.py) and what the table-driven pipeline (parallel/pipeline_1f1b.py)
costs in memory. Equivalence with the single-device run is in test_pipeline.py."""

import jax
import numpy as np
import pytest
from conftest import MICRO_ARGS, compiled_gradients

from jaxdist import checkpoint, config
from jaxdist.checkpoint import restage
from jaxdist.data import loader as loader_mod
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.parallel import pipeline, schedule_buffers, schedule_registry, schedules
from jaxdist.training import step

NAMES = (("1f1b", 1), ("1f1b_paired", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2))
GRID = [(name, P, M, V) for P in (2, 4) for M in (P, 2 * P, 8, 16) for name, V in NAMES]


@pytest.mark.parametrize(
    "name, P, M, V", GRID + [("gpipe", 4, 8, 1), ("1f1b", 4, 2, 1), ("1f1b", 3, 5, 1), ("zb_h1", 3, 5, 1)]
)
def test_table_invariants(name, P, M, V):
    """Every F and B of every (stage, chunk, micro-batch) exactly once, in dependency order (check());
    the bubble and the inputs each stage keeps: 1F1B (P-1)/(M+P-1) idle with at most P - s micro-batches
    in flight at stage s; interleaved (P-1)/(V M+P-1); GPipe keeps all M; zb_h1 every F, B and W once
    (no F on the last stage), at most P + 1 micro-batches between F and W, and less than 1F1B's
    bubble at M >= P (at most a third of it where M >= 2P, P=4); zb_v at most 2P chunk micro-batches.
    The planner's buffer sizes (schedule_buffers.sizes, no placement) are the executor's (buffers)."""
    t = schedule_registry.get(name).table(P, M, V)
    schedules.check(t)
    flight = schedule_buffers.in_flight(t)
    bufs = schedule_buffers.buffers(t)
    assert schedule_buffers.sizes(t) == schedule_buffers.Sizes(bufs.x_size, bufs.g_size)
    if name == "1f1b":
        assert t.slots == 2 * (M + P - 1)
        assert t.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))
        np.testing.assert_array_equal(flight, [min(P - s, M) for s in range(P)])
        assert schedule_buffers.buffers(t).x_size <= P  # stage inputs kept, whatever M is
    if name == "1f1b_paired":  # one forward and one backward per slot
        assert t.slots == M + 2 * P - 2
        assert t.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))
        np.testing.assert_array_equal(flight, [min(2 * (P - s) - 1, M) for s in range(P)])
        assert schedule_buffers.buffers(t).x_size <= max(2 * P - 3, 1)
    if name == "interleaved_1f1b":
        assert t.bubble_fraction == pytest.approx((P - 1) / (V * M + P - 1))
        assert flight[0] == min((V - 1) * P + 2 * (P - 1) + 1, V * M)  # Megatron's warm-up + 1
    if name == "gpipe":
        np.testing.assert_array_equal(flight, M)
    if name == "zb_h1":
        assert t.split_backward and t.loss_without_forward
        assert ((t.kind == schedules.WGT).sum(axis=(0, 2)) == M).all()
        assert (flight <= P + 1).all() and flight[-1] == min(2, M)
        one = (P - 1) / (M + P - 1)  # 1F1B's
        assert t.bubble_fraction < one
        if P == 4 and M >= 2 * P:
            assert t.bubble_fraction <= one / 3
    if name == "zb_v":  # the V: stage s holds virtual stages s and 2P-1-s, the loss on stage 0's chunk 1
        assert t.placement == "v" and t.last == (0, 1) and t.split_backward and t.loss_without_forward
        per = lambda k: (t.kind == k).sum(axis=(0, 2))
        np.testing.assert_array_equal(per(schedules.FWD), [M] + [2 * M] * (P - 1))  # no F at the loss chunk
        np.testing.assert_array_equal(per(schedules.BWD), 2 * M)
        np.testing.assert_array_equal(per(schedules.WGT), 2 * M)
        assert (flight <= 2 * P).all()  # chunk micro-batches (half a stage each): 1F1B's P stage ones
        if M >= 2 * P:  # stage 0 fills its 2P, its loss chunk's B counted (it once ran 2P + 1)
            assert flight[0] == 2 * P
        one = (P - 1) / (M + P - 1)
        assert t.bubble_fraction < one
        if P == 4 and M >= 2 * P:
            assert t.bubble_fraction <= min(one / 3, schedule_registry.get("zb_h1").table(P, M).bubble_fraction)


def test_lockstep_time():
    """Step time when all stages wait for the slowest at every slot, F = 1 and B = 3 (the backward
    recomputes the stage): 1F1B on one lane pays B in almost every slot, 2(M+P-1)·3 minus its few
    forward-only slots; paired slots cost F + B and match GPipe's (M+P-1)(F+B)."""
    P, M = 4, 8
    one, paired, gpipe = (schedule_registry.get(n).table(P, M) for n in ("1f1b", "1f1b_paired", "gpipe"))
    assert schedules.lockstep_time(gpipe, 1, 3) == (M + P - 1) * 4 == 44
    assert schedules.lockstep_time(paired, 1, 3) == 44
    assert schedules.lockstep_time(one, 1, 3) == 58  # 2(M+P-1) slots, 4 of them forward-only: 18·3 + 4


def test_check_catches_a_broken_table():
    """check() fails on a table with a backward before its gradient arrived and on a missing action."""
    t = schedule_registry.get("1f1b").table(2, 2)
    kind = t.kind.copy()
    t_b0 = int(np.flatnonzero(kind[:, 0, 0] == schedules.BWD)[0])
    swapped = schedules.Table(2, 2, 1, np.roll(kind, -1, axis=0), t.chunk, np.roll(t.mb, -1, axis=0))
    with pytest.raises(AssertionError):
        schedules.check(swapped)
    kind[t_b0, 0, 0] = schedules.IDLE
    with pytest.raises(AssertionError, match="missing"):
        schedules.check(schedules.Table(2, 2, 1, kind, t.chunk, t.mb))


def test_zb_h1_at_p4_m8():
    """The bench point (P=4, M=8): 26 slots of 24 actions on stages 0..2 (F, B, W of 8 micro-batches) and
    16 on the last (B, W): stage 0 idles 2 of 26 slots against 1F1B's 6 of 22, 0.28x (the issue asks
    <= 0.4x); its buffers keep 5 stage inputs and 4 arrived gradients (1F1B: 4 and 1), the price of
    deferring W. The first W's of stage 0 wait behind F's and B's: they fill the cool-down."""
    t = schedule_registry.get("zb_h1").table(4, 8)
    one = schedule_registry.get("1f1b").table(4, 8)
    assert t.slots == 26 and (t.kind != schedules.IDLE).sum(axis=(0, 2)).tolist() == [24, 24, 24, 16]
    assert t.bubble_fraction == pytest.approx(2 / 26) and one.bubble_fraction == pytest.approx(6 / 22)
    assert t.bubble_fraction / one.bubble_fraction == pytest.approx(0.282, abs=1e-3)
    bufs = schedule_buffers.buffers(t)
    assert (bufs.x_size, bufs.g_size) == (5, 4)
    row0 = t.render().splitlines()[0].split()
    assert row0[1:8] == ["F0", "F1", "F2", "F3", "F4", ".", "B0"] and row0[-3:] == ["B7", "W7", "."]
    # lock-step time with F = 1, B = W = 2 (each recomputes the chunk's forward) against 1F1B's F = 1, B = 3:
    # 26 slots, 3 of them forward-only (23·2 + 3), against 18·3 + 4
    assert schedules.lockstep_time(t, 1, 2, 2) == 49 < schedules.lockstep_time(one, 1, 3) == 58


def test_check_catches_a_broken_zb_table():
    """check() fails on a zb_h1 table with a W before its B, with a W missing, and with an F on the last
    stage put back (its B would compute the loss twice)."""
    t = schedule_registry.get("zb_h1").table(2, 4)
    schedules.check(t)
    table = lambda kind, mb: schedules.Table(2, 4, 1, kind, t.chunk, mb)
    w0 = np.argwhere((t.kind == schedules.WGT) & (t.mb == 0))[0]
    b0 = np.argwhere((t.kind == schedules.BWD) & (t.mb == 0) & (np.arange(2)[None, :, None] == w0[1]))[0]
    kind, mb = t.kind.copy(), t.mb.copy()  # swap stage w0[1]'s B0 and W0
    kind[tuple(w0)], kind[tuple(b0)] = schedules.BWD, schedules.WGT
    with pytest.raises(AssertionError, match="before its B"):
        schedules.check(table(kind, mb))
    kind = t.kind.copy()
    kind[tuple(w0)] = schedules.IDLE
    with pytest.raises(AssertionError, match="missing"):
        schedules.check(table(kind, mb))
    kind = t.kind.copy()
    idle_last = np.argwhere(kind[:, 1, 0] == schedules.IDLE)[0, 0]
    kind[idle_last, 1, 0] = schedules.FWD
    with pytest.raises(AssertionError, match="missing|extra"):
        schedules.check(table(kind, mb))


def test_zb_v_at_p4_m8():
    """The bench point (P=4, M=8): 51 slots of half-stage actions; stage 0 runs 40 (F of chunk 0, B and W
    of both) and idles 3: bubble 3/51 = 0.059, 0.22x 1F1B's 6/22 and 0.76x zb_h1's 2/26. The V turns at
    stage P-1 (its chunk 0 feeds its own chunk 1) and the loss is on stage 0. Its buffers keep 9 stage
    inputs and 6 arrived gradients of half a stage's layers each (zb_h1: 5 and 4 of a whole stage; 10
    inputs before stage 0 kept one of its 2P for the loss chunk's B)."""
    t = schedule_registry.get("zb_v").table(4, 8)
    one = schedule_registry.get("1f1b").table(4, 8)
    assert t.slots == 51 and (t.kind != schedules.IDLE).sum(axis=(0, 2)).tolist() == [40, 48, 48, 48]
    assert t.bubble_fraction == pytest.approx(3 / 51)
    assert t.bubble_fraction / one.bubble_fraction == pytest.approx(0.216, abs=1e-3)
    bufs = schedule_buffers.buffers(t)
    assert (bufs.x_size, bufs.g_size) == (9, 6)
    assert (bufs.arrive[("x", "own")][:, 3] >= 0).sum() == 8  # the turn: stage 3's chunk 0 feeds its chunk 1
    assert (bufs.arrive[("x", "own")][:, :3] < 0).all() and (bufs.arrive[("x", "up")] >= 0).sum() == 3 * 8
    rows = t.render().splitlines()
    assert rows[0].split()[1:10] == ["F0/0", "F1/0", "F2/0", "F3/0", "F4/0", "F5/0", "F6/0", "B0/1", "W0/1"]
    assert rows[3].split()[4:8] == ["F0/0", "F0/1", "F1/0", "F1/1"]


def test_check_catches_a_broken_zb_v_table():
    """check() fails on a zb_v table read as circular (its chunk 1 then runs in the wrong direction), with
    stage P-1's chunk 1 forward moved before its chunk 0 forward (the turn), and with a B missing."""
    t = schedule_registry.get("zb_v").table(2, 4)
    schedules.check(t)
    table = lambda kind, mb, placement="v": schedules.Table(2, 4, 2, kind, t.chunk, mb, placement)
    with pytest.raises(AssertionError):
        schedules.check(table(t.kind, t.mb, "ring"))
    f0 = np.argwhere((t.kind == schedules.FWD) & (t.mb == 0) & (t.chunk == 0))[-1]  # stage 1, chunk 0
    f1 = np.argwhere((t.kind == schedules.FWD) & (t.mb == 0) & (t.chunk == 1) & (np.arange(2)[None, :, None] == 1))[0]
    chunk = t.chunk.copy()
    chunk[tuple(f0)], chunk[tuple(f1)] = 1, 0  # swap the two forwards of micro-batch 0 at the turn
    with pytest.raises(AssertionError, match="before its input"):
        schedules.check(schedules.Table(2, 4, 2, t.kind, chunk, t.mb, "v"))
    kind = t.kind.copy()
    kind[tuple(np.argwhere(t.kind == schedules.BWD)[0])] = schedules.IDLE
    with pytest.raises(AssertionError, match="missing"):
        schedules.check(table(kind, t.mb))


def test_render():
    assert schedule_registry.get("1f1b").table(2, 2).render().splitlines() == [
        "s0  F0  F1   .  B0   .  B1",
        "s1   .  F0  B0  F1  B1   .",
    ]
    assert schedule_registry.get("1f1b_paired").table(2, 2).render().splitlines() == [
        "s0      F0      F1      B0      B1",
        "s1       .   F0+B0   F1+B1       .",
    ]


MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)


@pytest.fixture(scope="module")
def temp_bytes(tiny_cfg):
    """Compiled temp bytes per device of the gradient program, pp=2, one sequence per micro-batch
    (the global batch grows with M): schedule -> {M: bytes}."""
    out = {}
    for name in ("gpipe", "1f1b", "1f1b_paired"):
        for M in (2, 8):
            cfg = tiny_cfg.replace(
                model=MODEL, train=dict(global_batch=M), pipeline=dict(schedule=name, microbatches=M)
            )
            prog = step.build_program(cfg, mesh_mod.mesh_from_string("pp=2", jax.devices()[:2]))
            out.setdefault(name, {})[M] = compiled_gradients(prog).memory_analysis().temp_size_in_bytes
    return out


def test_1f1b_activation_memory_is_flat_in_microbatches(temp_bytes):
    """From M=2 to M=8 micro-batches of one sequence: 1F1B's (and paired 1F1B's) temp bytes grow by less than one
    micro-batch's activation (b T D float32 = 8 KiB; only the tokens' int32 copy grows), GPipe's by at
    least one stage input per extra micro-batch (6 x 8 KiB)."""
    act = 1 * MODEL["seq_len"] * MODEL["d_model"] * 4
    growth = {name: by_m[8] - by_m[2] for name, by_m in temp_bytes.items()}
    assert 0 <= growth["1f1b"] < act / 4, temp_bytes
    assert 0 <= growth["1f1b_paired"] < act / 4, temp_bytes
    assert growth["gpipe"] >= 6 * act, temp_bytes


# The smallest MoE the table schedules run with experts (4 experts, top-2, dropless: two capacity tiers),
# the naive loss (the blockwise head's custom VJP is the costliest part of every B branch to compile).
MOE = dict(
    num_layers=2,
    d_model=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=32,
    seq_len=8,
    moe_experts=4,
    moe_topk=2,
    moe_mlp_dim=16,
    loss_impl="naive",
)


@pytest.fixture(scope="module")
def moe_reference(tiny_cfg):
    """One device, one batch: (cfg, initial parameters, tokens, loss, gradients) of the MoE above, shared
    by the schedules compared with it (one compile)."""
    cfg = tiny_cfg.replace(model=MOE)
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1]))
    params = jax.device_get(prog.init_state(0).params)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), dtype=np.int32)
    grads, loss = compiled_gradients(prog)(params, tokens)
    return cfg, params, tokens, float(loss), jax.device_get(grads)


@pytest.mark.parametrize("schedule", ["zb_h1"])  # 1f1b's fused B+W is the same engine: by hand (the docs)
def test_experts_under_table_schedules_equal_one_device(moe_reference, schedule):
    """MoE with ep under a table schedule (issue 47), pp=2,ep=4, dropless, 2 micro-batches: the loss
    (with the balance and z losses: each stage's VJP adds its layers' weighted aux objective) and every
    gradient equal the one-device run's, fp32, to 1e-5 (relative; gradients of each tensor's largest
    entry). zb_h1's B (input gradient) and W (weight gradient) run apart, each with its own expert
    exchange. The dropless tier's pmax spans the expert axes only: inside the per-slot lax.switch the other
    pp rank runs another branch (XLA:CPU aborted after 40 s waiting for it when it spanned pp)."""
    cfg, params0, tokens, ref_loss, ref_grads = moe_reference
    prog = step.build_program(
        cfg.replace(pipeline=dict(schedule=schedule, microbatches=2)), mesh_mod.mesh_from_string("pp=2,ep=4")
    )
    assert prog.pipeline.stages == 2 and schedule_registry.get(schedule).tabled
    params = jax.device_put(pipeline.to_stages(params0, prog.pipeline), prog.state_shardings.params)
    grads, loss = compiled_gradients(prog)(params, jax.device_put(tokens, prog.batch_sharding))
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    grads = pipeline.from_stages(jax.device_get(grads), prog.pipeline)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(np.abs(r).max()))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pipeline=dict(schedule="1f1b", repeats=2)), "needs pipeline.schedule=circular or interleaved_1f1b"),
        (
            dict(model=dict(num_layers=4), pipeline=dict(schedule="interleaved_1f1b", repeats=2, microbatches=3)),
            "microbatches a multiple of pp=2",
        ),
        (dict(model=dict(moe_experts=4), pipeline=dict(schedule="zb_v", repeats=3)), "zb_v runs two chunks per stage"),
    ],
)
def test_errors_name_the_combination(tiny_cfg, overrides, message):
    cfg = tiny_cfg.replace(model=MODEL, train=dict(global_batch=24)).replace(**overrides)
    with pytest.raises(JaxdistError, match=message):
        step.build_program(cfg, mesh_mod.mesh_from_string("pp=2,fsdp=4"))


def test_checkpoints_move_between_schedules(tiny_cfg):
    """The staged layout is the same for gpipe and 1f1b, and for circular and interleaved_1f1b at the same
    repeats, so those resume as they are; another chunk placement at the same pp (gpipe <-> circular <->
    zb_v) stores the same shapes with other layers on each stage, and restage moves every row to its
    place (any pair, both ways)."""
    stack = {"blocks": {"w": np.arange(8)}}
    for a, b, V in (("gpipe", "1f1b", 1), ("circular", "interleaved_1f1b", 2)):
        staged = [pipeline.to_stages(stack, pipeline.Plan(n, 2, 4, V, 8 // (2 * V))) for n in (a, b)]
        np.testing.assert_array_equal(staged[0]["blocks"]["w"], staged[1]["blocks"]["w"])
        assert (
            restage.permutation(pipeline.Plan(a, 2, 4, V, 8 // (2 * V)), pipeline.Plan(b, 2, 4, V, 8 // (2 * V)))
            is None
        )
    saved = {"config": tiny_cfg.replace(pipeline=dict(schedule="gpipe")).to_dict()}
    now = tiny_cfg.replace(pipeline=dict(schedule="zb_v"))
    assert checkpoint.check_config_drift(saved, now, "ckpt") == {"pipeline.schedule": ("gpipe", "zb_v")}
    v = pipeline.to_stages(stack, pipeline.Plan("zb_v", 2, 4, 2, 2))["blocks"]["w"]
    np.testing.assert_array_equal(v, [[0, 1, 6, 7], [2, 3, 4, 5]])  # stage s: groups s and 2P-1-s
    plans = [
        pipeline.Plan("gpipe", 2, 4, 1, 4),
        pipeline.Plan("circular", 2, 4, 2, 2),
        pipeline.Plan("zb_v", 2, 4, 2, 2),
    ]
    for a in plans:
        for b in plans:
            tree = {
                "blocks": {"w": jax.numpy.asarray(pipeline.to_stages(stack, a)["blocks"]["w"])},
                "step": np.int32(3),
            }
            moved = restage.restage(tree, a, b, "ckpt")
            np.testing.assert_array_equal(moved["blocks"]["w"], pipeline.to_stages(stack, b)["blocks"]["w"])


def test_a_checkpoint_saved_under_circular_resumes_under_gpipe_with_every_layer_in_place(tmp_path):
    """The restore path end to end: parameters and AdamW moments (distinct per row) saved under circular
    (V=2) on pp=2,fsdp=4, restored under gpipe and under zb_v, hold each layer's values where that
    schedule's stages expect them. Before restage this resume was let through and mixed layers up."""

    def program(schedule, repeats):
        args = [a for a in MICRO_ARGS if not a.startswith("model.num_layers=")]
        cfg = config.load(
            None, args + ["model.num_layers=4", f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"]
        )
        return cfg, step.build_program(cfg, mesh_mod.mesh_from_string("pp=2,fsdp=4"))

    cfg, prog = program("circular", 2)
    distinct = lambda a: jax.numpy.arange(a.size, dtype=a.dtype).reshape(a.shape) if a.ndim and a.size > 1 else a
    state = jax.jit(lambda s: jax.tree.map(distinct, s), out_shardings=prog.state_shardings)(prog.init_state(0))
    saver = checkpoint.Saver(tmp_path, cfg, log=lambda *a: None)
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    saver.save(state, 1, loader)
    saver.close()

    def layers(state, plan):  # every leaf stored under the stack's key, in the model's layer order
        flat = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
        on_stack = lambda path: any(getattr(k, "key", None) == pipeline.STACK for k in path)
        return {
            jax.tree_util.keystr(p): np.asarray(pipeline.from_stages({"blocks": a}, plan)["blocks"])
            for p, a in flat
            if on_stack(p)
        }

    want = layers(state, prog.pipeline)
    assert len(want) >= 3 * len(jax.tree.leaves(state.params["blocks"]))  # parameters and both AdamW moments
    for schedule, repeats in (("gpipe", 1), ("zb_v", 2)):
        cfg2, prog2 = program(schedule, repeats)
        allowed = frozenset({"pipeline.repeats"})  # as --allow-config-change pipeline.repeats
        got = layers(
            checkpoint.restore(tmp_path, prog2, loader, cfg2, log=lambda *a: None, allowed=allowed).state,
            prog2.pipeline,
        )
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{schedule} {k}")


def test_registry_covers_exactly_the_schedules_config_accepts():
    """One entry per pipeline.schedule value, both ways; the table schedules (an engine) are the ones the
    planner models by their table; an unknown name is a one-line error."""
    import typing

    from jaxdist.config.run_sections import PipelineConfig

    accepted = set(typing.get_args(typing.get_type_hints(PipelineConfig)["schedule"]))
    assert accepted == set(schedule_registry.SCHEDULES)
    assert all(name == s.name for name, s in schedule_registry.SCHEDULES.items())
    assert {n for n, s in schedule_registry.SCHEDULES.items() if s.tabled} == {
        "1f1b",
        "1f1b_paired",
        "interleaved_1f1b",
        "zb_h1",
        "zb_v",
    }
    assert schedule_registry.virtual_names() == "circular or interleaved_1f1b"  # zb_v's 2 chunks are fixed
    with pytest.raises(JaxdistError, match=r"pipeline.schedule='nope' is not one of gpipe, circular, .*; pick one"):
        schedule_registry.get("nope")


def test_no_module_compares_schedule_names():
    """Every decision on pipeline.schedule asks parallel/schedule_registry.py: no other module of jaxdist/
    spells a schedule's name in quotes (config/run_sections.py declares the accepted values), nor keeps a
    tuple of names to test membership in."""
    from pathlib import Path

    pkg = Path(pipeline.__file__).resolve().parent.parent
    names = [f'"{n}"' for n in schedule_registry.SCHEDULES] + [f"'{n}'" for n in schedule_registry.SCHEDULES]
    allowed = {pkg / "parallel" / "schedule_registry.py", pkg / "config" / "run_sections.py"}
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        if path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(n in code for n in names) or "in VIRTUAL" in code or "in SCHEDULES" in code:
                offenders.append(f"{path.relative_to(pkg)}:{i}: {line.strip()}")
    assert offenders == []
