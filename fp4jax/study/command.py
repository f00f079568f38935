"""The exit rule the study's command lines share (python -m fp4jax.ladder, python -m fp4jax.study).

Exit codes: 0 when the command ends (whatever its runs' outcomes), 2 for bad input (a one-line error), 130
when interrupted by Ctrl-C or SIGTERM; a preempted command stops its runs cleanly, and rerunning the same
command resumes.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from fp4jax.training.errors import UserError

__all__ = ["run_command"]


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_command(command: Callable[[], None], name: str) -> int:
    """Runs `command()` with SIGTERM treated as Ctrl-C and returns the exit code above."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        command()
    except (ValueError, FileNotFoundError, UserError) as exc:  # UserError: a checkpoint that fails its check
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0
