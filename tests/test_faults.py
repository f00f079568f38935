"""The trainer under faults, each injected into a tiny run: bad checkpoints (truncated, overwritten,
corrupted iterator state, missing metadata, unverifiable, all bad), a full disk while saving, SIGINT, a
divergence, bad input on the command line, an internal error, and a finished run started again.

Every fault test copies one good run (checkpoints 2, 4, 6) and breaks the copy.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from tiny_runs import (
    BYTES_CLI,
    ROOT,
    cli_args,
    compare,
    compilation_cache,
    error_lines,
    tiny_config,
    train_losses,
    xla_cache_env,
)

from fp4jax import train as cli
from fp4jax.training import checkpoint, integrity, trainer
from fp4jax.training.metrics import read_metrics
from fp4jax.training.preemption import StopSignals

FIXTURES = (compilation_cache,)  # pytest finds it here (the session's tiny-run fixtures: conftest.py)


@pytest.fixture
def run_copy(good_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(good_run, workdir)
    return workdir


def _largest_state_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs]
    return max(files, key=os.path.getsize)


def _truncate(step_dir):
    path = _largest_state_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _overwrite(step_dir):
    path = _largest_state_file(step_dir)
    noise = np.random.default_rng(0).integers(0, 256, os.path.getsize(path), dtype=np.uint8).tobytes()
    with open(path, "r+b") as f:
        f.write(noise)


def _garble_iterator_state(step_dir):
    with open(os.path.join(step_dir, "data", "metadata"), "w") as f:
        f.write("{garbage")


def _delete_metadata(step_dir):
    os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _truncate_without_manifest(step_dir):
    os.remove(os.path.join(step_dir, integrity.MANIFEST))
    _truncate(step_dir)


# ------------------------------------------------------------------------------------ checkpoints


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's failed reads
@pytest.mark.parametrize(
    "inject, reason",
    [
        (_truncate, "bytes"),
        (_overwrite, "does not match the checksum"),
        (_garble_iterator_state, "data/metadata"),
        (_delete_metadata, "state/_METADATA is missing"),
        (_truncate_without_manifest, "unverified and unreadable"),
    ],
)
def test_bad_newest_checkpoint_is_set_aside_and_the_previous_one_restored(
    inject, reason, run_copy, good_run, token_cache, capsys
):
    ckpts = run_copy / "checkpoints"
    inject(str(ckpts / "6"))
    summary = trainer.train(tiny_config(token_cache, steps=7), str(run_copy))  # the good run is finished at 6
    err = capsys.readouterr().err
    bad = [line for line in err.splitlines() if "is bad" in line]
    assert len(bad) == 1 and f"checkpoint {ckpts / '6'} is bad" in bad[0] and reason in bad[0], err
    assert f"restored checkpoint {ckpts / '4'}" in err
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 7
    moved = os.listdir(ckpts / integrity.QUARANTINE)
    assert len(moved) == 1 and moved[0].startswith("6-")  # kept aside, not deleted
    assert compare(run_copy)[:7] == compare(good_run)  # steps 1-6 and the eval at 4: as if never broken


def test_every_checkpoint_bad_is_one_line_and_exit_2(run_copy, token_cache, capsys):
    for step in (2, 4, 6):
        _overwrite(str(run_copy / "checkpoints" / str(step)))
    assert cli.main(["fp4jax.train", *cli_args(run_copy, token_cache, steps=7)]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "every checkpoint in" in err[0] and str(run_copy / "checkpoints") in err[0], err
    assert len(os.listdir(run_copy / "checkpoints" / integrity.QUARANTINE)) == 3


def test_checkpoint_of_another_layout_is_one_line_and_kept(run_copy, good_run, token_cache, capsys):
    """A good checkpoint of the scanned model does not fit an unrolled run: exit 2, one line naming the
    key to set, and nothing set aside (it is not corrupt)."""
    argv = cli_args(run_copy, token_cache, steps=7, **{"model.scan_layers": False})
    assert cli.main(["fp4jax.train", *argv]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "does not fit this run" in err[0] and "model.scan_layers" in err[0], err
    quarantine = run_copy / "checkpoints" / integrity.QUARANTINE
    assert not quarantine.exists() or not os.listdir(quarantine)
    assert sorted(os.listdir(run_copy / "checkpoints")) == sorted(os.listdir(good_run / "checkpoints"))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's cut-off writes
def test_full_disk_names_the_checkpoint_and_keeps_the_previous_one(
    run_copy, token_cache, capsys, monkeypatch
):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def no_space(self, item, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", no_space)
    assert cli.main(["fp4jax.train", *cli_args(run_copy, token_cache, steps=7)]) == 2
    err = error_lines(capsys)
    ckpts = run_copy / "checkpoints"
    assert len(err) == 1 and f"checkpoint {ckpts / '7'}" in err[0] and "GB" in err[0], err
    assert sorted(os.listdir(ckpts)) == ["2", "4", "6"]  # no *-tmp left behind
    assert integrity.verify(str(ckpts / "6")) is None


def test_both_checkpointing_modes_save_verified_steps_and_resume(good_run, tmp_path, token_cache, capsys):
    """--config.async_checkpointing either way, through the command line: a copy of the good run
    (asynchronous, checkpoints 2, 4, 6) resumes from step 6 and saves 7 and 8, each with a manifest that
    verifies; both modes log the same numbers."""
    logged = {}
    for async_save in (True, False):
        workdir = tmp_path / f"async_{async_save}"
        shutil.copytree(good_run, workdir)
        argv = cli_args(
            workdir, token_cache, steps=8, checkpoint_every_steps=1, async_checkpointing=async_save
        )
        assert cli.main(["fp4jax.train", *argv]) == 0, capsys.readouterr().err
        ckpts = workdir / "checkpoints"
        assert sorted(integrity.step_dirs(str(ckpts))) == [6, 7, 8]  # keep_checkpoints 3
        for step in (7, 8):
            assert integrity.has_manifest(str(ckpts / str(step))), (async_save, step)
            assert integrity.verify(str(ckpts / str(step))) is None, (async_save, step)
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["resumed_from_step"] == 6 and summary["steps"] == 8
        logged[async_save] = compare(workdir)
    assert [m["step"] for m in logged[False] if m["eval_loss"] is None][-3:] == [6, 7, 8]
    assert logged[True] == logged[False]


def test_disk_full_is_told_from_other_errors():
    chained = RuntimeError("save failed")
    chained.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert checkpoint._is_disk_full(chained)
    assert checkpoint._is_disk_full(ValueError('RESOURCE_EXHAUSTED: Error writing "d/abc" in OCDBT database'))
    assert not checkpoint._is_disk_full(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GB"))
    assert not checkpoint._is_disk_full(OSError(errno.EACCES, "Permission denied"))


# ------------------------------------------------------------------------------ divergence and signals


def test_nan_exits_3_with_what_is_known_and_writes_the_summary(tmp_path, token_cache, capsys):
    fresh = tmp_path / "fresh"
    assert cli.main(["fp4jax.train", *cli_args(fresh, token_cache, debug_nan_at_step=3)]) == 3
    err = error_lines(capsys)
    assert len(err) == 1 and "non-finite loss (nan) at step 3" in err[0], err
    losses = train_losses(fresh)
    assert f"last finite loss {losses[1]:.4f} at step 2" in err[0] and "started from scratch" in err[0]
    summary = json.loads((fresh / "summary.json").read_text())
    assert (summary["status"], summary["diverged_step"], summary["divergence_reason"]) == (
        "diverged",
        3,
        "non_finite_loss",
    )
    assert (summary["divergence"]["kind"], summary["divergence"]["step"]) == ("non_finite_loss", 3)
    assert summary["diverged_tokens"] == 3 * 8 * 32 and [s for s, _ in summary["last_finite_losses"]] == [
        1,
        2,
    ]
    assert checkpoint.make_manager(str(fresh), keep=3).all_steps() == [2]  # the NaN state is never saved

    # The same command again: restored from step 2, and the message says so.
    assert cli.main(["fp4jax.train", *cli_args(fresh, token_cache, debug_nan_at_step=3)]) == 3
    err = error_lines(capsys)
    assert len(err) == 1 and "at step 3" in err[0] and "restored from step 2" in err[0], err


def test_sigint_saves_exits_0_and_resumes_with_the_same_losses(tmp_path, good_run, token_cache, xla_cache):
    """The command line in a subprocess (`python -m fp4jax.train` with the byte-level tokenizer of these
    runs: tiny_runs.BYTES_CLI); SIGINT once 2 updates are logged: save, exit 0, resumable."""
    cmd = [sys.executable, "-c", BYTES_CLI, *cli_args(tmp_path, token_cache, steps=100_000)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=xla_cache_env(xla_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics_path = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no 2 steps logged in time"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGINT")]
    assert summary["status"] == "preempted" and len(stopped) == 1, err
    assert f"after update {summary['steps']}; saved checkpoint" in stopped[0]
    assert checkpoint.make_manager(str(tmp_path), keep=3).all_steps()[-1] == summary["steps"]

    resumed = trainer.train(tiny_config(token_cache, steps=max(6, summary["steps"] + 1)), str(tmp_path))
    assert resumed["resumed_from_step"] == summary["steps"]
    assert compare(tmp_path)[: len(compare(good_run))] == compare(good_run)


def test_second_signal_stops_at_once_with_exit_130(monkeypatch, capsys):
    signals = StopSignals()
    signals.handle(signal.SIGINT, None)
    assert signals.requested == "SIGINT" and signals.agreed(1)
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)

    def interrupted(config, workdir):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "train", interrupted)
    assert cli.main(["fp4jax.train", "--config", os.path.join(ROOT, "configs", "tiny_c4_h16.py")]) == 130
    assert len(error_lines(capsys)) == 1


# ------------------------------------------------------------------------------------ bad input


def _bad_record_dir(tmp_path):
    data = tmp_path / "bad_data"
    data.mkdir()
    import gzip

    with gzip.open(data / "c4-train.00000-of-00001.json.gz", "wt") as f:
        f.write('{"text": "fine"}\n{not json\n')
    return data


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.stepz=5", "unknown config key --config.stepz; did you mean --config.steps?"),
        ("--config.optimizer.peak_lrr=1", "did you mean --config.optimizer.peak_lr?"),
        ("--config.no_such_key=1", "unknown config key --config.no_such_key"),
        ("--config.steps=abc", "--config.steps=abc"),
        ("--config.recipe=mxfp5", "unknown recipe 'mxfp5'"),
        ("--config.mesh.tensor=3", "does not fit {devices} devices"),
        ("--config.global_batch=12", "global batch 12 is not divisible"),
        ("--config.grad_accum=5", "global_batch 8 is not divisible by grad_accum 5"),
        ("--config.data.path=/no/such/dir", "/no/such/dir does not exist; set --config.data.path"),
        ("--config.data.path={empty}", "set --config.data.path"),
        ("--config.data.path={bad}", "set --config.data.on_bad_record=skip"),
        ("--config.init_checkpoint=/no/such/ckpt", "init_checkpoint /no/such/ckpt does not exist"),
        ("--workdir=/proc/fp4jax_run", "workdir /proc/fp4jax_run cannot be created or written"),
    ],
)
def test_bad_input_is_one_line_naming_it_and_exit_2(override, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no data here")
    override = override.format(empty=tmp_path / "empty", bad=_bad_record_dir(tmp_path))
    message = message.format(devices=jax.device_count())  # 8 fake CPU devices, or the GPUs present
    if override == "--config.global_batch=12" and 12 % jax.device_count() == 0:
        pytest.skip(f"12 sequences split evenly over {jax.device_count()} devices: nothing to reject")
    argv = ["fp4jax.train", "--config", os.path.join(ROOT, "configs", "tiny_c4_h16.py")]
    argv += ["--workdir", str(tmp_path / "run"), f"--config.data.cache_dir={tmp_path / 'cache'}", override]
    assert cli.main(argv) == 2
    err = error_lines(capsys)  # (a tokenizing progress bar may precede it)
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()  # a failed start leaves no workdir behind


def test_a_failed_start_removes_only_the_directories_it_created(tmp_path, capsys):
    """The new parents of a new workdir go with it; a workdir that existed stays, with what it held."""
    argv = ["fp4jax.train", "--config", os.path.join(ROOT, "configs", "tiny_c4_h16.py")]
    argv += [f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.path=/no/such/dir"]
    assert cli.main([*argv, "--workdir", str(tmp_path / "runs" / "new" / "run")]) == 2
    assert not (tmp_path / "runs").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    assert cli.main([*argv, "--workdir", str(tmp_path / "kept")]) == 2
    assert os.listdir(tmp_path / "kept") == ["notes.txt"]
    assert len(error_lines(capsys)) == 2


def test_native_gemms_that_cannot_compile_are_one_line_and_exit_2(tmp_path, failing_scaled_dot, capsys):
    """FP4JAX_GEMM_BACKEND=native where XLA cannot compile scaled-dot (as on an H200 with Triton GEMMs
    off) stops before anything is traced, naming the back end and the way out."""
    failing_scaled_dot.setenv("FP4JAX_GEMM_BACKEND", "native")
    argv = ["fp4jax.train", "--config", os.path.join(ROOT, "configs", "tiny_c4_h16.py")]
    argv += ["--workdir", str(tmp_path / "run"), f"--config.data.cache_dir={tmp_path / 'cache'}"]
    assert cli.main(argv) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "recipe mxfp4_full_h16: GEMM back end 'native' (environment" in err[0], err
    assert "XLA cannot compile jax.lax.scaled_dot in this process" in err[0]


def test_internal_error_keeps_its_traceback(tmp_path, monkeypatch):
    """A bug (here an AttributeError inside the trainer) is not dressed as bad input: main lets it
    propagate, so the interpreter prints the traceback and exits 1."""

    def broken(*args):
        return None.state

    monkeypatch.setattr(trainer, "build_run", broken)
    argv = [
        "fp4jax.train",
        "--config",
        os.path.join(ROOT, "configs", "tiny_c4_h16.py"),
        "--workdir",
        str(tmp_path),
    ]
    with pytest.raises(AttributeError):
        cli.main(argv)


def test_finished_run_started_again_changes_nothing(run_copy, token_cache, capsys):
    def snapshot():
        return {
            os.path.join(r, f): (os.stat(os.path.join(r, f)).st_mtime_ns, os.path.getsize(os.path.join(r, f)))
            for r, _, fs in os.walk(run_copy)
            for f in fs
        }

    before = snapshot()
    summary = trainer.train(tiny_config(token_cache), str(run_copy))
    err = capsys.readouterr().err
    finished = f"the run in {run_copy} is finished: it did not reach eval loss 2.0 in its 6 updates; "
    assert finished + f"its summary is {run_copy / 'summary.json'}; raise --config.steps" in err, err
    assert snapshot() == before  # no summary rewrite, no new TensorBoard event file, no checkpoint
    assert summary == json.loads((run_copy / "summary.json").read_text())
    assert read_metrics(str(run_copy))[-1]["step"] == 6
