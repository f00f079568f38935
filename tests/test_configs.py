"""Every configs/*.py imports without sys.path edits, resolves to a model, names a real preset; a rung file
differs from its set-up's baseline only in the recipe; the proxy set-ups keep the study's rules."""

import functools
import glob
import importlib.util
import math
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp4jax
from fp4jax.configs import base, rungs
from fp4jax.models.llama import Llama
from fp4jax.ops import PRESETS
from fp4jax.training.setup import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
# File prefix -> ladder set-up, for the one-file-per-rung ladders.
LADDER_FILES = {"llama8b_c4_": "8b_c4", "llama125m_pg_": "125m_pg"}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _keys(cfg, prefix=""):
    out = set()
    for k, v in cfg.items():
        out.add(prefix + k)
        if hasattr(v, "items"):
            out |= _keys(v, prefix + k + ".")
    return out


class _Tok:
    name, vocab_size = "gpt2", 50257


def test_configs_import_from_anywhere_without_sys_path_edits(tmp_path):
    """A fresh interpreter started outside the repository loads every file by path (the fp4jax package
    provides fp4jax.configs; nothing puts configs/ on sys.path)."""
    script = (
        "import importlib.util, sys\n"
        "for path in sys.argv[1:]:\n"
        "    spec = importlib.util.spec_from_file_location('cfg', path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    module.get_config()\n"
        "assert not any(p.rstrip('/').endswith('configs') for p in sys.path)\n"
        "print('ok', len(sys.argv) - 1)\n"
    )
    # Only the directory that holds the fp4jax package being tested (site-packages when installed, the
    # checkout when the GPU lane runs from one on PYTHONPATH); never configs/ or anything else.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fp4jax.__file__)))
    # Other PYTHONPATH entries (dependencies installed with --target, as on the GPU machine) stay.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "configs" not in p]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([package_root, *kept])}
    out = subprocess.run(
        [sys.executable, "-c", script, *CONFIGS], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", str(len(CONFIGS))]


@functools.cache  # the configs share a few LlamaConfigs (5 for 30 files), and equal ones trace alike
def _built_parameters(model_cfg) -> int:
    """How many parameters the plain Llama of model_cfg initialises, traced (jax.eval_shape)."""
    shapes = jax.eval_shape(
        Llama(model_cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 32), jnp.int32)
    )
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.meta.unbox(shapes["params"])))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_its_model_eval_shapes(path):
    cfg = _load(path)
    assert _keys(cfg) == _keys(base.get_config()), "a config adds or drops keys of fp4jax/configs/base.py"
    assert cfg.recipe in PRESETS
    with open(path) as f:
        text = f.read()
    assert "python -m fp4jax.train --config configs/" + os.path.basename(path) in text
    assert "sys.path" not in text
    # No path of one machine: the only absolute paths are the documented placeholder for a C4 copy.
    absolute = re.findall(r"(?:^|[\s=('\"])(/[A-Za-z_][^\s)'\"]*)", text)
    assert all(p.startswith("/data/") for p in absolute), absolute
    assert cfg.data.path == "bundled" or not os.path.isabs(cfg.data.path), cfg.data.path
    tok = _Tok()
    if cfg.data.tokenizer == "llama3":
        tok.name, tok.vocab_size = "llama3", 128256
    model, model_cfg = build_model(cfg, tok)
    assert isinstance(model, Llama) and model_cfg.vocab_size >= tok.vocab_size
    assert model_cfg.scaled_output_init  # Megatron/NeMo's init for every Llama config
    # The parameters come from the LlamaConfig alone: a recipe changes how the GEMMs compute, not which
    # weights exist (test_llama applies one set of params under every recipe). Tracing the plain module's
    # init is 10x faster than tracing the quantized forward pass it runs.
    assert model.config == model_cfg
    built = _built_parameters(model_cfg)
    # The module the config builds has exactly the parameters its LlamaConfig describes, counted
    # independently here: embedding and head V x D, per block 4 attention projections, 3 MLP matrices
    # and 2 norm scales, plus the final norm.
    c = model_cfg
    attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    per_block = attn + 3 * c.d_model * c.d_ff + 2 * c.d_model
    assert built == 2 * c.vocab_size * c.d_model + c.n_layers * per_block + c.d_model


