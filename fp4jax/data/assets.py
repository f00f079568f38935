"""Where the bundled assets live, and one error-message helper the data modules share.

The lowest module of fp4jax.data: it imports nothing from the package, so the tokenizers
and the document readers can both depend on it without depending on each other.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ASSETS_DIR", "BUNDLED_DATA_DIR", "first_line"]

ASSETS_DIR = Path(__file__).parent / "assets"
BUNDLED_DATA_DIR = ASSETS_DIR / "c4_en_sample"


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (third-party messages may span many)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__
