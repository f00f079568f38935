"""Reading XLA_FLAGS: one rule for whether a flag is named and what it says, for every module that asks.

XLA reads XLA_FLAGS once, when jax starts its backends, and a flag named twice takes its last value. A
boolean flag named bare (`--xla_foo`) is true. A longer flag that starts with the same name
(`--xla_foo_bar` for `--xla_foo`) is another flag. Nothing here imports jax.
"""

import os
import re

__all__ = ["DETERMINISTIC_OPS", "TRITON_GEMM", "boolean", "values"]

_TRUE, _FALSE = ("", "true", "1"), ("false", "0")

# The flags fp4jax reads or writes (the trainer's options: training/setup.py XLA_OPTIONS).
TRITON_GEMM = "--xla_gpu_enable_triton_gemm"
DETERMINISTIC_OPS = "--xla_gpu_deterministic_ops"


def values(flag: str) -> list[str]:
    """The values XLA_FLAGS gives `flag` ("--xla_..."), in order ('' for a bare flag); [] if not named."""
    return re.findall(rf"{re.escape(flag)}(?![\w-])(?:=(\S*))?", os.environ.get("XLA_FLAGS", ""))


def boolean(flag: str) -> bool | None:
    """What XLA_FLAGS sets a boolean `flag` to (its last value; bare = true), or None if it is not named.

    A value XLA would not read as a boolean is a ValueError naming it, not a guess.
    """
    named = values(flag)
    if not named:
        return None
    last = named[-1].lower()
    if last not in _TRUE + _FALSE:
        raise ValueError(f"XLA_FLAGS sets {flag}={named[-1]}; write {flag}=true or {flag}=false")
    return last in _TRUE
