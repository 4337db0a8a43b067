"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): orthogonalised
momentum on the layers' weight matrices, AdamW on everything else.

Per matrix W (fan_in A × fan_out B; a stacked layer, expert or pipeline stage is a separate matrix):

    M ← M + (1 − μ)(G − M)                       momentum (torch's `buf.lerp_(grad, 1 − μ)`)
    U = G + μ(M − G)  (Nesterov; else U = M)
    O = NS₅(U / max(‖U‖_F, 1e-7))                 5 quintic Newton–Schulz steps, (a, b, c) = (3.4445, −4.7750, 2.0315)
    W ← W − lr·(s·O + wd·W)                       s = 0.2·√max(A, B) (match_rms_adamw) or √max(1, B/A) (original)

This is `torch.optim.Muon` step for step (its `weight` is (out, in) = Wᵀ, and NS(Xᵀ) = NS(X)ᵀ;
tests/test_optimizers.py checks it against a fixture torch made, scripts/fixtures/make_muon_fixture.py); torch
runs NS in bfloat16, this in the parameters' float32. Which tensors are matrices is read from their
logical axis names (`matrix_axes`): embeddings, head, norms, biases and the MoE router go to AdamW.

Not `optax.contrib.muon` (0.2.8), checked: its Nesterov term bias-corrects the momentum and the
gradient by different factors (another direction than torch's from step 2 on), its non-matrix branch
is NAdam with Muon's eps and no weight decay rather than jaxdist's AdamW, and its partition state is
not what `optax.tree_map_params` can shard.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdist.distributed.sharding import constrain, current_rules, logical_to_spec

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's defaults)
NS_EPS = 1e-7  # the norm is clamped at this before NS (torch.optim.Muon's eps)
RMS = 0.2  # match_rms_adamw: the update's RMS ≈ AdamW's (Moonlight)
STACKED = ("layers", "stage", "expert")  # leading axes of independent matrices
HEADS = ("heads", "kv_heads")  # (heads, head_dim) is one side of a projection matrix


def path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def matrix_axes(key: str, names: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(stacked, fan-in, fan-out) axis indices of a tensor Muon takes, or None (it goes to AdamW).

    A Muon matrix has exactly two sides once the stacked axes are set aside, (heads, head_dim) being
    one side; neither side is the vocabulary (embedding, head), and it is not the MoE router (whose
    expert axis has no logical name)."""
    if None in names or "router" in key:
        return None
    stacked, sides = [], []
    for i, n in enumerate(names):
        if n in STACKED:
            stacked.append(i)
        elif n == "head_dim" and sides and names[sides[-1][-1]] in HEADS:
            sides[-1].append(i)
        else:
            sides.append([i])
    if len(sides) != 2 or any(names[i] == "vocab" for side in sides for i in side):
        return None
    return tuple(stacked), tuple(sides[0]), tuple(sides[1])


def labels(names_tree) -> dict:
    """'muon' or 'adamw' per tensor of a params-shaped tree of logical names."""
    return jax.tree_util.tree_map_with_path(
        lambda p, n: "muon" if matrix_axes(path_key(p), n) else "adamw",
        names_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def update_scale(fan_in: int, fan_out: int, scale: str) -> float:
    """The factor on the orthogonalised update (torch's `adjust_lr_fn`, with A, B = out, in)."""
    if scale == "match_rms_adamw":
        return RMS * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def newton_schulz(x_NAB, steps: int, keep=lambda x: x, coeffs=NS_COEFFS, eps: float = NS_EPS):
    """≈ U Vᵀ of each x = U S Vᵀ of the stack by `steps` quintic iterations, in x's dtype (torch's
    `_zeropower_via_newtonschulz`, batched). `keep` re-applies the stack's sharding after each step."""
    a, b, c = coeffs
    tall = x_NAB.shape[1] > x_NAB.shape[2]
    x = jnp.swapaxes(x_NAB, 1, 2) if tall else x_NAB
    x = keep(x / jnp.maximum(jnp.linalg.norm(x, axis=(1, 2), keepdims=True), eps))
    for _ in range(steps):
        gram = jnp.einsum("nab,ncb->nac", x, x)
        poly = b * gram + c * jnp.einsum("nab,nbc->nac", gram, gram)
        x = keep(a * x + jnp.einsum("nab,nbc->nac", poly, x))
    return jnp.swapaxes(x, 1, 2) if tall else x


def split_axes(names: tuple, rules, mesh) -> set[str]:
    """The mesh axes (size > 1, not manual) that split each matrix of a parameter with `names`."""
    spec, manual = logical_to_spec(names, rules), set(getattr(mesh, "manual_axes", ()))
    return {
        a
        for name, entry in zip(names, spec)
        if name not in STACKED and entry is not None
        for a in ((entry,) if isinstance(entry, str) else entry)
        if mesh.shape[a] > 1 and a not in manual
    }


def whole_matrices_axis(n: int, names: tuple, rules, mesh) -> str | None:
    """The axis a stack of `n` matrices is split over while Newton–Schulz runs (each matrix whole):
    the one mesh axis that splits the matrices, when n divides over it (DistMuon's split: 2
    all-to-alls of the shard per step, there and back). None: each matrix is gathered whole on every
    device (one all-gather; two axes split it, e.g. fsdp x tp, which XLA cannot move onto the stack
    without gathering everything, or n does not divide), or nothing splits it."""
    split = split_axes(names, rules, mesh)
    if len(split) == 1 and n % mesh.shape[next(iter(split))] == 0:
        return next(iter(split))
    return None


def spread(n: int, names: tuple):
    """The sharding constraint that holds whole matrices on each device for Newton–Schulz
    (`whole_matrices_axis`). Left to itself the partitioner keeps a matrix split as its parameter is and
    re-gathers it for each iteration's matmuls (2-3 all-gathers per iteration). Outside a mesh context
    an identity."""
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    if mesh.empty or rules is None:
        return lambda x: x
    target = P(whole_matrices_axis(n, names, rules, mesh), None, None)
    return lambda x: jax.lax.with_sharding_constraint(x, target)


def orthogonalize(x, axes, steps: int, scale: str, names: tuple = ()):
    """Each matrix of `x` (stacked axes batched) orthogonalised and scaled, in `x`'s layout; `names`:
    its logical names (how it is sharded)."""
    stacked, fan_in, fan_out = axes
    order = stacked + fan_in + fan_out
    size = lambda idx: math.prod(x.shape[i] for i in idx)
    keep = spread(size(stacked), names)
    flat = keep(x.transpose(order).reshape(size(stacked), size(fan_in), size(fan_out)))
    o = newton_schulz(flat, steps, keep) * update_scale(size(fan_in), size(fan_out), scale)
    return o.reshape([x.shape[i] for i in order]).transpose([order.index(i) for i in range(x.ndim)])


class MuonState(NamedTuple):
    mu: optax.Updates  # the momentum, one float32 per matrix entry


def scale_by_muon(
    axes_by_key: dict, names_by_key: dict, momentum: float, nesterov: bool, steps: int, scale: str
) -> optax.GradientTransformation:
    """Momentum, Nesterov, Newton–Schulz and the update scale on the tensors `axes_by_key` names (the
    others are optax.MaskedNode under optax.partition and pass untouched); `names_by_key`: their
    logical names, which shard the momentum and the update as the parameter."""

    def init(params):
        return MuonState(mu=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        # The momentum and the update stay sharded as their parameter (the partitioner would otherwise
        # carry Newton–Schulz's whole-matrix layout into the rest of the step).
        held = lambda tree: jax.tree_util.tree_map_with_path(lambda p, x: constrain(x, names_by_key[path_key(p)]), tree)
        mu = held(jax.tree.map(lambda m, g: m + (1 - momentum) * (g - m), state.mu, updates))
        u = jax.tree.map(lambda g, m: g + momentum * (m - g), updates, mu) if nesterov else mu
        ortho = lambda k, x: orthogonalize(x, axes_by_key[k], steps, scale, names_by_key[k])
        return held(jax.tree_util.tree_map_with_path(lambda p, x: ortho(path_key(p), x), u)), MuonState(mu=mu)

    return optax.GradientTransformation(init, update)


def muon(cfg, lr_schedule, names_tree, adamw: optax.GradientTransformation) -> optax.GradientTransformation:
    """Muon (decoupled weight decay, the LR schedule) on the matrices of `names_tree`, `adamw` on the rest."""
    names = {
        path_key(p): n
        for p, n in jax.tree_util.tree_flatten_with_path(names_tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    }
    axes = {k: matrix_axes(k, n) for k, n in names.items()}
    matrices = optax.chain(
        scale_by_muon(
            {k: a for k, a in axes.items() if a},
            names,
            cfg.muon_momentum,
            cfg.muon_nesterov,
            cfg.muon_ns_steps,
            cfg.muon_scale,
        ),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(lr_schedule),
    )
    return optax.partition({"muon": matrices, "adamw": adamw}, labels(names_tree))
