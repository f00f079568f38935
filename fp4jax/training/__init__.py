"""Trainer pieces behind `python -m fp4jax.train`: optimizer, train state and step, checkpoints, metrics."""
