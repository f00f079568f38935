"""The Flax adapters train a small MLP under jit on a device mesh (linen and NNX), for the main presets.

The mesh is 2 x 4 on the 8 CPU devices of the CPU lane and whatever the GPU lane has (tests/lanes.py).

Invariant: a quantized model is still trainable (loss falls), randomness flows from the rng stream, and the
adapters are drop-ins for nn.Dense / nnx.Linear.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import lanes
import mx_reference as ref
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax.ops import NnxQuantDotGeneral, QuantDotGeneral, get_recipe, make_dot_general, mx_dot_general

D_IN, HIDDEN, D_OUT, BATCH, STEPS, LR = 64, 128, 16, 64, 30, 1e-2
PRESETS_TO_TRAIN = ["bf16", "fp8", "mxfp4_full_h16", "mxfp4_full_sr"]


@functools.cache
def _mesh():
    return lanes.mesh_2d(("data", "model"))


@functools.cache
def _task():
    """A synthetic regression task y = tanh(x A) B, the batch sharded over the mesh's "data" axis."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    x[:, 3] *= 10  # an outlier channel
    a = rng.standard_normal((D_IN, 32)).astype(np.float32) / np.sqrt(D_IN)
    b = rng.standard_normal((32, D_OUT)).astype(np.float32)
    y = np.tanh(x @ a) @ b
    batch = NamedSharding(_mesh(), P("data"))
    return jax.device_put(x, batch), jax.device_put(y, batch)


def _replicated(tree):
    return jax.device_put(tree, NamedSharding(_mesh(), P()))


# ----------------------------------------------------------------------------------------------------
# linen


class LinenMLP(nn.Module):
    recipe: str

    @nn.compact
    def __call__(self, x):
        dg = functools.partial(QuantDotGeneral, recipe=self.recipe)
        h = nn.gelu(nn.Dense(HIDDEN, dot_general_cls=dg)(x))
        return nn.Dense(D_OUT, dot_general_cls=dg)(h)


