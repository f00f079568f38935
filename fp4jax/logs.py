"""How fp4jax speaks: the library logs through `logging.getLogger(__name__)`; the command lines (python -m
fp4jax.train, fp4jax.ladder, fp4jax.diagnose, fp4jax.data.prepare) call `configure()` once and print their
own results on stdout.

The rule for which process speaks: INFO lines only on process 0 (every process would say the same),
warnings and errors on every process (a bad checkpoint or a skipped record may be one process's own).
Lines go to stderr as the message itself, warnings prefixed "warning: ", so the trainer's progress bar and
its one-line messages read as they did with print.
"""

import logging
import os
import sys

__all__ = ["ProcessZeroInfo", "configure", "log_tail"]

TAIL_BYTES = 65536  # how far from a log's end log_tail reads: a long run's log is not read whole

_FORMATS = {logging.WARNING: "warning: %(message)s", logging.ERROR: "error: %(message)s"}


class ProcessZeroInfo(logging.Filter):
    """Lets records at WARNING and above through on every process, lower ones on process 0 only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        import jax  # only when an INFO line is logged: by then the trainer has set up jax.distributed

        return jax.process_index() == 0


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = _FORMATS.get(record.levelno, "%(message)s") % {"message": record.getMessage()}
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a line is written (pytest swaps it per test)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure(level: int = logging.INFO) -> None:
    """Sends the "fp4jax" loggers' records at `level` and above to stderr under the rule above. Calling it
    again changes only the level (one handler, however often the command lines or tests call it)."""
    logger = logging.getLogger("fp4jax")
    logger.setLevel(level)
    logger.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.addFilter(ProcessZeroInfo())
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)


def log_tail(path: str, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The lines of a log file's last `max_bytes` (the first may be cut), decoded leniently; [] when the
    file cannot be read. For reporting how a child process ended, from its log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
