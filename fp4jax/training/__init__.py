"""The trainer behind `python -m fp4jax.train`: `trainer.train(config, workdir) -> summary` and its pieces
(setup, evaluation, checkpoint + integrity, preemption, divergence, summary, metrics, hooks, optimizer,
state); docs/training.md describes them."""

__all__: list[str] = []  # the submodules are the API
