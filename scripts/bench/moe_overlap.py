"""What overlap of the experts' exchange with compute the compiled schedule shows (issue 47), read from
the scheduled HLO of MoE under a table pipeline schedule.

    python scripts/bench/moe_overlap.py                        # tiny-moe, 2 layers, pp=2,ep=4, 1f1b, M=4
    python scripts/bench/moe_overlap.py --schedule zb_h1 --json out.json

Compiles the gradient stage (`prog.gradients.apply`, the table engine's custom VJP) and reads
`compiled.as_text()`: after XLA's scheduling, each computation's instructions are listed in the order
they run (CPU: one stream per device). For every all-to-all and all-gather (and any async
`*-start` / `*-done` pair) it counts the compute instructions (fusions, dots, custom calls, reduces,
sorts, scatters, gathers) scheduled between the collective and the first instruction that reads its
result, in the same computation, and which computation that is: the table engine runs each slot's
action (one micro-batch's F, B or W on a stage) as one branch of a `lax.switch` inside the slot loop,
so a collective inside a branch can only meet compute of the same micro-batch; the slot loop's body
itself holds the activation/gradient `collective-permute`s, which carry the previous slot's output.

Prints one line per (computation kind, collective), then the totals: collectives, async pairs, those
with any compute between them and their consumer, and those whose computation runs more than one
micro-batch's work (the slot body). XLA_FLAGS as the environment gives (no test flags).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODEL = ["model.num_layers=2", "model.seq_len=32", "train.global_batch=16", "model.moe_dispatch=dropless"]
EXCHANGE = ("all-to-all", "all-gather")
COMPUTE = ("fusion", "dot", "convolution", "custom-call", "reduce", "sort", "scatter", "gather", "reduce-window")
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(")


def computations(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """computation -> its instructions in schedule order as (name, opcode, line); and ENTRY's name."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if m := _COMP.match(line):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and (m := _INSTR.match(line)):
            comps[current].append((m.group(1), m.group(2), line))
    return comps, entry


def kinds(comps: dict, entry: str) -> dict[str, str]:
    """computation -> "entry", "loop body", "branch" (of a conditional) or "other" (fusions, reducers...)."""
    out = {entry: "entry"}
    for instrs in comps.values():
        for _, op, line in instrs:
            if op == "while" and (m := re.search(r"body=%?([\w.\-]+)", line)):
                out.setdefault(m.group(1), "loop body")
            if op == "conditional":
                for b in re.findall(
                    r"%?([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", line) or ["", ""])[1]
                ):
                    out.setdefault(b, "branch")
                for attr in ("true_computation", "false_computation"):
                    if m := re.search(attr + r"=%?([\w.\-]+)", line):
                        out.setdefault(m.group(1), "branch")
    return out


def gaps(instrs: list[tuple[str, str, str]]) -> list[dict]:
    """Each exchange collective (or async start) of one computation: its opcode, the compute
    instructions scheduled before its first reader, and whether it is an async pair."""
    out = []
    for k, (name, op, _) in enumerate(instrs):
        base = op.removesuffix("-start")
        if base not in EXCHANGE and op not in ("collective-permute", "collective-permute-start"):
            continue
        uses = re.compile(r"[%\s(,]" + re.escape(name) + r"[\s),]")
        reader = next((j for j in range(k + 1, len(instrs)) if uses.search(instrs[j][2].split("=", 1)[1])), None)
        between = instrs[k + 1 : reader] if reader is not None else []
        out.append(
            {
                "op": base,
                "async": op.endswith("-start"),
                "compute_between": sum(o in COMPUTE for _, o, _ in between),
                "instructions_between": len(between),
                "compute_ops_between": [o for _, o, _ in between if o in COMPUTE],
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny-moe.yaml")
    p.add_argument("--mesh", default="pp=2,ep=4")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--micro", type=int, default=4, help="pipeline micro-batches M")
    p.add_argument("--json", default="", help="also write the records here")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides (after the defaults)")
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from jaxdist import config
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.training import step

    over = [*MODEL, f"pipeline.schedule={args.schedule}", f"pipeline.microbatches={args.micro}", *args.overrides]
    cfg = config.load(args.config, over)
    prog = step.build_program(cfg, mesh_mod.mesh_from_string(args.mesh))
    fn = jax.jit(
        lambda p, t: prog.gradients.apply(p, t, (), 0)[:2],
        in_shardings=(prog.state_shardings.params, prog.batch_sharding),
    )
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jax.numpy.int32)
    with prog.activate():
        text = fn.lower(prog.abstract_state.params, tokens).compile().as_text()
    comps, entry = computations(text)
    kind = kinds(comps, entry)
    rows = [{"computation": c, "kind": kind.get(c, "other"), **g} for c, instrs in comps.items() for g in gaps(instrs)]
    tally = Counter((r["kind"], r["op"], r["compute_between"] > 0) for r in rows)
    print(f"{args.schedule} {args.mesh} M={args.micro} ({args.config}, {cfg.model.num_layers} layers)")
    for (k, op, overlapped), n in sorted(tally.items()):
        print(
            f"  {k:10s} {op:20s} {'compute before its reader' if overlapped else 'read next (no compute between)':32s} {n}"
        )
    ex = [r for r in rows if r["op"] in EXCHANGE]
    summary = {
        "schedule": args.schedule,
        "mesh": args.mesh,
        "M": args.micro,
        "exchange_collectives": len(ex),
        "async_pairs": sum(r["async"] for r in rows),
        "exchange_with_compute_between": sum(r["compute_between"] > 0 for r in ex),
        "exchange_in_slot_body_or_entry": sum(r["kind"] in ("loop body", "entry") for r in ex),
        "exchange_in_branches": sum(r["kind"] == "branch" for r in ex),
        "max_compute_between": max((r["compute_between"] for r in ex), default=0),
        # a branch is one slot's action: one micro-batch's F, B or W on one stage, so compute scheduled
        # between a branch's collective and its reader is that micro-batch's own
        "exchange_overlapping_another_microbatch": sum(r["kind"] != "branch" and r["compute_between"] > 0 for r in ex),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
