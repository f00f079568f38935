"""The sharded trainer on 8 fake CPU devices: every mesh trains like one device, and a checkpoint written
on one mesh resumes on another (the CPU part of the multi-GPU issue; the GPU part needs a multi-GPU kind).

Compute is float32 so that the only differences between meshes are reduction orders.
"""

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import tiny_c4_h16  # noqa: E402
from fp4jax import train as trainer  # noqa: E402
from fp4jax.models.sharding import MESH_AXES, make_mesh, sharding_context  # noqa: E402
from fp4jax.training.metrics import read_metrics  # noqa: E402
from fp4jax.training.optimizer import make_optimizer  # noqa: E402

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]  # (data, fsdp, tensor)
STEPS = 3


def _config(recipe: str, **top):
    c = tiny_c4_h16.get_config()
    c.recipe = recipe
    c.model.update(vocab_size=256, dtype="float32", remat="none")
    c.update(seq_len=32, global_batch=8, progress_bar=False, tensorboard=False, **top)
    # A small LR: Adam's first update is ~lr * sign(g), which turns reduction-order noise in near-zero
    # gradients into lr-sized parameter differences between meshes.
    c.optimizer.update(peak_lr=1e-3, warmup_steps=1, lr_decay_steps=10)
    return c


class _Tokenizer:
    name, vocab_size = "synthetic", 256


def _train_steps(config, mesh, batches):
    """Losses of len(batches) updates and the final params, on `mesh`."""
    with sharding_context(mesh):
        model, _ = trainer.build_model(config, _Tokenizer())
        tx, schedule = make_optimizer(config.optimizer)
        state, shardings = trainer.init_train_state(model, tx, mesh, config.seed, config.seq_len)
        train_fn, _ = trainer.jit_steps(config, model, tx, schedule, mesh, shardings)
        losses = []
        for batch in batches:
            state, metrics = train_fn(state, trainer.device_batch(batch, mesh), jax.random.key(3))
            losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def batches():
    """The same random batch every step: the loss must fall as the model memorises it."""
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    return [{"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}] * STEPS


@pytest.mark.parametrize("recipe", ["fp8", "mxfp4_full_h16"])
def test_every_mesh_trains_like_one_device(recipe, batches):
    config = _config(recipe)
    one_device = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    want_losses, want_params = _train_steps(config, one_device, batches)
    assert want_losses[-1] < want_losses[0]
    for shape in MESHES:
        losses, params = _train_steps(config, make_mesh(*shape), batches)
        # The first update sees identical params: only reduction orders differ. Later ones differ a little
        # more, because a rounding flip in a quantized operand moves it by a whole element ulp (6% in E4M3):
        # "within bf16 noise" (2^-8) is the bar, as for the GPUs.
        np.testing.assert_allclose(losses[0], want_losses[0], rtol=1e-5, err_msg=f"mesh {shape}")
        np.testing.assert_allclose(losses, want_losses, rtol=2**-8, err_msg=f"mesh {shape}")
        for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want_params), strict=True
        ):
            relative = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert relative < 2**-8, f"mesh {shape}: {jax.tree_util.keystr(path)} differs by {relative:.2e}"


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir) if "eval_loss" not in r]


def test_checkpoint_from_one_mesh_resumes_on_another(tmp_path):
    cache = str(tmp_path / "tokens")
    common = dict(eval_every_sequences=0, eval_at_end=False, checkpoint_every_steps=0)

    def config(steps, mesh):
        c = _config("mxfp4_full_h16", steps=steps, **common)
        c.model.vocab_size = None  # the bundled GPT-2 tokenizer's vocabulary
        c.data.update(cache_dir=cache, num_threads=1)
        c.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
        return c

    trainer.train(config(6, (8, 1, 1)), str(tmp_path / "straight"))
    trainer.train(config(3, (8, 1, 1)), str(tmp_path / "moved"))  # saves its final checkpoint at step 3
    trainer.train(config(6, (2, 2, 2)), str(tmp_path / "moved"))  # restores it onto another mesh
    straight, moved = _losses(str(tmp_path / "straight")), _losses(str(tmp_path / "moved"))
    assert [s for s, _ in moved] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([v for _, v in moved][:3], [v for _, v in straight][:3], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in moved], [v for _, v in straight], rtol=2**-8)
