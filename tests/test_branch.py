"""Branching a run from another run's checkpoint (config.init_from, fp4jax/training/branch.py): a branch of
the trunk's own recipe continues the trunk exactly and two such branches agree; a branch of another recipe
starts from the trunk's exact params, optimizer state and next batch, with fresh amax histories where the
trunk's do not fit; a branch with checkpoints of its own resumes those; bad input is one line; the command
line keeps the steps of keep_checkpoint_steps. The trunk is the session's tiny_runs.good_run (fp8_delayed,
checkpoints 2, 4, 6), copied where a test changes it."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from tiny_runs import (
    bytes_tokenizer,
    cli_args,
    compare,
    compilation_cache,
    tiny_config,
)

from fp4jax import train as cli
from fp4jax.models.sharding import sharding_context
from fp4jax.training import branch, setup, trainer
from fp4jax.training.errors import CheckpointError, ConfigError

FIXTURES = (compilation_cache,)


def _after(records, step):
    return [r for r in records if r["step"] > step]


def _saved_state(trunk, step):
    """The trunk's saved TrainState at `step` as numpy, read by orbax without any target (the reference)."""
    return ocp.StandardCheckpointer().restore(os.path.join(trunk, "checkpoints", str(step), "state"))


def test_branches_of_the_trunks_recipe_continue_it_and_a_branch_resumes_its_own_checkpoints(
    tmp_path, token_cache, good_run, monkeypatch
):
    """The trunk is named relative to the working directory, and the records keep it relative. The branch
    stops after update 3 (its own checkpoint), then goes on without the trunk: every line after step 2 is
    the trunk's. (A branch trained through without a stop, to the same lines: the command-line test below.)"""
    trunk = tmp_path / "trunk"
    shutil.copytree(good_run, trunk)
    monkeypatch.chdir(tmp_path)
    config = tiny_config(token_cache, init_from="trunk", init_from_step=2)
    stopped = tiny_config(token_cache, init_from="trunk", init_from_step=2, steps=3)
    first = trainer.train(stopped, str(tmp_path / "b"))
    assert first["branched_from"] == {"init_from": "trunk", "step": 2} and first["resumed_from_step"] == 2
    assert compare(tmp_path / "b") == _after(compare(good_run), 2)[:1]  # update 3: the trunk's
    shutil.rmtree(trunk)
    second = trainer.train(config, str(tmp_path / "b"))
    assert second["resumed_from_step"] == 3 and second["branched_from"] == first["branched_from"]
    assert compare(tmp_path / "b") == _after(compare(good_run), 2)  # losses, grad norms, LRs, the eval


def test_a_branch_of_another_recipe_starts_from_the_trunks_state_and_next_batch(
    tmp_path, token_cache, good_run
):
    """fp8_mlperf keeps 4-step amax histories, the fp8_delayed trunk 1,024-step ones: fresh zeros."""
    config = setup.resolve_config(
        tiny_config(token_cache, recipe="fp8_mlperf", init_from=str(good_run), init_from_step=2)
    )
    mesh = setup.make_run_mesh(config)
    with sharding_context(mesh):
        run = trainer.build_run(config, str(tmp_path), mesh, setup.total_steps(config))
        batch = jax.device_get(trainer._next_batch(run))
        fresh = trainer.load_data(config, bytes_tokenizer(), mesh)[0]
        third = [next(fresh) for _ in range(3)][-1]
    saved = _saved_state(good_run, 2)
    assert run.start_step == int(run.state.step) == 2 and run.meta["evals"] == []
    got = nn.meta.unbox(jax.device_get(run.state.params))
    jax.tree.map(np.testing.assert_array_equal, got, saved["params"])
    want_opt = jax.tree.leaves(saved["opt_state"])
    got_opt = jax.tree.leaves(jax.device_get(run.state.opt_state))
    assert len(got_opt) == len(want_opt)
    assert all(np.array_equal(a, b) for a, b in zip(got_opt, want_opt, strict=True))
    histories = jax.tree.leaves(jax.device_get(run.state.fp8_meta))
    assert histories and all(h.shape[-1] == 4 and not h.any() for h in histories)
    assert any(h.any() for h in jax.tree.leaves(saved["fp8_meta"]))  # the trunk's were not zeros
    np.testing.assert_array_equal(batch["inputs"], third["inputs"])
    np.testing.assert_array_equal(batch["targets"], third["targets"])


