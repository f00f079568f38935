"""The one exception type of `fp4jax.data`."""


class DataError(ValueError):
    """Bad input data or data configuration: the message is one line naming the file, value or sizes."""
