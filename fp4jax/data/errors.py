"""The one exception type of `fp4jax.data`."""

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad input data or data configuration: the message is one line naming the file, value or sizes."""
