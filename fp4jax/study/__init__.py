"""The study harness as a pipeline (python -m fp4jax.study, python -m fp4jax.ladder), lowest layer first:

records (runs: run directories, summaries, Eval; runner: trainer processes; stats: statistics on plain
numbers) -> plan (the TOML plan file) -> gate (a stage's calibration gate) and analysis (tokens to
target) -> schedule (reuse, progress, schedule: runs within a budget) -> claims (claims, lr_stress,
branch_analysis) -> report (tables, plots, report: one writer) -> designs (scratch, branching; the
table in designs) -> the command line (__main__). A lower layer never imports a higher one
(tests/test_imports.py); docs/design.md's Layout lists each module."""

__all__: list[str] = []  # the submodules are the API
