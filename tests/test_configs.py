"""Every configs/*.py loads, has the base's keys, names a real preset, and its model eval_shapes."""

import glob
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from fp4jax.configs import base
from fp4jax.models.llama import Llama
from fp4jax.ops import PRESETS
from fp4jax.train import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if not p.endswith("__init__.py"))
LADDER = {
    "bf16": "bf16",
    "fp8": "fp8",
    "fp8_delayed": "fp8_delayed",
    "fprop": "mxfp4_fprop",
    "fprop_dgrad": "mxfp4_fprop_dgrad",
    "full": "mxfp4_full",
    "full_sr": "mxfp4_full_sr",
    "full_rht": "mxfp4_full_rht",
    "h16": "mxfp4_full_h16",
    "h32": "mxfp4_full_h32",
    "h16_wgrad_only": "mxfp4_full_h16_wgrad_only",
}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _keys(cfg, prefix=""):
    out = set()
    for k, v in cfg.items():
        out.add(prefix + k)
        if hasattr(v, "items") and k != "data":
            out |= _keys(v, prefix + k + ".")
    return out


class _Tok:
    name, vocab_size = "gpt2", 50257


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_its_model_eval_shapes(path):
    cfg = _load(path)
    assert _keys(cfg) == _keys(base.get_config()), "a config adds or drops keys of fp4jax/configs/base.py"
    assert cfg.recipe in PRESETS
    with open(path) as f:
        assert "python -m fp4jax.train --config configs/" + os.path.basename(path) in f.read()
    tok = _Tok()
    if cfg.data.tokenizer == "llama3":
        tok.name, tok.vocab_size = "llama3", 128256
    model, model_cfg = build_model(cfg, tok)
    assert isinstance(model, Llama) and model_cfg.vocab_size >= tok.vocab_size
    tokens = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert "params" in shapes


def test_the_8b_ladder_is_complete():
    for suffix, recipe in LADDER.items():
        cfg = _load(os.path.join(ROOT, "configs", f"llama8b_c4_{suffix}.py"))
        assert cfg.recipe == recipe
        assert (cfg.model.size, cfg.global_batch, cfg.seq_len) == ("8b", 32, 8192)
        assert cfg.eval_every_sequences // cfg.global_batch == 384
        assert cfg.target_eval_loss == 3.3
        assert cfg.optimizer.peak_lr is None  # resolved by mlperf_lr(global_batch): 8e-4, 128 warmup steps