def test_amax_histories_are_carried_only_where_path_shape_and_dtype_fit():
    repl = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32, sharding=repl)  # noqa: E731
    source = {"a": {"lhs": np.full(4, 2.0, np.float32), "rhs": np.ones(8, np.float32)}}
    abstract = {"a": {"lhs": spec(4), "rhs": spec(4)}, "b": {"grad": spec(4)}}
    merged, carried = branch.merge_fp8_meta(source, abstract)
    assert carried == 1
    np.testing.assert_array_equal(merged["a"]["lhs"], np.full(4, 2.0))
    assert not merged["a"]["rhs"].any() and not merged["b"]["grad"].any()
    assert merged["b"]["grad"].shape == (4,)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"init_from": "/no/such/run", "init_from_step": 2}, "init_from /no/such/run has no checkpoints/"),
        ({"init_from_step": 3}, r"has no checkpoint at step 3 \(it has: 2, 4, 6\)"),
        ({"init_from_step": 0}, "needs init_from_step"),
        ({"init_from_step": 6}, "steps 6 must exceed init_from_step 6"),
        ({"init_from_step": 2, "init_checkpoint": "x"}, "init_from and init_checkpoint are both set"),
        ({"init_from_step": 2, "model.d_ff": 96}, r"is another model: param \S*mlp\S* is \("),
    ],
)
def test_bad_branch_input_is_one_line(tmp_path, token_cache, good_run, overrides, message):
    config = tiny_config(token_cache, **{"init_from": str(good_run), **overrides})
    if config.init_checkpoint:
        config.init_checkpoint = str(good_run)
    with pytest.raises(ConfigError, match=message) as info:
        trainer.train(config, str(tmp_path / "branch"))
    assert "\n" not in str(info.value)


def test_a_trunk_checkpoint_that_does_not_verify_is_one_line(tmp_path, token_cache, good_run):
    trunk = tmp_path / "trunk"
    shutil.copytree(good_run / "checkpoints" / "2", trunk / "checkpoints" / "2")
    files = [os.path.join(d, f) for d, _, fs in os.walk(trunk / "checkpoints" / "2" / "state") for f in fs]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        head = f.read(64)
        f.seek(0)
        f.write(bytes(255 - b for b in head))  # same size, other bytes: only the manifest can tell
    config = tiny_config(token_cache, init_from=str(trunk), init_from_step=2)
    message = r"init_from checkpoint .*/2 is bad: .*branch from another step"
    with pytest.raises(CheckpointError, match=message) as info:
        trainer.train(config, str(tmp_path / "branch"))
    assert "\n" not in str(info.value)


def test_the_command_line_branches_and_keeps_the_named_checkpoints(tmp_path, token_cache, good_run):
    """The command line (fp4jax.train's main, in this process: test_faults.py runs `python -m fp4jax.train`
    itself) with init_from: the branch's own checkpoints are the newest one and those of
    keep_checkpoint_steps; its losses are the trunk's (the same recipe), trained through from the branch
    point."""
    args = cli_args(
        tmp_path,
        token_cache,
        init_from=str(good_run),
        init_from_step=2,
        keep_checkpoints=1,
        keep_checkpoint_steps="(3,)",
        checkpoint_every_steps=1,
    )
    assert cli.main(["fp4jax.train", *args]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["branched_from"]["step"] == 2 and summary["status"] == "not_reached"
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [3, 6]
    assert compare(tmp_path) == _after(compare(good_run), 2)
