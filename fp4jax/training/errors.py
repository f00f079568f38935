"""The exceptions a user can cause, which the command line turns into one line and exit code 2.

Everything else (a bug in fp4jax, jax or a library) is not caught there: it keeps its traceback and exits 1.
`fp4jax.data.DataError` (bad data or data configuration) is a user error too; it lives in fp4jax.data,
which does not depend on the trainer.
"""

__all__ = [
    "DIVERGED_EXIT_CODE",
    "CheckpointError",
    "ConfigError",
    "DiskFullError",
    "UserError",
    "WorkdirError",
]

DIVERGED_EXIT_CODE = 3  # python -m fp4jax.train's exit code for a diverged run (summary.json is written)


class UserError(Exception):
    """Bad input or an environment the user controls; the message is one line naming it and the fix."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work (unknown preset, indivisible batch, mesh that does not fit)."""


class WorkdirError(UserError):
    """The workdir cannot be created or written."""


class CheckpointError(UserError):
    """No checkpoint can be restored (all are bad, or they do not fit this config)."""


class DiskFullError(UserError):
    """A checkpoint could not be written for lack of space; the previous checkpoint is intact."""
