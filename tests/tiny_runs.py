"""Tiny training runs for tests/test_train.py and tests/test_faults.py.

The tiny_c4 set-up (configs/tiny_c4_h16.py) shrunk: recipe fp8_delayed (its amax histories are train state
that must survive a resume), 32-token sequences, batch 8, a handful of steps. Runs of one program (new jit
objects each) compile once through a persistent XLA cache, the CLI subprocesses too.

The runs of these modules read the bundled C4 sample as bytes (`bytes_tokenizer`: 257 ids, a 384-row
embedding and LM head instead of GPT-2's 50,304): the vocabulary's size is not what they test, and at
GPT-2's it is most of each run's time and of each checkpoint's 77 MB. The module fixture
`compilation_cache` puts it in place of the trainer's tokenizer; `BYTES_CLI` does the same in a
subprocess. Byte-level losses start at ln 384 = 5.96, below the tiny set-up's target of 7.5, so these
runs' target is 2.0 (BYTES_OVERRIDES), which 6 updates do not reach. Training with the GPT-2 tokenizer is
still tested: tests/test_ladder.py (real `python -m fp4jax.train` subprocesses), tests/test_selfcheck.py.

Session fixtures (one token cache, compilation cache and finished run for every module) are registered in
conftest.py; a module that trains imports `compilation_cache`. Under pytest-xdist the workers share them
(`session_dir`): the finished run is trained once, by whichever worker asks first, and the others'
runs of the same programs load them from the shared compilation cache.
"""

import contextlib
import fcntl
import json
import os
import pathlib
import pickle

import jax
import pytest
import tiktoken

from fp4jax.configs import rungs
from fp4jax.data.tokenizers import GPT2_PAT, Tokenizer
from fp4jax.training import setup, trainer
from fp4jax.training.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_c4_h16.py")
COMPARED = ("step", "loss", "grad_norm", "lr", "eval_loss", "tokens")

TINY_OVERRIDES = {
    "recipe": "fp8_delayed",
    "model.remat": "none",
    "seq_len": 32,
    "global_batch": 8,
    "steps": 6,
    "optimizer.peak_lr": 1e-2,
    "optimizer.warmup_steps": 1,
    "optimizer.lr_decay_steps": 6,
    "eval_every_sequences": 32,
    "eval_sequences": 8,
    "eval_batch_size": 8,
    "eval_at_end": False,
    "checkpoint_every_steps": 2,
    "progress_bar": False,
    "data.num_threads": 1,
}
# Byte-level runs only (see above): a target the tiny runs do not reach.
BYTES_OVERRIDES = {"target_eval_loss": 2.0}


def bytes_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: ids 0-255 are the bytes, 256 ends a document."""
    encoding = tiktoken.Encoding(
        "bytes",
        pat_str=GPT2_PAT,
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )
    return Tokenizer("bytes", encoding, eod_id=256, bos_id=None, file="", fingerprint="bytes-256")


# `python -m fp4jax.train ARGS` (runpy runs the module as -m does) with the byte-level tokenizer.
BYTES_CLI = (
    "import runpy, sys; import tiny_runs; from fp4jax.training import setup; "
    "setup.load_tokenizer = lambda spec: tiny_runs.bytes_tokenizer(); "
    "runpy.run_module('fp4jax.train', run_name='__main__', alter_sys=True)"
)


def _settings(token_cache, overrides: dict) -> dict:
    """The dotted config keys every tiny run sets: TINY_OVERRIDES, BYTES_OVERRIDES, the cache, then yours."""
    return {**TINY_OVERRIDES, **BYTES_OVERRIDES, "data.cache_dir": str(token_cache), **overrides}


def tiny_config(token_cache, **overrides):
    """The tiny config with TINY_OVERRIDES, then `overrides` (dotted keys: **{"data.path": p})."""
    c = rungs.rung("tiny_c4", "mxfp4_full_h16")
    for key, value in _settings(token_cache, overrides).items():
        *parents, leaf = key.split(".")
        node = c
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return c


def cli_args(workdir, token_cache, **overrides) -> list[str]:
    values = _settings(token_cache, overrides)
    return ["--config", CONFIG, "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in values.items()]


def compare(workdir) -> list[dict]:
    """The metrics lines' deterministic fields (no timings)."""
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(str(workdir))]


