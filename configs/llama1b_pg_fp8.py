"""Single-GPU 1B check, recipe fp8_mlperf: delayed-scaling FP8 as in the MLPerf
reference (setup and token arithmetic: llama1b_pg_bf16.py).

    python -m fp4jax.train --config configs/llama1b_pg_fp8.py \
        --workdir runs/llama1b_pg_fp8 --config.data.path=data/pg_en
"""

from fp4jax.configs import rungs


def get_config():
    return rungs.rung("1b_pg", "fp8_mlperf")
