"""Stochastic rounding's random bits (kernels/sr_bits.py): the "threefry13" generator.

Its formula against an independent pure-Python Threefry-2x32 (itself pinned to Random123's known answers
and, at 20 rounds, to jax.random.bits); its statistics with fixed seeds (uniformity, independence across
neighbouring elements, steps' keys and device shards; SR unbiased with these bits); every back end and
every sharding drawing the same bits; the recipe plumbing. The Pallas kernels' draw is checked in
tests/test_fused_quantize.py beside threefry's.

False alarms: each statistical test compares a statistic with a bound that a truly random source exceeds
with probability ALPHA (Bonferroni-split where one test makes several comparisons). The draws are fixed
(seeded keys), so a test passes or fails deterministically; ALPHA is the chance that a generator as good
as an ideal one would have failed it with another seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from long_lane import SLOW
from scipy import stats

from fp4jax.ops import get_recipe, mx_dot_general, quantize
from fp4jax.ops.kernels import fused_quantize as fq
from fp4jax.ops.kernels import sr_bits, threefry
from fp4jax.ops.recipes import MXFP4_SR, PRESETS, QuantSpec, with_sr_rng

ALPHA = 1e-5
MASK32 = 0xFFFFFFFF

# ----------------------------------------------------------------------------------------------------
# the independent reference: Threefry-2x32 with R rounds in Python integers (Salmon et al. 2011; the
# rotation constants and key schedule of Random123's threefry.h)

_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA


def _threefry_py(key: tuple[int, int], counter: tuple[int, int], rounds: int) -> tuple[int, int]:
    ks = (key[0], key[1], key[0] ^ key[1] ^ _PARITY)
    x0, x1 = (counter[0] + ks[0]) & MASK32, (counter[1] + ks[1]) & MASK32
    for r in range(rounds):
        x0 = (x0 + x1) & MASK32
        rot = _ROTATIONS[r % 8]
        x1 = (((x1 << rot) | (x1 >> (32 - rot))) & MASK32) ^ x0
        if r % 4 == 3:
            s = (r + 1) // 4
            x0 = (x0 + ks[s % 3]) & MASK32
            x1 = (x1 + ks[(s + 1) % 3] + s) & MASK32
    return x0, x1


def _threefry13_py(words, size: int) -> np.ndarray:
    """The generator's definition: element i takes word i & 1 of the block at counter (0, i >> 1)."""
    key = (int(words[0]), int(words[1]))
    return np.array([_threefry_py(key, (0, i >> 1), 13)[i & 1] for i in range(size)], np.uint32)


