"""fp4jax: MXFP4 / MXFP8 / FP8 pre-training of Llama-class models in JAX and Flax."""

__all__ = ["__version__"]

__version__ = "0.1.0"
