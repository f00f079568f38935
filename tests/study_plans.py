"""Plan files for the study's tests: one [[stages]] block of a tiny from-scratch plan as TOML text."""

import os

__all__ = ["CLAIMS_FROM", "stage_toml"]

# A tiny plan's top-level line that tests the committed study's claims (its [claims] table).
CLAIMS_FROM = 'claims_from = "{}"\n'.format(
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "fp4jax",
        "study",
        "plans",
        "proxy125m.toml",
    )
)


def stage_toml(
    name: str,
    arms: dict[str, str],
    *,
    seeds=(0, 1),
    steps: int = 4,
    warmup_steps: int = 1,
    peak_lr: float = 1e-3,
    backend: str = "auto",
    extra: str = "",
) -> str:
    """One scratch_paired [[stages]] block on the tiny config with baseline arm "a": `extra` lines go
    before its arms."""
    arm_lines = "".join(f'{arm} = "{recipe}"\n' for arm, recipe in arms.items())
    return f"""
[[stages]]
name = "{name}"
design = "scratch_paired"
config = "configs/tiny_c4_h16.py"
baseline = "a"
seeds = {list(seeds)}
steps = {steps}
warmup_steps = {warmup_steps}
peak_lr = {peak_lr}
backend = "{backend}"
run_minutes = 0.01
{extra}[stages.arms]
{arm_lines}"""