# Random123's tests/kat_vectors: (rounds, counter words, key words, output words).
RANDOM123_KAT = (
    (13, (0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x9D1C5EC6, 0x8BD50731)),
    (13, (0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0xFD36D048, 0x2D17272C)),
    (13, (0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xBA3E4725, 0xF27D669E)),
    (20, (0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    (20, (0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    (20, (0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
)
# Keys whose two words both differ from zero (fold_in), so a swap of the words would show; a plain seed.
KEYS = (jax.random.fold_in(jax.random.key(1), 5), jax.random.key(2**31 - 3))


@pytest.mark.parametrize("rounds, counter, key, want", RANDOM123_KAT)
def test_threefry_blocks_give_random123s_known_answers(rounds, counter, key, want):
    assert _threefry_py(key, counter, rounds) == want
    u32 = [jnp.uint32(v) for v in (*key, *counter)]
    got = threefry.threefry2x32(*u32, rounds=rounds)
    assert (int(got[0]), int(got[1])) == want


def test_the_python_reference_at_20_rounds_is_jax_random_bits():
    """jax's draw is word 0 xor word 1 of the block at counter (0, i): the reference is jax's cipher."""
    key = KEYS[0]
    words = [int(w) for w in jax.random.key_data(key)]
    want = np.asarray(jax.random.bits(key, (37,), jnp.uint32))
    got = [a ^ b for a, b in (_threefry_py(words, (0, i), 20) for i in range(37))]
    np.testing.assert_array_equal(np.array(got, np.uint32), want)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 7), (2, 3, 4, 33), (2, 3, 16, 2, 32)])
def test_threefry13_is_its_python_definition(shape):
    """stochastic_bits(key, shape, "threefry13") row-major == the definition at each flat index, for odd
    and even last axes (computed a pair at a time where it is even) and quantize_mx's blocked shapes."""
    for key in KEYS:
        got = np.asarray(sr_bits.stochastic_bits(key, shape, "threefry13")).reshape(-1)
        np.testing.assert_array_equal(got, _threefry13_py(jax.random.key_data(key), int(np.prod(shape))))


def test_bits_are_reproducible_for_a_key_and_differ_between_keys():
    shape = (4, 8, 32)
    draw = jax.jit(lambda k: sr_bits.stochastic_bits(k, shape, "threefry13"))
    first = np.asarray(draw(KEYS[0]))
    np.testing.assert_array_equal(first, np.asarray(draw(KEYS[0])))
    np.testing.assert_array_equal(first, np.asarray(sr_bits.stochastic_bits(KEYS[0], shape, "threefry13")))
    assert np.mean(first == np.asarray(draw(KEYS[1]))) < 0.01
    # The default generator is jax.random.bits itself: committed runs keep their bits.
    np.testing.assert_array_equal(
        np.asarray(quantize.stochastic_bits(KEYS[0], shape)), np.asarray(jax.random.bits(KEYS[0], shape))
    )


def test_bad_generators_keys_and_sizes_are_one_line_errors():
    for call, match in (
        (lambda: sr_bits.stochastic_bits(KEYS[0], (4,), "philox"), "unknown random-bit generator"),
        (lambda: sr_bits.stochastic_bits(jax.random.key(0, impl="rbg"), (4,), "threefry13"), "threefry2x32"),
        (lambda: sr_bits.random_bits_of_shape(jnp.zeros(2, jnp.uint32), (2**16, 2**16 + 2)), "2\\*\\*32"),
        (lambda: QuantSpec(kind="mx", rounding="stochastic", rng="fast"), "unknown random-bit generator"),
    ):
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------
# statistics (module docstring: false alarms)

N_STAT = 1 << 20


def _uniform_draw(key, shape=(N_STAT,)) -> np.ndarray:
    return np.asarray(sr_bits.stochastic_bits(key, shape, "threefry13"))


def _chi2_p(table: np.ndarray) -> float:
    """p-value of the counts `table` against equal expected counts (scipy's chi-square test)."""
    return stats.chisquare(table.reshape(-1)).pvalue


def _contingency_p(a: np.ndarray, b: np.ndarray, bins_bits: int = 4) -> float:
    """p-value of independence of the top `bins_bits` bits of a and b (a 2-D chi-square: any dependence,
    linear or not, between the two sequences' leading bits, the ones SR reads first)."""
    shift = 32 - bins_bits
    cells = (a >> shift).astype(np.int64) * (1 << bins_bits) + (b >> shift)
    counts = np.bincount(cells, minlength=1 << (2 * bins_bits))
    return _chi2_p(counts)


def _correlation_z(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's r of the 24-bit uniforms SR uses, times sqrt(n): N(0, 1) for independent sequences."""
    u, v = (a >> 8).astype(np.float64), (b >> 8).astype(np.float64)
    return float(np.corrcoef(u, v)[0, 1] * np.sqrt(len(u)))


def test_bits_are_uniform():
    """Each of the four bytes of 2**20 draws is uniform over 256 values (chi-square, 255 dof), and each
    of the 32 bits is set half the time (two-sided binomial z): 4 + 32 comparisons at ALPHA / 36."""
    bits = _uniform_draw(KEYS[0])
    alpha = ALPHA / 36
    for lane in range(4):
        counts = np.bincount((bits >> (8 * lane)) & 0xFF, minlength=256)
        assert _chi2_p(counts) > alpha, f"byte {lane}"
    z_bound = stats.norm.isf(alpha / 2)
    ones = np.array([np.count_nonzero((bits >> b) & 1) for b in range(32)])
    z = (ones - N_STAT / 2) / np.sqrt(N_STAT / 4)
    assert np.max(np.abs(z)) < z_bound, z


@pytest.mark.parametrize(
    "offset, stride",
    [(0, 2), (1, 2), (0, 1), (0, 512)],
    ids=["pair-words", "across-pairs", "every-neighbour", "row-above"],
)
def test_neighbouring_elements_are_independent(offset, stride):
    """Element i against element i + 1 within one Threefry block (i even: the block's two words), across
    two blocks (i odd), for every i, and against the element one row below in a (.., 512) array:
    correlation z and the 16 x 16 contingency chi-square of their leading bits, at ALPHA / 2 each."""
    bits = _uniform_draw(KEYS[1])
    step = 1 if stride == 512 else stride
    lag = 512 if stride == 512 else 1
    first = bits[offset : N_STAT - lag : step]
    second = bits[offset + lag :: step][: len(first)]
    assert abs(_correlation_z(first, second)) < stats.norm.isf(ALPHA / 4)
    assert _contingency_p(first, second) > ALPHA / 2


def test_steps_keys_give_independent_bits():
    """The same elements under the keys of consecutive steps (fold_in(key, step), as the trainer derives
    them) and of two layers of one step (split): correlation and contingency at each index, and the xor
    of the two draws uniform; 3 comparisons per pair of keys at ALPHA / 6."""
    base = jax.random.key(7)
    pairs = [(jax.random.fold_in(base, 0), jax.random.fold_in(base, 1)), tuple(jax.random.split(base))]
    for a_key, b_key in pairs:
        a, b = _uniform_draw(a_key), _uniform_draw(b_key)
        assert abs(_correlation_z(a, b)) < stats.norm.isf(ALPHA / 12)
        assert _contingency_p(a, b) > ALPHA / 6
        assert _chi2_p(np.bincount((a ^ b) >> 24, minlength=256)) > ALPHA / 6


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices (conftest forces 8 CPU devices)")
    return Mesh(np.array(devices), ("d",))


def test_each_device_shard_draws_its_part_of_the_global_bits(mesh):
    """A sharded draw (rows over the devices): every shard holds the global formula's bits at its global
    indices, equal to the unsharded draw; and the shards' bits are independent of each other (shard 0
    against each other one: correlation and contingency at ALPHA / (2 (devices - 1)))."""
    n_dev = mesh.devices.size
    shape = (n_dev * 64, 2048)
    sharding = NamedSharding(mesh, PartitionSpec("d", None))
    draw = jax.jit(lambda k: sr_bits.stochastic_bits(k, shape, "threefry13"), out_shardings=sharding)
    sharded = draw(KEYS[0])
    whole = np.asarray(sr_bits.stochastic_bits(KEYS[0], shape, "threefry13"))
    np.testing.assert_array_equal(np.asarray(sharded), whole)
    shards = sorted(sharded.addressable_shards, key=lambda s: s.index[0].start)
    assert len(shards) == n_dev
    for shard in shards:
        np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
    alpha = ALPHA / (2 * (n_dev - 1))
    first = np.asarray(shards[0].data).reshape(-1)
    for shard in shards[1:]:
        other = np.asarray(shard.data).reshape(-1)
        assert abs(_correlation_z(first, other)) < stats.norm.isf(alpha / 2)
        assert _contingency_p(first, other) > alpha


def test_sharded_stochastic_quantization_equals_one_device(mesh):
    """quantize_mx with rng="threefry13" of an operand sharded by rows gives the unsharded result bit for
    bit: the bits depend on the key and the global index only, whatever the partitioning."""
    n_dev = mesh.devices.size
    x = jax.random.normal(jax.random.key(3), (n_dev * 16, 256), jnp.float32)
    sharding = NamedSharding(mesh, PartitionSpec("d", None))

    def quantized(x, key):
        mx = quantize.quantize_mx(x, scale_mode="even", rounding="stochastic", key=key, rng="threefry13")
        return mx.dequantize()

    got = jax.jit(quantized, in_shardings=(sharding, None), out_shardings=sharding)(
        jax.device_put(x, sharding), KEYS[1]
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(quantized)(x, KEYS[1])))


def test_stochastic_rounding_with_these_bits_is_unbiased():
    """E[SR(x)] == x: 4096 values of E2M1 blocks whose scale is 1 (each block's maximum is 4, under the
    even rule), rounded under 512 keys. Per element the mean's deviation over its standard error is
    N(0, 1); their squares sum to a chi-square of 4096 dof, and their sum over all elements (any common
    bias) is N(0, 4096): two comparisons at ALPHA / 2. Values on the grid must come back exactly."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 4.0, (128, 32)).astype(np.float32)
    x[:, 0] = 4.0
    x[:4, 1:9] = [[0.5, 1.0, 1.5, 2.0, 3.0, 0.0, 0.25, 3.5]]  # on the grid, and two ties of RNE
    x = jnp.asarray(x * np.where(rng.random(x.shape) < 0.5, -1.0, 1.0).astype(np.float32))
    keys = jax.random.split(jax.random.key(11), 512)

    def one(key):
        mx = quantize.quantize_mx(x, scale_mode="even", rounding="stochastic", key=key, rng="threefry13")
        return mx.dequantize()

    draws = np.asarray(jax.lax.map(one, keys), np.float64)
    xs = np.asarray(x, np.float64)
    magnitude = np.abs(xs)
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    upper_i = np.searchsorted(grid, magnitude, side="left")
    upper = grid[upper_i]
    lower = grid[np.maximum(upper_i - 1, 0)]
    on_grid = upper == magnitude
    assert np.all(draws[:, on_grid] == xs[on_grid])
    frac = np.where(on_grid, 0.0, (magnitude - lower) / np.where(on_grid, 1.0, upper - lower))
    se = (upper - lower) * np.sqrt(frac * (1 - frac) / len(keys))
    z = ((draws.mean(axis=0) - xs) / np.where(on_grid, 1.0, se))[~on_grid]
    assert stats.chi2.sf(np.sum(z**2), z.size) > ALPHA / 2
    assert abs(np.sum(z)) / np.sqrt(z.size) < stats.norm.isf(ALPHA / 4)


# ----------------------------------------------------------------------------------------------------
# back ends and recipes


def test_the_fused_xla_path_draws_the_references_bits():
    """rotate_quantize(impl="xla") with a threefry13 spec == quantize_mx(rng="threefry13"), both layouts;
    and other bits than threefry's (the generator reaches the rounding)."""
    spec = dataclasses.replace(MXFP4_SR, rng="threefry13")
    x = jax.random.normal(jax.random.key(4), (2, 64, 128), jnp.float32)

    # Both sides jitted: one program each, not every op compiled on its own (6 s eagerly).
    @functools.partial(jax.jit, static_argnums=(0, 1))
    def fused(axis, spec):
        return fq.rotate_quantize(x, axis=axis, spec=spec, key=KEYS[0], impl="xla").dequantize()

    @functools.partial(jax.jit, static_argnums=0)
    def reference(axis):
        xt = x if axis == -1 else jnp.swapaxes(x, -1, -2)
        mx = quantize.quantize_mx(xt, scale_mode="even", rounding="stochastic", key=KEYS[0], rng="threefry13")
        return mx.dequantize()

    for axis in (-1, -2):
        np.testing.assert_array_equal(np.asarray(fused(axis, spec)), np.asarray(reference(axis)))
    other = dataclasses.replace(spec, rng="threefry")
    assert np.any(np.asarray(fused(-1, spec)) != np.asarray(fused(-1, other)))


def test_nvfp4_takes_the_generator_too():
    x = jax.random.normal(jax.random.key(5), (16, 64), jnp.float32)
    spec = QuantSpec(kind="nvfp4", rounding="stochastic", rng="threefry13")

    @functools.partial(jax.jit, static_argnums=0)  # eagerly, NVFP4's ops compiled one by one: 4 s
    def dequantized(spec):
        return spec.quant_kind.quantize(x[None], spec, KEYS[0], None).dequantize()

    got = np.asarray(dequantized(spec))
    assert np.any(got != np.asarray(dequantized(dataclasses.replace(spec, rng="threefry"))))
    np.testing.assert_array_equal(got, np.asarray(dequantized(spec)))  # the same key, the same bits again


def test_every_preset_keeps_threefry_and_with_sr_rng_changes_only_stochastic_operands():
    for recipe in PRESETS.values():
        assert all(s.rng == "threefry" for g in recipe.gemms for s in (g.lhs, g.rhs)), recipe.name
    sr = get_recipe("mxfp4_full_sr")
    fast = with_sr_rng(sr, "threefry13")
    for before, after in zip(sr.gemms, fast.gemms, strict=True):
        for b, a in ((before.lhs, after.lhs), (before.rhs, after.rhs)):
            assert a == (dataclasses.replace(b, rng="threefry13") if b.rounding == "stochastic" else b)
    assert fast.fprop == sr.fprop and fast.dgrad != sr.dgrad
    assert with_sr_rng(sr, "preset") is sr and with_sr_rng("mxfp4_full", "threefry13") == get_recipe(
        "mxfp4_full"
    )
    with pytest.raises(ValueError, match="unknown sr_rng 'fast'"):
        with_sr_rng(sr, "fast")


@SLOW
def test_a_gemm_with_the_fast_generator_is_reproducible_and_close_to_the_exact_product():
    x = jax.random.normal(jax.random.key(6), (64, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(7), (256, 128), jnp.float32)
    dy = jax.random.normal(jax.random.key(8), (64, 128), jnp.float32)
    recipe = dataclasses.replace(with_sr_rng("mxfp4_full_sr", "threefry13"), backend="emulate")
    dims = (((1,), (0,)), ((), ()))

    def grads(key):
        _, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, dims, recipe=recipe, key=key), x, w)
        return vjp(dy)

    dx, dw = grads(KEYS[0])
    dx2, dw2 = grads(KEYS[0])
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw2))
    exact = dy @ w.T
    assert float(jnp.linalg.norm(dx - exact) / jnp.linalg.norm(exact)) < 0.25


