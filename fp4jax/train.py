"""Train a Llama on C4, MLPerf llama3.1_8b style, with a quantized GEMM recipe.

    python -m fp4jax.train --config configs/tiny_c4_h16.py [--workdir DIR] [--config.KEY=VALUE ...]

This module only parses flags and maps outcomes to exit codes; the trainer is
`fp4jax.training.trainer.train(config, workdir) -> summary` (re-exported here as `fp4jax.train.train`).
The run resumes from the newest good checkpoint in <workdir>/checkpoints. Exit codes: 0 finished, already
finished, or stopped by a first SIGTERM / Ctrl-C after a clean save; 1 internal error (traceback); 2 bad
input (one line "error: ..." on stderr); 3 diverged (the summary is still written); 130 a second Ctrl-C.
Formats: docs/training.md.
"""

import json
import os
import re
import sys

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from fp4jax import logs
from fp4jax.data import DataError
from fp4jax.training.errors import DIVERGED_EXIT_CODE, UserError
from fp4jax.training.setup import apply_xla_options, initialize_distributed
from fp4jax.training.trainer import train

__all__ = ["main", "parse_flags", "train"]


class FlagError(UserError):
    """A bad command line."""


def parse_flags(argv) -> tuple[ml_collections.ConfigDict, str, bool]:
    """(config, workdir, debug) from the command line; flags live in a fresh FlagValues per call.
    FlagError with one line for an unknown flag or config key, a bad value or a missing config file."""
    fv = flags.FlagValues()
    config_flag = config_flags.DEFINE_config_file(
        "config", None, "ml_collections config file (configs/*.py)", flag_values=fv, sys_argv=list(argv)
    )
    flags.DEFINE_string("workdir", None, "run directory; default runs/<config file name>", flag_values=fv)
    flags.DEFINE_bool("debug", False, "Python tracebacks instead of one-line errors", flag_values=fv)
    if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
        print(__doc__ + "\nflags:\n" + fv.get_help())
        raise SystemExit(0)
    try:
        fv(argv)
        if fv.config is None:
            raise FlagError("--config is required, e.g. --config configs/tiny_c4_h16.py")
        path = config_flags.get_config_filename(fv["config"])
        if not os.path.isfile(path):
            raise FlagError(f"config file {path} does not exist; the configs are in configs/*.py")
        config = config_flag.value
    except (flags.Error, AttributeError, KeyError) as exc:
        raise FlagError(flag_message(exc, argv)) from exc
    name = os.path.splitext(os.path.basename(path))[0]
    return config, fv.workdir or os.path.join("runs", name), fv.debug


def flag_message(exc: Exception, argv) -> str:
    """One line for a bad command line. ml_collections reports an unknown config key as an AttributeError or
    KeyError whose text is the quoted key, sometimes followed by a line 'Did you mean "x" instead of "y"?'."""
    inner = exc
    while inner.args and isinstance(inner.args[0], BaseException):  # AttributeError(KeyError(text))
        inner = inner.args[0]
    text = inner.args[0] if inner.args and isinstance(inner.args[0], str) else str(inner)
    if isinstance(exc, flags.UnrecognizedFlagError):
        return f"unknown flag --{exc.flagname}; the flags: --config, --workdir, --debug, --config.KEY=VALUE"
    if isinstance(exc, flags.Error):
        return text.splitlines()[0]
    name = text.splitlines()[0].strip("\"' \\")
    arg = next(
        (a.split("=")[0] for a in argv if a.startswith("--config.") and name in a.split("=")[0].split(".")),
        None,
    )
    if arg is None:
        raise exc  # not about a command-line key: a bug, keep the traceback
    message = f"unknown config key {arg}"
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    if suggestion:
        message += f"; did you mean {arg.rsplit('.', 1)[0]}.{suggestion.group(1)}?"
    return message + " (every key is listed in fp4jax/configs/base.py)"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _print_summary(summary: dict) -> None:
    """The run's summary as one `summary: {...}` line on stdout, from process 0 (summary.json's content)."""
    if jax.process_index() == 0:
        print("summary: " + json.dumps(summary, sort_keys=True), flush=True)


def main(argv=None) -> int:
    """The command line; returns the exit code (see the module docstring). Only user errors (UserError,
    DataError) become one line; anything else propagates with its traceback (exit 1)."""
    argv = sys.argv if argv is None else list(argv)
    debug = "--debug" in argv
    logs.configure()
    try:
        config, workdir, debug = parse_flags(argv)
        apply_xla_options(config)
        initialize_distributed()
        summary = train(config, workdir)
        _print_summary(summary)
    except (UserError, DataError) as exc:
        if debug:
            raise
        return _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, 2)
    except KeyboardInterrupt:
        return _fail(
            "interrupted: stopped at once, unsaved; rerun to continue from the newest checkpoint", 130
        )
    if summary["status"] == "diverged":
        return _fail(summary["divergence_message"], DIVERGED_EXIT_CODE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
