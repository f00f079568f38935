"""The study harness behind `python -m fp4jax.ladder`: runs (the run directory and its summary), runner (the
grid of rung x seed x LR, several at once), analysis (tokens to target, seed statistics, overhead, speed-up,
LR sensitivity), report (markdown and JSON) and plots."""

__all__: list[str] = []  # the submodules are the API
