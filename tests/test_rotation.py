"""Hadamard rotations: orthogonality, the Sylvester construction, block rotation and its invariance."""

import functools

import jax
import jax.numpy as jnp
import mx_reference as ref
import numpy as np
import pytest

from fp4jax.ops import hadamard, random_signs, rotate_blocks, rotation
from fp4jax.ops.formats import require_power_of_two

EPS32 = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128])
def test_hadamard_is_orthonormal_sylvester(n):
    h = hadamard(n)
    assert isinstance(h, np.ndarray) and h.dtype == np.float32 and h.shape == (n, n)
    np.testing.assert_array_equal(h, ref.hadamard(n).astype(np.float32))
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_array_equal(np.abs(h), np.float32(1 / np.sqrt(n)))
    h64 = h.astype(np.float64)
    np.testing.assert_allclose(h64 @ h64.T, np.eye(n), rtol=0, atol=4 * EPS32)
    if n >= 2:  # the Sylvester recursion itself, in the unnormalised +-1 matrix
        s = np.sign(h)
        half = s[: n // 2, : n // 2]
        np.testing.assert_array_equal(s, np.block([[half, half], [half, -half]]))


@pytest.mark.parametrize("n", [0, -4, 3, 6, 12, 24, 48, 16.0, True, "16"])
def test_hadamard_rejects_non_powers_of_two(n):
    with pytest.raises(ValueError, match=f"hadamard size must be a positive power of two.*got {n!r}"):
        hadamard(n)
    with pytest.raises(ValueError, match="rotation size must be a positive power of two"):
        rotate_blocks(jnp.ones((2, 48)), axis=-1, size=n)


def test_require_power_of_two_accepts_powers_of_two():
    for k in range(12):
        require_power_of_two(2**k, "size")  # no error


@functools.partial(jax.jit, static_argnames=("axis", "size"))
def _rot(x, signs=None, *, axis, size):
    return rotate_blocks(x, axis=axis, size=size, signs=signs)


def _close_to_rotation(got, want, x, size):
    """Float32 matmul of `size` terms against the exact rotation: error <= ~size eps |x|_max sqrt(size)."""
    got = np.asarray(got)
    assert got.dtype == np.float32
    atol = size * EPS32 * np.abs(np.asarray(x, np.float64)).max() / np.sqrt(size)
    np.testing.assert_allclose(got, want, rtol=2 * EPS32, atol=atol)


@pytest.mark.parametrize(
    "shape,axis,size",
    [
        ((5, 64), -1, 16),
        ((64, 3), 0, 32),
        ((2, 32, 3), 1, 8),
        ((2, 32, 3), -2, 32),
        ((4, 16), 1, 16),
        ((3, 8), 1, 1),
    ],
)
@pytest.mark.parametrize("with_signs", [False, True])
def test_rotate_blocks_matches_reference(shape, axis, size, with_signs):
    rng = np.random.default_rng(size + len(shape))
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape))).astype(np.float32)
    signs = rng.choice([-1.0, 1.0], size).astype(np.float32) if with_signs else None
    got = _rot(jnp.asarray(x), None if signs is None else jnp.asarray(signs), axis=axis, size=size)
    assert got.shape == x.shape
    _close_to_rotation(got, ref.rotate_blocks(x, axis=axis, size=size, signs=signs), x, size)