def test_the_statistical_tests_reject_weak_bits(monkeypatch):
    """The tests above can fail: Threefry-2x32 cut to 3 rounds fails uniformity, independence across keys
    and along columns; bits with their top bit cleared (u < 1/2 always) bias SR."""
    monkeypatch.setattr(sr_bits, "THREEFRY13_ROUNDS", 3)
    for test in (
        test_bits_are_uniform,
        test_steps_keys_give_independent_bits,
        lambda: test_neighbouring_elements_are_independent(0, 512),
    ):
        with pytest.raises(AssertionError):
            test()
    monkeypatch.undo()
    formula = sr_bits.random_bits_of_shape
    monkeypatch.setattr(sr_bits, "random_bits_of_shape", lambda words, shape: formula(words, shape) >> 1)
    with pytest.raises(AssertionError):
        test_stochastic_rounding_with_these_bits_is_unbiased()


def test_the_trainer_config_selects_the_generator():
    """The config key sr_rng reaches the recipe a run trains with; its default keeps every preset's bits."""
    import ml_collections

    from fp4jax.configs import base
    from fp4jax.training import setup

    assert base.get_config().sr_rng == "preset"
    config = ml_collections.ConfigDict(
        {"recipe": "mxfp4_full_sr", "fp8_scaling": "preset", "sr_rng": "preset"}
    )
    recipe, _ = setup.resolve_run_execution(config, {})
    assert recipe == get_recipe("mxfp4_full_sr")
    config.sr_rng = "threefry13"
    recipe, _ = setup.resolve_run_execution(config, {})
    assert recipe == with_sr_rng("mxfp4_full_sr", "threefry13") and recipe.wgrad.lhs.rng == "threefry13"
