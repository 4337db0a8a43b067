"""MoE auxiliary losses (models/moe.py) against plain numpy written from the published formulas.

The equivalence tests in test_moe.py swap out only the expert FFN and share the aux-loss code with what
they check, so they cannot catch a wrong balance loss. Here numpy recomputes, on fixed router logits:
- the Switch / GShard load-balancing loss (Fedus et al. 2021 eq. 4, top-K as GShard and DeepSeek-V3's
  sequence-wise loss): per sequence L = E · sum_e f_e P_e, f_e = (tokens routed to e) / (K·T),
  P_e = mean over the sequence's tokens of e's router score normalised over experts;
- the router z-loss (ST-MoE, Zoph et al. 2022 eq. 5): (log sum_e exp x_e)^2 per token;
for softmax and sigmoid routers, top-1 and top-2, with and without shared experts; and a gradient test
that one step down the aux loss's gradient lowers the expert-load CV of a skewed router (with the sign
of the balance loss flipped it raises it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models import moe

B, T, D, E = 3, 16, 32, 8


def numpy_aux(logits_BTE, topk, router):
    """-> (token-weighted balance-loss sum, z-loss sum, per-sequence balance losses, counts (B, E))."""
    x = np.asarray(logits_BTE, np.float64)
    if router == "softmax":
        s = np.exp(x - x.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    else:
        s = 0.5 * (1 + np.tanh(x / 2))  # the logistic function, without overflow
    chosen = np.argsort(-s, axis=-1)[..., :topk]  # the K best scores of each token
    counts = np.zeros((x.shape[0], x.shape[2]))
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            counts[b, chosen[b, t]] += 1
    f = counts / (topk * x.shape[1])
    p = (s / s.sum(-1, keepdims=True)).mean(1)
    per_seq = x.shape[2] * (f * p).sum(-1)
    m = x.max(-1)
    lse = m + np.log(np.exp(x - m[..., None]).sum(-1))
    return (x.shape[1] * per_seq).sum(), (lse**2).sum(), per_seq, counts


def make_layer(cfg, router, topk, shared, router_DE, aux_weight=0.01, z_weight=0.001):
    model = dict(
        d_model=D,
        moe_experts=E,
        moe_topk=topk,
        moe_mlp_dim=16,
        moe_router=router,
        moe_shared_experts=shared,
        moe_aux_weight=aux_weight,
        moe_z_weight=z_weight,
    )
    layer = moe.MoE(cfg.replace(model=model).model, nnx.Rngs(0))
    layer.router_DE[...] = jnp.asarray(router_DE, jnp.float32)
    return layer


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    router = rng.normal(scale=0.5, size=(D, E)).astype(np.float32)
    return x, router


@pytest.mark.parametrize(
    "router,topk,shared",
    [("softmax", 1, 0), ("softmax", 2, 0), ("sigmoid", 2, 0), ("sigmoid", 1, 1), ("softmax", 2, 2)],
)
def test_aux_losses_equal_numpy_from_the_papers(tiny_cfg, inputs, router, topk, shared):
    x, router_DE = inputs
    layer = make_layer(tiny_cfg, router, topk, shared, router_DE, aux_weight=0.03, z_weight=0.002)
    _, aux = layer(jnp.asarray(x))
    logits = x.astype(np.float64) @ router_DE.astype(np.float64)
    lb, z, per_seq, counts = numpy_aux(logits, topk, router)
    np.testing.assert_allclose(aux["moe_load"], counts.sum(0))
    np.testing.assert_allclose(aux["moe_aux_loss"], lb, rtol=1e-5)
    np.testing.assert_allclose(aux["moe_z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(aux["objective"], 0.03 * lb + 0.002 * z, rtol=1e-5)
    # The logged figure (summed over layers' mean and divided by the token count) is the mean
    # per-sequence Switch loss: 1 for uniform routing, E at total collapse.
    stats = moe.combine_layers(jax.tree.map(lambda v: jnp.stack([v, v]), aux))
    logged = moe.metrics_from_sums(stats, B * T)
    np.testing.assert_allclose(logged["moe_aux_loss"], per_seq.mean(), rtol=1e-5)
    np.testing.assert_allclose(logged["moe_z_loss"], z / (B * T), rtol=1e-5)
    load = counts.sum(0)
    np.testing.assert_allclose(logged["moe_load_cv"], load.std() / load.mean(), rtol=1e-5)


def test_balance_loss_bounds_at_uniform_and_collapsed_routing():
    """The formula's two ends: equal logits with a balanced top-K give 1; every token on the same K
    experts with all score mass there gives E/K."""
    uniform = jnp.zeros((1, E, E))
    counts = jnp.full((1, E), 1.0)  # top-1 of E tokens spread one per expert
    np.testing.assert_allclose(moe.balance_loss_sum(counts, uniform, 1, "softmax") / E, 1.0, rtol=1e-6)
    collapsed = jnp.zeros((1, T, E)).at[..., :2].set(50.0)
    counts = jnp.zeros((1, E)).at[0, :2].set(T)
    np.testing.assert_allclose(moe.balance_loss_sum(counts, collapsed, 2, "softmax") / T, E / 2, rtol=1e-5)


def load_cv(x, router_DE, topk, router):
    load = numpy_aux(x @ router_DE, topk, router)[3].sum(0)
    return load.std() / load.mean()


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_one_aux_gradient_step_lowers_load_cv(tiny_cfg, router):
    """A router skewed toward two experts (the tokens share a component the router favours, as the
    residual stream does at init; loads 85 227 39 133 2 9 14 3 of 512 top-2 assignments, CV 1.18): one
    step down the aux objective's gradient (balance + z at their default weights), of norm 0.2 in the
    router weights (whose norm is ~1.6), lowers the CV to 0.72-0.76 (measured); with the balance loss's
    sign flipped the same step raises it (1.38 softmax, 1.22 sigmoid)."""
    rng = np.random.default_rng(1)
    shared_D = rng.normal(size=D).astype(np.float32)
    x = (rng.normal(size=(8, 32, D)) + shared_D).astype(np.float32)
    router_DE = rng.normal(scale=0.1, size=(D, E)).astype(np.float32)
    router_DE[:, :2] += 0.05 * shared_D[:, None]
    layer = make_layer(tiny_cfg, router, 2, 0, router_DE)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def objective(params):
        return nnx.merge(graphdef, params, rest)(jnp.asarray(x))[1]["objective"] / x.size * D

    grad = np.asarray(jax.grad(objective)(params)["router_DE"][...])
    before = load_cv(x, router_DE, 2, router)
    after = load_cv(x, router_DE - 0.2 * grad / np.linalg.norm(grad), 2, router)
    assert 1.1 < before < 1.25, before  # skewed: 70% of the assignments on two of eight experts
    assert after < 0.75 * before, (before, after)


def test_aux_objective_is_per_routed_token_whatever_the_loss_mask():
    """The router sees every position, so the aux objective's weight is per routed token (as
    transformers' load_balancing_loss_func with an attention mask): thinning the loss mask leaves its
    gradient and logged value unchanged, while the cross-entropy is still per kept target; unmasked,
    the stage's gradients are bit-identical to the plain objective's (the weight is exactly 1.0)."""
    from jaxdist.data import loss_mask
    from jaxdist.parallel.loss import Head
    from jaxdist.reduce import gradients

    V, Bt, Tt = 16, 4, 8
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "emb": jax.random.normal(keys[0], (V, D)),
        "w": jax.random.normal(keys[1], (D, V)) * 0.1,
        "r": jax.random.normal(keys[2], (D, E)),  # only the aux objective reads it
    }
    ids = np.asarray(jax.random.randint(keys[3], (Bt, Tt + 1), 0, V), np.int32)

    def apply_fn(p, x_BT):
        x_BTD = p["emb"][x_BT]
        aux = jnp.sum(jnp.square(jax.nn.softmax(x_BTD @ p["r"], axis=-1)))  # a sum over routed tokens
        stats = dict(objective=aux, moe_aux_loss=aux, moe_z_loss=aux, moe_dropped=jnp.float32(0))
        return Head(x_BTD, p["w"], "naive"), {**stats, "moe_load": jnp.ones((1, E))}

    stage = gradients.implicit_gradients(apply_fn, microbatches=2)
    run = jax.jit(lambda tokens: stage.apply(params, tokens, (), 0))
    mask = np.ones((Bt, Tt + 1), bool)
    mask[:, 1:6] = False  # 3 of 8 targets kept per row
    full, thin = run(jnp.asarray(ids)), run(jnp.asarray(loss_mask.encode(ids, mask)))
    aux_sum = lambda p: apply_fn(p, jnp.asarray(ids[:, :-1]))[1]["objective"]
    per_routed = jax.grad(aux_sum)(params)["r"] / (Bt * Tt)
    np.testing.assert_allclose(thin[0]["r"], per_routed, rtol=1e-4, atol=1e-7)  # today: x 8/3
    np.testing.assert_allclose(full[0]["r"], per_routed, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(thin[3]["moe_aux_loss"], aux_sum(params) / (Bt * Tt), rtol=1e-6)
    assert float(thin[1]) != pytest.approx(float(full[1]))  # the cross-entropy is over the kept targets

    # unmasked: the weight is exactly 1.0, and the stage's gradients are the old objective's (loss +
    # aux, unweighted: objective_sums' default) over the kept count (x * 1.0 is x; the two programs are
    # compiled apart, so to float32 rounding)
    tokens = jnp.asarray(ids)
    assert float(gradients.aux_scale(tokens)) == 1.0
    one = gradients.implicit_gradients(apply_fn, microbatches=1)
    grads = jax.jit(lambda t: one.apply(params, t, (), 0)[0])(tokens)
    old = jax.jit(jax.grad(lambda p, t: gradients.objective_sums(apply_fn, p, t)[0]))(params, tokens)
    for k in params:
        np.testing.assert_allclose(grads[k], old[k] / (Bt * Tt), rtol=1e-6, atol=1e-9)
