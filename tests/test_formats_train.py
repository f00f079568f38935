"""A tiny training run per block format and per recipe of the literature through the trainer
(tests/tiny_runs.py: tiny_c4 shrunk).

MXFP6 E2M3's full rung runs in the default lane; NVIDIA's NVFP4 recipe (its final block in BF16, the
model's `bf16_last_blocks`, how the recipe keeps its last layers in high precision) and the other
formats' full rungs (NVFP4, MXFP6 E3M2, MXFP8) in the long lane: a tiny NVFP4 full run takes about
22 s on the CPU, an MXFP6 one 9 s (2026-12-07).
The newer recipes (docs/numerics.md, "Recipes of the literature"): qwix's OAS on the full rung in the
default lane (an MX step compiles in seconds); Four-over-Six, Quartet II, the MLPerf MI355X recipe and
NVIDIA's NVFP4 recipe with its BF16 blocks (the 8B preset's last four, the 12B preset's first two and
last eight, on a tiny model deep enough to keep one quantized block) in the long lane.
Each: the loss is finite at every update and falls, and the run's summary records the recipe and the
resolved back end.
"""

import json
import math

import long_lane
import pytest
from tiny_runs import compilation_cache, tiny_config, train_losses

from fp4jax.train import train
from fp4jax.training import setup
from fp4jax.training.errors import ConfigError

FIXTURES = (compilation_cache,)  # the session's tiny-run fixtures (conftest.py)

RUNS = [
    ("nvfp4_nvidia", {"model.bf16_last_blocks": 1}),
    ("nvfp4_full", {}),
    ("mxfp6_e2m3_full", {}),
    ("mxfp6_e3m2_full", {}),
    ("mxfp8", {}),
    ("mxfp4_full_oas", {}),
    ("nvfp4_4over6", {}),
    ("nvfp4_quartet2", {}),
    ("mxfp4_mlperf_mi355x", {}),
    ("nvfp4_nvidia_8b", {"model.n_layers": 5}),
    ("nvfp4_nvidia_12b", {"model.n_layers": 11}),
]


@long_lane.parametrize("recipe, overrides", RUNS, default=[2, 5])
def test_tiny_run_trains(tmp_path, token_cache, recipe, overrides):
    quiet = {"checkpoint_every_steps": 0, "eval_every_sequences": 10**9}
    train(tiny_config(token_cache, recipe=recipe, **quiet, **overrides), str(tmp_path))
    losses = train_losses(tmp_path)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == recipe and summary["execution"]["backend"], summary


@pytest.mark.parametrize("recipe, blocks", [("nvfp4_nvidia_12b", (2, 8)), ("nvfp4_nvidia_8b", (0, 4))])
def test_a_preset_with_bf16_blocks_sets_them_in_the_model_config(tmp_path, recipe, blocks):
    config = setup.resolve_config(tiny_config(tmp_path, recipe=recipe, **{"model.n_layers": 12}))
    assert (config.model.bf16_first_blocks, config.model.bf16_last_blocks) == blocks
    plain = setup.resolve_config(
        tiny_config(tmp_path, recipe="nvfp4_nvidia", **{"model.bf16_last_blocks": 3})
    )
    assert plain.model.bf16_last_blocks == 3  # other presets leave the config's own
    with pytest.raises(ConfigError, match=f"recipe {recipe} keeps {blocks[1]} as model.bf16_last_blocks"):
        setup.resolve_config(tiny_config(tmp_path, recipe=recipe, **{"model.bf16_last_blocks": 1}))


def test_the_formats_plan_loads_and_names_presets():
    """fp4jax/study/plans/formats125m.toml: one stage whose arms are every block format's full rung."""
    import os

    from fp4jax.ops import PRESETS
    from fp4jax.study.designs import load_plan

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plan = load_plan(os.path.join(root, "fp4jax", "study", "plans", "formats125m.toml"))
    arms = plan.stage("formats").arms
    assert set(arms.values()) <= set(PRESETS)
    formats = {"mxfp4_full", "mxfp6_e2m3_full", "mxfp6_e3m2_full", "nvfp4_full", "nvfp4_nvidia"}
    assert formats <= set(arms.values())