@pytest.mark.parametrize("prefix", sorted(LADDER_FILES))
def test_rung_files_differ_from_the_baseline_only_in_recipe(prefix):
    setup = LADDER_FILES[prefix]
    baseline = rungs.rung(setup, "bf16").to_dict()
    found = {}
    for path in glob.glob(os.path.join(ROOT, "configs", prefix + "*.py")):
        cfg = _load(path).to_dict()
        found[os.path.basename(path)[len(prefix) : -3]] = cfg.pop("recipe")
        assert cfg == {k: v for k, v in baseline.items() if k != "recipe"}, path
    assert found == rungs.RUNGS  # every rung has its file, and each file its rung's preset


def test_the_8b_ladder_is_the_mlperf_setup():
    for recipe in rungs.RUNGS.values():
        cfg = rungs.rung("8b_c4", recipe)
        assert (cfg.model.size, cfg.global_batch, cfg.seq_len) == ("8b", 32, 8192)
        assert cfg.eval_every_sequences // cfg.global_batch == 384
        assert cfg.target_eval_loss == 3.3
        assert cfg.optimizer.peak_lr is None  # resolved by mlperf_lr(global_batch): 8e-4, 128 warmup steps
        assert cfg.optimizer.schedule == "cosine"
        assert (cfg.fp8_scaling, cfg.data.separator) == ("delayed", "none")  # as the reference
    assert _load(os.path.join(ROOT, "configs", "llama8b_c4_fp8.py")).recipe == "fp8_mlperf"
    assert _load(os.path.join(ROOT, "configs", "llama8b_c4_h16.py")).recipe == "mxfp4_full_h16"


@pytest.mark.parametrize("setup", [s for s in rungs.SETUPS if "proxy" in s])
def test_proxy_setups_follow_the_study_rules(setup):
    """Constant LR after warmup, at most one epoch (pg_en: 33.3M GPT-2 training tokens), an evaluation at
    least every 2 % of the run, and a relative data path (set data.path on the command line)."""
    cfg = rungs.rung(setup, "mxfp4_full")
    assert cfg.optimizer.schedule == "constant" and 0 < cfg.optimizer.warmup_steps < cfg.steps
    tokens = cfg.steps * cfg.global_batch * cfg.seq_len
    if setup.endswith("_pg"):
        assert tokens <= 33_300_000
    assert cfg.eval_every_sequences <= 0.02 * cfg.steps * cfg.global_batch
    assert cfg.eval_at_end and not os.path.isabs(cfg.data.path)
    assert (cfg.fp8_scaling, cfg.data.separator) == ("delayed", "none")
    assert {c.model.size for c in rungs.ladder(setup, rungs.PROXY_RECIPES).values()} == {setup[:4]}


def test_ladder_builder_takes_the_recipe_list_and_checks_names():
    configs = rungs.ladder("125m_proxy_pg", ["fp8_mlperf", "mxfp4_full_h16"])
    assert [c.recipe for c in configs.values()] == ["fp8_mlperf", "mxfp4_full_h16"]
    assert set(rungs.PROXY_RECIPES) <= set(PRESETS)
    with pytest.raises(ValueError, match="unknown recipe 'mxfp3'"):
        rungs.rung("125m_proxy_pg", "mxfp3")
    with pytest.raises(ValueError, match="unknown ladder set-up"):
        rungs.rung("70b_c4", "bf16")


def test_base_has_the_shared_keys_with_their_defaults():
    c = base.get_config()
    assert (c.divergence.spike_nats, c.divergence.window) == (0.0, 20)
    assert c.diagnostics.every == 0
    assert (c.profile.start_step, c.profile.num_steps) == (0, 0)
    assert (c.fp8_scaling, c.optimizer.schedule, c.data.separator) == ("delayed", "cosine", "none")
    assert c.model.scaled_output_init is None  # None = LlamaConfig's default, True
