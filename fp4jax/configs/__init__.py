"""Shared config builders: `base` (every key the trainer reads) and `ladder` (the study's rungs).

configs/*.py are thin launchable files over these (`from fp4jax.configs import ladder`), so a config
imports from anywhere without sys.path edits.
"""
