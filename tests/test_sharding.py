"""Mesh construction, the logical rules on the real 8B tree (shapes only), sharded init, and sharded vs
unsharded logits on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax.models import sharding
from fp4jax.models.llama import Llama, llama_config

# Every test here lays out a mesh of 8 (2 x 2 x 2, 2 x 4): the CPU lane's fake devices. The GPU lane's
# multi-device checks are test_multidevice and test_flax_adapters, which adapt to the devices present.
pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason=f"needs 8 devices (the CPU lane's fake ones); {len(jax.devices())} present"
)


def test_make_mesh_fills_and_rejects():
    assert dict(sharding.make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(sharding.make_mesh(fsdp=2, tensor=4).shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    assert dict(sharding.make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sharding.make_mesh(data=4, devices=jax.devices()[:4]).devices.size == 4
    with pytest.raises(ValueError, match=r"data=3 x fsdp=1 x tensor=1 does not fit 8 devices") as err:
        sharding.make_mesh(data=3)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not fit 8 devices"):
        sharding.make_mesh(data=2, fsdp=2, tensor=4)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh(data=-1, fsdp=-1)


def test_batch_sharding_and_divisibility():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"), None)
    assert sharding.batch_sharding(mesh, global_batch=8).mesh == mesh
    with pytest.raises(ValueError, match=r"global batch 6 is not divisible by data\*fsdp = 2\*2 = 4"):
        sharding.batch_sharding(mesh, global_batch=6)


def test_rules_on_the_8b_tree():
    """The real model's parameter layout, from shapes alone (nothing allocated)."""
    cfg = llama_config("8b")
    mesh = sharding.make_mesh(fsdp=2, tensor=4)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract = jax.eval_shape(Llama(cfg).init, jax.random.key(0), tokens)["params"]
    specs = jax.tree.map(lambda s: s.spec, sharding.logical_shardings(abstract, mesh))
    blocks = specs["blocks_0_32"]
    assert specs["embed"]["embedding"] == P("tensor", "fsdp")
    assert specs["lm_head"] == P("fsdp", "tensor")
    assert specs["final_norm"]["scale"] == P(None)
    assert blocks["attn"]["q"]["kernel"] == P(None, "fsdp", "tensor", None)
    assert blocks["attn"]["k"]["kernel"] == P(None, "fsdp", "tensor", None)
    assert blocks["attn"]["o"]["kernel"] == P(None, "tensor", None, "fsdp")
    assert blocks["mlp"]["gate"]["kernel"] == P(None, "fsdp", "tensor")
    assert blocks["mlp"]["down"]["kernel"] == P(None, "tensor", "fsdp")
    assert blocks["attn_norm"]["scale"] == P(None, None)


def test_indivisible_dimension_is_one_line_error():
    cfg = llama_config("tiny", vocab_size=256)  # 2 kv heads cannot split 4 ways
    abstract = jax.eval_shape(Llama(cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"\['k'\]\['kernel'\] of shape \(2, 64, 2, 16\).*tensor = 4"):
        sharding.logical_shardings(abstract, sharding.make_mesh(fsdp=2, tensor=4))


# 8 query / 4 kv heads so that tensor=4 divides every sharded dimension; fp32 compute for tight agreement.
SHARDABLE = llama_config(
    "tiny", vocab_size=256, d_model=32, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64, dtype="float32"
)


@pytest.fixture(scope="module")
def unsharded():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 8)), jnp.int32)
    model = Llama(SHARDABLE)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), tokens))
    return tokens, params, jax.jit(model.apply)(params, tokens)


@pytest.mark.parametrize("axes", [dict(data=1, fsdp=2, tensor=4), dict(data=2, fsdp=2, tensor=2)])
def test_sharded_matches_unsharded(axes, unsharded):
    tokens, params, want = unsharded
    mesh = sharding.make_mesh(**axes)
    model = Llama(SHARDABLE)
    state, shardings = sharding.init_sharded(lambda k: model.init(k, tokens), mesh, jax.random.key(1))
    assert jax.tree.structure(state) == jax.tree.structure(shardings) == jax.tree.structure(params)
    # same key, same values (threefry is partitionable), laid out as the rules say
    jax.tree.map(np.testing.assert_array_equal, state, params)
    q = state["params"]["blocks_0_2"]["attn"]["q"]["kernel"]  # [L, D, N, H]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32 // axes["fsdp"], 8 // axes["tensor"], 8)
    batch = jax.device_put(tokens, sharding.batch_sharding(mesh, global_batch=tokens.shape[0]))
    with sharding.sharding_context(mesh):
        apply = jax.jit(model.apply, in_shardings=(shardings, batch.sharding))
        got = apply(state, batch)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