def _train_linen(recipe: str):
    model = LinenMLP(recipe)
    x, y = _task()
    params = _replicated(jax.jit(model.init)(jax.random.key(0), x[:2])["params"])
    tx = optax.adam(LR)
    opt_state = jax.jit(tx.init)(params)
    quant_key = jax.random.key(42)

    @jax.jit
    def step(params, opt_state, step_idx):
        def loss_fn(p):
            pred = model.apply({"params": p}, x, rngs={"quant": jax.random.fold_in(quant_key, step_idx)})
            return jnp.mean((pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(STEPS):
        params, opt_state, loss = step(params, opt_state, i)
        losses.append(float(loss))
    return np.array(losses), params


@pytest.mark.parametrize("recipe", PRESETS_TO_TRAIN)
def test_linen_mlp_trains(recipe):
    losses, _ = _train_linen(recipe)
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_linen_sr_needs_and_uses_the_quant_rng():
    model = nn.Dense(D_OUT, dot_general_cls=functools.partial(QuantDotGeneral, recipe="mxfp4_full_sr"))
    x, _ = _task()
    variables = jax.jit(model.init)(jax.random.key(0), x[:2])
    assert set(variables) == {"params"}
    with pytest.raises(ValueError, match="quant"):
        model.apply(variables, x)

    grad_fn = jax.jit(
        lambda key: jax.grad(lambda v: jnp.sum(model.apply(v, x, rngs={"quant": key}) ** 2))(variables)
    )
    g1, g1b, g2 = (jax.tree.leaves(grad_fn(jax.random.key(seed))) for seed in (1, 1, 2))
    assert all(np.array_equal(a, b) for a, b in zip(g1, g1b, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_linen_init_creates_the_variables_without_tracing_a_quantizer(monkeypatch):
    """init needs shapes only: the amax histories are created, the parameters are the unquantized model's,
    and no quantized GEMM is traced (bind_recipe is never called); apply then quantizes."""
    from fp4jax.ops import flax_adapters

    def no_quantizer(*args, **kwargs):
        raise AssertionError("init traced a quantized GEMM")

    x, _ = _task()
    plain = LinenMLP("bf16").init(jax.random.key(0), x[:2])
    with monkeypatch.context() as patch:
        patch.setattr(flax_adapters, "bind_recipe", no_quantizer)
        out, variables = LinenMLP("fp8_delayed").init_with_output(jax.random.key(0), x[:2])
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), variables["params"], plain["params"])
    assert all(jax.tree.leaves(same))
    histories = jax.tree.leaves(variables["fp8_meta"])
    length = get_recipe("fp8_delayed").fp8_amax_history_len
    assert len(histories) == 6 and all(h.shape == (length,) and not h.any() for h in histories)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(LinenMLP("bf16").apply(plain, x[:2])))
    quantized = LinenMLP("fp8_delayed").apply(variables, x[:2], mutable=["fp8_meta"])[0]
    assert not np.array_equal(np.asarray(quantized), np.asarray(out))


def test_linen_dense_with_make_dot_general():
    x, _ = _task()
    dense = nn.Dense(32, dot_general=make_dot_general("mxfp4_full_h16"))
    variables = jax.jit(dense.init)(jax.random.key(0), x)
    got = jax.jit(dense.apply)(variables, x)
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    dot = jax.jit(lambda a, w: mx_dot_general(a, w, (((1,), (0,)), ((), ())), recipe="mxfp4_full_h16"))
    want = dot(x, kernel) + bias
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    # and the quantization is the contract's: Fprop quantizes x and W along K with H16 rotation.
    mx4 = ref.Operand("mx", "e2m1", 32, "even", "nearest_even")
    y_ref, scale, room = ref.quantized_dot(
        np.asarray(x), "tk", np.asarray(kernel), "kn", "tn", mx4, mx4, rotation=16, return_abs=True
    )
    rtol = lanes.gemm_rtol("mx", "mx", D_IN)
    assert (np.abs(np.asarray(got) - np.asarray(bias) - y_ref) <= rtol * scale + room + 1e-6).all()


def test_linen_fp8_delayed_keeps_amax_histories():
    """fp8_delayed: per-layer amax histories in "fp8_meta", updated by overwrite-with-gradient."""
    model = LinenMLP("fp8_delayed")
    x, y = _task()
    variables = _replicated(jax.jit(model.init)(jax.random.key(0), x[:2]))
    params, meta = variables["params"], variables["fp8_meta"]
    histories = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(meta)[0]}
    assert len(histories) == 6 and all((np.asarray(v) == 0).all() for v in histories.values()), (
        histories.keys()
    )
    tx = optax.adam(LR)
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, meta, opt_state):
        def loss_fn(p, m):
            return jnp.mean((model.apply({"params": p, "fp8_meta": m}, x) - y) ** 2)

        loss, (grads, new_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_meta, opt_state, loss

    kernel0 = np.asarray(params["Dense_0"]["kernel"])
    params, meta, opt_state, loss0 = step(params, meta, opt_state)
    first = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(meta)[0]}
    lhs0 = [v for k, v in first.items() if "Dense_0" in k and "lhs" in k]
    rhs0 = [v for k, v in first.items() if "Dense_0" in k and "rhs" in k]
    assert len(lhs0) == len(rhs0) == 1
    np.testing.assert_array_equal(lhs0[0][:2], [np.abs(np.asarray(x)).max(), 0.0])
    np.testing.assert_array_equal(rhs0[0][:2], [np.abs(kernel0).max(), 0.0])
    assert all(v[0] > 0 and (v[1:] == 0).all() for v in first.values()), first
    losses = [float(loss0)]
    for _ in range(STEPS - 1):
        params, meta, opt_state, loss = step(params, meta, opt_state)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses


# ----------------------------------------------------------------------------------------------------
# NNX


class NnxMLP(nnx.Module):
    def __init__(self, recipe: str, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(
            D_IN, HIDDEN, dot_general=NnxQuantDotGeneral(recipe, rngs=nnx.Rngs(quant=1)), rngs=rngs
        )
        self.l2 = nnx.Linear(
            HIDDEN, D_OUT, dot_general=NnxQuantDotGeneral(recipe, rngs=nnx.Rngs(quant=2)), rngs=rngs
        )

    def __call__(self, x):
        return self.l2(nnx.gelu(self.l1(x)))


@nnx.jit
def _nnx_step(model, optimizer, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("recipe", PRESETS_TO_TRAIN)
def test_nnx_mlp_trains(recipe):
    model = NnxMLP(recipe, rngs=nnx.Rngs(0))
    nnx.update(model, _replicated(nnx.state(model)))
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    x, y = _task()
    losses = np.array([float(_nnx_step(model, optimizer, x, y)) for _ in range(STEPS)])
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_nnx_sr_draws_a_new_key_per_call():
    dg = NnxQuantDotGeneral("mxfp4_full_sr", rngs=nnx.Rngs(quant=3))
    model = nnx.Linear(D_IN, D_OUT, dot_general=dg, rngs=nnx.Rngs(0))
    x, _ = _task()

    @nnx.jit
    def grads(m):
        return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)

    g1 = jax.tree.leaves(nnx.state(grads(model), nnx.Param))
    g2 = jax.tree.leaves(nnx.state(grads(model), nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(g1, g2, strict=True))
    with pytest.raises(ValueError):
        NnxQuantDotGeneral("mxfp4_full_sr")  # no rngs
