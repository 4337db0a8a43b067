"""Writes tests/fixtures/hlo/cpu_switch.txt: jax's compiled XLA:CPU text of a program whose collectives
sit in conditional branches (tests/test_hlo.py checks the reader's per-step figure on it).

    python scripts/make_hlo_switch_fixture.py

Over 8 devices (axis x): a psum of f32[16] outside any branch; lax.switch over three branches
(0: all_to_all of f32[8,4]; 1: all_to_all of f32[8,16] and a psum of f32[32]; 2: no collective); and a
3-trip fori_loop around lax.cond (true: psum of f32[64]; false: all_gather of f32[4] to f32[32]).
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hlo" / "cpu_switch.txt"


def body(i, a, b, c, d):
    out = jax.lax.psum(a, "x")
    s = jax.lax.switch(
        i[0],
        [
            lambda b, c: jax.lax.all_to_all(b, "x", 0, 0, tiled=True).sum() + c.sum(),
            lambda b, c: (
                jax.lax.all_to_all(c, "x", 0, 0, tiled=True).sum() + jax.lax.psum(c[0, :8].repeat(4), "x").sum()
            ),
            lambda b, c: b.sum() + c.sum(),
        ],
        b,
        c,
    )

    def step(k, acc):
        return jax.lax.cond(
            (i[0] + k) % 2 == 0,
            lambda d: acc + jax.lax.psum(d, "x").sum(),
            lambda d: acc + jax.lax.all_gather(d[:4], "x", tiled=True).sum(),
            d,
        )

    t = jax.lax.fori_loop(0, 3, step, jnp.float32(0))
    return out + s + t


def main() -> None:
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False))
    args = (
        jnp.zeros(1, jnp.int32),
        jnp.zeros(16, jnp.float32),
        jnp.zeros((8, 4), jnp.float32),
        jnp.zeros((8, 16), jnp.float32),
        jnp.zeros(64, jnp.float32),
    )
    OUT.write_text(fn.lower(*args).compile().as_text())
    print(OUT)


if __name__ == "__main__":
    main()
