"""Shared config builders: `base` (every key the trainer reads) and `rungs` (the study's set-ups and rungs).

configs/*.py are thin launchable files over these (`from fp4jax.configs import rungs`), so a config
imports from anywhere without sys.path edits.
"""

__all__: list[str] = []  # the submodules are the API