@pytest.mark.parametrize("size", [4, 16, 32, 64])
@pytest.mark.parametrize("with_signs", [False, True])
@pytest.mark.parametrize("gpu_rule", [False, True])
def test_rotate_blocks_of_bf16_is_the_exact_rotation_summed_in_float32(
    size, with_signs, gpu_rule, monkeypatch
):
    """bf16 inputs: float32 out, against the fp64 rotation of the bf16 values, within float32
    accumulation of `size` products; `gpu_rule` takes the GPU's bf16 x bf16 path (for 4^k) on CPU too."""
    if gpu_rule:
        monkeypatch.setattr(rotation.jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(size)
    x = jnp.asarray(rng.standard_normal((6, 128)) * np.exp2(rng.integers(-20, 20, (6, 1))), jnp.bfloat16)
    signs = rng.choice([-1.0, 1.0], size).astype(np.float32) if with_signs else None
    got = rotate_blocks(x, axis=-1, size=size, signs=None if signs is None else jnp.asarray(signs))
    x64 = np.asarray(x, np.float64)
    _close_to_rotation(got, ref.rotate_blocks(x64, axis=-1, size=size, signs=signs), x64, size)


def test_bf16_path_rule(monkeypatch):
    monkeypatch.setattr(rotation.jax, "default_backend", lambda: "cpu")
    assert not rotation._bf16_path(jnp.bfloat16, 16)
    monkeypatch.setattr(rotation.jax, "default_backend", lambda: "cuda")
    assert rotation._bf16_path(jnp.bfloat16, 16) and rotation._bf16_path(jnp.bfloat16, 64)
    assert not rotation._bf16_path(jnp.bfloat16, 32)  # 1/sqrt(32) is not a bf16 value
    assert not rotation._bf16_path(jnp.float32, 16)


def test_rotate_blocks_is_blockwise():
    # A spike in one block must not leak into any other block.
    x = np.zeros((2, 64), np.float32)
    x[1, 20] = 1.0
    got = np.asarray(_rot(jnp.asarray(x), axis=-1, size=16))
    assert (got[0] == 0).all() and (got[1, :16] == 0).all() and (got[1, 32:] == 0).all()
    np.testing.assert_allclose(np.abs(got[1, 16:32]), 0.25, rtol=EPS32)


@pytest.mark.parametrize("size", [16, 32])
def test_rotate_blocks_inverse(size):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 2 * size)).astype(np.float32)
    back = np.asarray(_rot(_rot(jnp.asarray(x), axis=-1, size=size), axis=-1, size=size))  # H H = I
    np.testing.assert_allclose(back, x, rtol=0, atol=8 * EPS32 * np.abs(x).max())
    signs = np.asarray(random_signs(jax.random.key(3), size))
    r = _rot(jnp.asarray(x), jnp.asarray(signs), axis=-1, size=size)
    # inverse of v -> (v * s) @ H is w -> (w @ H) * s
    back = np.asarray(_rot(r, axis=-1, size=size)).reshape(6, 2, size) * signs
    np.testing.assert_allclose(back.reshape(x.shape), x, rtol=0, atol=8 * EPS32 * np.abs(x).max())


@pytest.mark.parametrize("size,random", [(16, False), (32, False), (16, True)])
def test_rotation_cancels_in_the_product(size, random):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 4 * size)).astype(np.float32)
    a[:, 3] *= 100  # an outlier channel
    b = rng.standard_normal((4 * size, 5)).astype(np.float32)
    signs = random_signs(jax.random.key(7), size) if random else None
    ar = _rot(jnp.asarray(a), signs, axis=1, size=size)
    br = _rot(jnp.asarray(b), signs, axis=0, size=size)
    got = np.asarray(ar, np.float64) @ np.asarray(br, np.float64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert (np.abs(got - want) <= 1e-5 * scale).all()
    # The rotation spreads the outlier channel over its block: the block max drops.
    assert np.abs(np.asarray(ar)).max() < 0.5 * np.abs(a).max()


def test_rotate_blocks_rejects_partial_blocks():
    with pytest.raises(ValueError):
        rotate_blocks(jnp.ones((4, 24)), axis=1, size=16)
    with pytest.raises(ValueError):
        rotate_blocks(jnp.ones((4, 32)), axis=1, size=12)


def test_random_signs():
    s1 = np.asarray(random_signs(jax.random.key(0), 4096))
    assert s1.shape == (4096,) and s1.dtype == np.float32
    assert set(np.unique(s1)) == {-1.0, 1.0}
    assert abs((s1 > 0).sum() - 2048) < 5 * 32  # 5 sigma of Binomial(4096, 1/2)
    np.testing.assert_array_equal(s1, np.asarray(random_signs(jax.random.key(0), 4096)))
    s2 = np.asarray(random_signs(jax.random.key(1), 64))
    assert (s2 != np.asarray(random_signs(jax.random.key(2), 64))).any()
    # Usable under jit with a traced key.
    s3 = jax.jit(lambda k: random_signs(k, 16))(jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(s3), np.asarray(random_signs(jax.random.key(5), 16)))