def train_losses(workdir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(workdir)) if "eval_loss" not in r]


def error_lines(capsys) -> list[str]:
    """stderr's "error: ..." lines (warnings and orbax's log lines are not errors)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def subprocess_env(*first_on_path: str, **variables: str) -> dict:
    """os.environ with `variables` set and `first_on_path` in front of PYTHONPATH. The entries already
    there stay: they may be the dependencies themselves (installed with --target, as on the GPU machine)."""
    path = os.pathsep.join(filter(None, [*first_on_path, os.environ.get("PYTHONPATH")]))
    return {**os.environ, **variables, "PYTHONPATH": path}


def xla_cache_env(xla_cache) -> dict:
    """The environment of a trainer subprocess: the tests' compilation cache, and tiny_runs importable
    (BYTES_CLI)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess_env(
        here, JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )


def session_dir(tmp_path_factory, name: str):
    """A directory shared by every process of this test session: pytest-xdist gives each worker its own
    base temp directory, all in one parent. (The token cache writes atomically, and JAX's compilation
    cache is made for processes that share it.)"""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    return session_dir(tmp_path_factory, "token_cache")


@pytest.fixture(scope="session")
def xla_cache():
    """The session's one compilation cache (conftest.py sets it up before jax is imported; every process
    of the session shares it), so the tiny runs also reuse programs that other modules compiled."""
    return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


@contextlib.contextmanager
def once_per_session(tmp_path_factory, name: str):
    """A directory of `session_dir` held under a file lock: the first process of the session to enter
    builds what it finds missing there, the others wait for it and find it built."""
    root = session_dir(tmp_path_factory, name)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root


@contextlib.contextmanager
def tiny_run_settings(xla_cache):
    """The compilation cache of the tiny runs and the byte-level tokenizer; the previous settings are
    restored on leaving."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(xla_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(setup, "load_tokenizer", lambda spec: bytes_tokenizer())
            yield
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
        cc.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(xla_cache):
    """Train runs of one program compile once, with the byte-level tokenizer (tiny_run_settings); the
    previous settings are restored for other modules."""
    with tiny_run_settings(xla_cache):
        yield


def record_dispatch_and_fetch(monkeypatch) -> list[str]:
    """Records the trainer's dispatches ("d3": update 3 dispatched) and fetches ("f3") as they happen."""
    events, dispatch, fetch = [], trainer._dispatch, trainer._fetch

    def recorded_dispatch(run, step, batch):
        events.append(f"d{step}")
        return dispatch(run, step, batch)

    def recorded_fetch(run, step, device_metrics, timer):
        events.append(f"f{step}")
        return fetch(run, step, device_metrics, timer)

    monkeypatch.setattr(trainer, "_dispatch", recorded_dispatch)
    monkeypatch.setattr(trainer, "_fetch", recorded_fetch)
    return events


@pytest.fixture(scope="session")
def good_run_result(tmp_path_factory, token_cache, xla_cache):
    """One finished tiny run (checkpoints 2, 4, 6; an evaluation at 4) and the summary train() returned,
    shared: tests read the run or copy it, never change it. (Session-scoped fixtures are set up before
    module-scoped ones: it applies the tiny runs' settings itself.) The order of its dispatches and fetches
    is kept too (good_run_events)."""
    with once_per_session(tmp_path_factory, "good_run") as root:  # one worker trains, the others read it
        workdir, returned = root / "run", root / "returned.pickle"
        if not returned.exists():
            with tiny_run_settings(xla_cache), pytest.MonkeyPatch.context() as mp:
                events = record_dispatch_and_fetch(mp)
                summary = trainer.train(tiny_config(token_cache), str(workdir))
            (root / "events.json").write_text(json.dumps(events))
            returned.write_bytes(pickle.dumps(summary))  # what train() returned, not its summary.json
    return workdir, pickle.loads(returned.read_bytes())


@pytest.fixture(scope="session")
def good_run(good_run_result):
    return good_run_result[0]


@pytest.fixture(scope="session")
def good_run_events(good_run_result):
    """The good run's dispatches and fetches in the order they happened (record_dispatch_and_fetch)."""
    return json.loads((good_run_result[0].parent / "events.json").read_text())
