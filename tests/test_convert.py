"""Hugging Face Llama checkpoints in and out (fp4jax/convert.py, fp4jax/interop/hf_llama.py) and runs that
start from them (config.init_params, fp4jax/training/weights.py).

The reference is transformers itself: a tiny random LlamaForCausalLM (GQA, the Llama 3.1 RoPE scaling,
untied embeddings, bf16 weights as Meta's releases are), made here without any download, its norms and
weights perturbed so that no tensor is a constant. Import: fp4jax's float32 logits equal transformers'
and every param equals the tensor this file's own mapping (written from transformers' layout, not from
fp4jax's table) says; export: transformers reloads every tensor bit for bit; fp4jax -> HF -> fp4jax
changes no bit; a run starts from the import (params loaded, optimizer fresh, step 0) and checkpoints;
loading sharded over 8 devices equals loading on one; bad input is one line and writes nothing.
"""

import copy
import json
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec
from tiny_runs import bytes_tokenizer, compilation_cache, tiny_config

from fp4jax import convert
from fp4jax.interop import hf_llama
from fp4jax.models.llama import Llama, llama_config, unstack_layer_params
from fp4jax.models.sharding import make_mesh, sharding_context
from fp4jax.training import setup, state, trainer, weights
from fp4jax.training.errors import ConfigError
from fp4jax.training.optimizer import make_optimizer

FIXTURES = (compilation_cache,)
transformers = torch = None  # imported by _hf_libraries when the module's first test runs


@pytest.fixture(scope="module", autouse=True)
def _hf_libraries():
    """transformers and torch, the module's reference (its tests skip without them): imported here, not
    at collection, where they took about 2 s of every pytest-xdist worker's start."""
    global transformers, torch
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")


# The tiny fp4jax model ("tiny" with the byte-level runs' vocabulary of tiny_runs: 257 padded to 384).
VOCAB, D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FF = 384, 64, 2, 4, 2, 16, 192
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_model():
    """A random LlamaForCausalLM of the tiny shape in float32 whose weights are bf16 values (as a bf16
    release read in float32); norms around 1, weights of std 0.02 to 0.1."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_SCALING,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.02 + 0.08 * torch.rand(())))
            p.copy_(p.bfloat16().float())
    return model


@pytest.fixture(scope="module")
def hf_model():
    return _hf_model()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    """The model saved by transformers in several safetensors files with their index."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    assert os.path.isfile(path / hf_llama.INDEX_FILE) and len(list(path.glob("*.safetensors"))) > 2
    return path


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """`python -m fp4jax.convert from-hf` of hf_dir (sharded over the 8 CPU devices while converting)."""
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    assert convert.main(["from-hf", "--hf", str(hf_dir), "--out", str(out)]) == 0
    return out


def _state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def _expected_params(sd: dict[str, np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
    """The fp4jax params (scanned layout) of a transformers state dict, spelled from transformers' side:
    y = x W^T with W (out, in) and output feature n * head_dim + h."""

    def stack(fmt, f):
        return np.stack([f(sd[fmt.format(i)]) for i in range(LAYERS)])

    layer = "model.layers.{}."
    blocks = f"blocks_0_{LAYERS}"
    return {
        ("embed", "embedding"): sd["model.embed_tokens.weight"],
        ("lm_head",): sd["lm_head.weight"].T,
        ("final_norm", "scale"): sd["model.norm.weight"],
        (blocks, "attn_norm", "scale"): stack(layer + "input_layernorm.weight", lambda w: w),
        (blocks, "mlp_norm", "scale"): stack(layer + "post_attention_layernorm.weight", lambda w: w),
        (blocks, "attn", "q", "kernel"): stack(
            layer + "self_attn.q_proj.weight", lambda w: w.reshape(HEADS, HEAD_DIM, D).transpose(2, 0, 1)
        ),
        (blocks, "attn", "k", "kernel"): stack(
            layer + "self_attn.k_proj.weight", lambda w: w.reshape(KV_HEADS, HEAD_DIM, D).transpose(2, 0, 1)
        ),
        (blocks, "attn", "v", "kernel"): stack(
            layer + "self_attn.v_proj.weight", lambda w: w.reshape(KV_HEADS, HEAD_DIM, D).transpose(2, 0, 1)
        ),
        (blocks, "attn", "o", "kernel"): stack(
            layer + "self_attn.o_proj.weight", lambda w: w.reshape(D, HEADS, HEAD_DIM).transpose(1, 2, 0)
        ),
        (blocks, "mlp", "gate", "kernel"): stack(layer + "mlp.gate_proj.weight", lambda w: w.T),
        (blocks, "mlp", "up", "kernel"): stack(layer + "mlp.up_proj.weight", lambda w: w.T),
        (blocks, "mlp", "down", "kernel"): stack(layer + "mlp.down_proj.weight", lambda w: w.T),
    }


def _saved_params(ckpt, step=None) -> dict[tuple[str, ...], np.ndarray]:
    step_dir = weights.find_step_dir(str(ckpt), step, "test")
    return {
        path: weights.read_leaf(step_dir, path)
        for path in weights.flat_tree(weights.params_metadata(step_dir))
    }


def _assert_same_bits(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == np.float32 and got[key].shape == want[key].shape, key
        np.testing.assert_array_equal(got[key].view(np.uint32), want[key].view(np.uint32), err_msg=str(key))


# ---------------------------------------------------------------------------------------------- import


def test_import_gives_transformers_params_and_logits(hf_model, converted, capsys):
    params = _saved_params(converted)
    _assert_same_bits(params, _expected_params(_state_dict(hf_model)))
    cfg = weights.saved_model_config(weights.find_step_dir(str(converted), None, "test"))
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.rope_scaling, cfg.norm_eps) == (VOCAB, KV_HEADS, True, 1e-5)

    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    model32 = Llama(llama_config("tiny", vocab_size=VOCAB, dtype="float32"))
    logits = np.asarray(jax.jit(model32.apply)({"params": traverse_util.unflatten_dict(params)}, tokens))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()


def test_the_import_prints_the_run_flags_and_records_its_source(hf_dir, converted, tmp_path, capsys):
    out = tmp_path / "again"
    assert convert.main(["from-hf", "--hf", str(hf_dir), "--out", str(out), "--model", "tiny"]) == 0
    printed = capsys.readouterr().out
    assert f"--config.init_params={out} --config.model.size=tiny --config.model.vocab_size={VOCAB}" in printed
    meta = weights.saved_meta(weights.find_step_dir(str(out), None, "test"))
    assert meta["config"]["model"] == {"size": "tiny", "vocab_size": VOCAB}
    assert meta["converted_from"]["eos_token_id"] == 2 and not meta["converted_from"]["tie_word_embeddings"]
    _assert_same_bits(_saved_params(out), _saved_params(converted))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (the CPU lane's fake ones)")
def test_loading_sharded_over_8_devices_equals_loading_on_one(hf_dir):
    cfg = llama_config("tiny", vocab_size=VOCAB)
    one = hf_llama.load_params(str(hf_dir), cfg, make_mesh(devices=jax.devices()[:1]))
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded = hf_llama.load_params(str(hf_dir), cfg, mesh)
    q = sharded[f"blocks_0_{LAYERS}"]["attn"]["q"]["kernel"]
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "fsdp", "tensor")), q.ndim)
    assert len({str(s.index) for s in q.addressable_shards}) == 8  # no two devices hold the same slice
    flat = lambda tree: {k: np.asarray(v) for k, v in weights.flat_tree(tree).items()}  # noqa: E731
    _assert_same_bits(flat(sharded), flat(one))


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_reloads_in_transformers_bit_for_bit(hf_model, converted, tmp_path, dtype):
    out = tmp_path / "hf"
    assert (
        convert.main(
            ["to-hf", "--ckpt", str(converted), "--out", str(out), "--dtype", dtype, "--max-shard-gb", "1e-4"]
        )
        == 0
    )
    index = json.loads((out / hf_llama.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not list(tmp_path.glob(".*partial"))
    with hf_llama.safe_open(str(out / index["weight_map"]["lm_head.weight"]), framework="numpy") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == {"bfloat16": "BF16", "float32": "F32"}[dtype]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:  # bf16 values: read in float32 they are equal bits after a bf16 export too
        assert torch.equal(got[name], want[name]), name
    assert reloaded.config.eos_token_id == 2 and not reloaded.config.tie_word_embeddings
    tokens = torch.tensor(np.random.default_rng(1).integers(0, VOCAB, (1, 16)))
    with torch.no_grad():  # the same weights under the same RoPE (its Llama 3.1 scaling included)
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def test_fp4jax_to_hf_to_fp4jax_changes_no_bit(tmp_path, converted, token_cache):
    """From a trained run's checkpoint (not a Hugging Face import): step 2 of a run started from one."""
    run = _train_from_import(tmp_path, token_cache, converted)
    out, back = tmp_path / "hf", tmp_path / "back"
    assert (
        convert.main(["to-hf", "--ckpt", str(run), "--step", "2", "--out", str(out), "--dtype", "float32"])
        == 0
    )
    assert convert.main(["from-hf", "--hf", str(out), "--out", str(back)]) == 0
    _assert_same_bits(_saved_params(back), _saved_params(run, 2))


# ------------------------------------------------------------------------------------------- training


def _train_from_import(tmp_path, token_cache, imported, **overrides):
    """A 2-step run in tmp_path/run started from `imported` (the module's import, which it only reads)."""
    config = tiny_config(
        token_cache, init_params=str(imported), steps=2, checkpoint_every_steps=2, **overrides
    )
    trainer.train(config, str(tmp_path / "run"))
    return tmp_path / "run"


def test_a_run_starts_from_the_import_with_a_fresh_optimizer_at_step_0(tmp_path, converted, token_cache):
    config = tiny_config(token_cache, recipe="bf16", init_params="unused")
    ckpt = converted
    run = _train_from_import(tmp_path, token_cache, ckpt, recipe="bf16")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["init_params"] == {"path": str(ckpt), "step": 0} and summary["resumed_from_step"] is None
    saved = weights.find_step_dir(str(run), 2, "test")
    restored = ocp.StandardCheckpointer().restore(os.path.join(saved, "state"))
    assert int(restored["step"]) == 2
    assert [int(c) for c in _counts(restored["opt_state"])] == [2, 2]  # Adam's and the schedule's: fresh

    # Update 1's loss is the imported params' loss on the run's first batch.
    config = setup.resolve_config(config)
    mesh = setup.make_run_mesh(config)
    with sharding_context(mesh):
        train_iter, _, _ = trainer.load_data(config, bytes_tokenizer(), mesh)
        batch = setup.device_batch(next(train_iter), mesh)
        model, _ = setup.build_model(config, bytes_tokenizer())
        params = traverse_util.unflatten_dict(_saved_params(ckpt))
        loss = float(jax.jit(lambda p, b: state.token_losses(model, p, {}, b, None).mean())(params, batch))
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(loss, rel=1e-5)


def _counts(opt_state) -> list:
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return [v for p, v in leaves if "count" in jax.tree_util.keystr(p)]


@pytest.mark.parametrize(
    "layout", [{"model.scan_layers": False}, {"model.bf16_first_blocks": 1}], ids=["unrolled", "two_segments"]
)
def test_a_run_of_another_layer_layout_gets_the_same_params(converted, token_cache, layout):
    config = setup.resolve_config(tiny_config(token_cache, init_params=str(converted), **layout))
    tensor = 2 if jax.device_count() % 2 == 0 else 1  # fsdp 4 x tensor 2 on the CPU lane's 8 devices
    mesh = make_mesh(data=1, fsdp=-1, tensor=tensor)
    with sharding_context(mesh):
        model, model_cfg = setup.build_model(config, bytes_tokenizer())
        tx, _ = make_optimizer(config.optimizer)
        fresh, shardings = setup.init_train_state(model, tx, mesh, config.seed, config.seq_len)
        started, meta = weights.start_from_params(config, fresh, shardings, model_cfg)
    assert meta["init_params"]["step"] == 0
    got = unstack_layer_params(started.params, model_cfg) if model_cfg.scan_layers else started.params
    saved_cfg = weights.saved_model_config(weights.find_step_dir(str(converted), None, "test"))
    want = unstack_layer_params(traverse_util.unflatten_dict(_saved_params(converted)), saved_cfg)
    flat = lambda tree: {k: np.asarray(v) for k, v in weights.flat_tree(tree).items()}  # noqa: E731
    _assert_same_bits(flat(got), flat(want))
    for leaf, sharding in zip(
        jax.tree.leaves(started.params), jax.tree.leaves(shardings.params), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.norm_eps": 1e-6},
            r"holds a model with norm_eps=1e-05, this run's has 1e-06: set --config.model",
        ),
        ({"init_from": "x", "init_from_step": 1}, "init_params and init_from are both set"),
        ({"init_params": "/no/such/ckpt"}, "init_params /no/such/ckpt does not exist"),
    ],
)
def test_bad_init_params_is_one_line(converted, token_cache, tmp_path, overrides, message):
    config = tiny_config(token_cache, **{"init_params": str(converted), **overrides})
    with pytest.raises(ConfigError, match=message) as caught:
        trainer.train(config, str(tmp_path / "run"))
    assert "\n" not in str(caught.value)
    assert not list((tmp_path / "run").glob("checkpoints/[0-9]*"))


# ------------------------------------------------------------------------------------------- bad input


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_from_index(path, name):
    index = json.loads((path / hf_llama.INDEX_FILE).read_text())
    del index["weight_map"][name]
    (path / hf_llama.INDEX_FILE).write_text(json.dumps(index))


BAD_HF = {
    "missing_tensor": (
        lambda p: _drop_from_index(p, "model.layers.1.mlp.up_proj.weight"),
        "tensor model.layers.1.mlp.up_proj.weight is missing from the safetensors files",
    ),
    "wrong_shape": (
        lambda p: _edit_config(p, intermediate_size=96),
        r"tensor model.layers.0.mlp.down_proj.weight has shape \(64, 192\), config.json implies \(64, 96\)",
    ),
    "not_llama": (
        lambda p: _edit_config(p, model_type="mistral", architectures=["MistralForCausalLM"]),
        r"describes model_type 'mistral', architectures \['MistralForCausalLM'\]: only Llama",
    ),
    "gqa_heads_do_not_divide": (
        lambda p: _edit_config(p, num_key_value_heads=3),
        "num_key_value_heads 3 does not divide num_attention_heads 4",
    ),
    "gqa_weights_of_other_kv_heads": (
        lambda p: _edit_config(p, num_key_value_heads=4),
        r"tensor model.layers.0.self_attn.k_proj.weight has shape \(32, 64\), config.json implies \(64, 64\)",
    ),
    "missing_index": (
        lambda p: (p / hf_llama.INDEX_FILE).unlink(),
        "safetensors files but no model.safetensors.index.json",
    ),
    "llama32_rope": (
        lambda p: _edit_config(p, rope_scaling={**LLAMA31_SCALING, "factor": 32.0}, rope_parameters=None),
        r"rope_scaling.factor is 32.0; fp4jax implements Llama 3.1's scaling",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HF))
def test_bad_hugging_face_input_is_one_line_and_writes_nothing(hf_dir, tmp_path, capsys, case):
    spoil, message = BAD_HF[case]
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    spoil(bad)
    _assert_refused(["from-hf", "--hf", str(bad), "--out", str(tmp_path / "out")], message, tmp_path, capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["from-hf", "--hf", "{hf}", "--out", "{out}", "--model", "125m"],
            "hidden_size is 64, model 125m's d_model is 768",
        ),
        (["from-hf", "--hf", "{tmp}", "--out", "{out}"], "config.json does not exist"),
        (
            ["to-hf", "--ckpt", "{ckpt}", "--step", "3", "--out", "{out}"],
            r"has no checkpoint at step 3 \(it has: 0\)",
        ),
        (["to-hf", "--ckpt", "{tmp}/none", "--out", "{out}"], "does not exist"),
    ],
    ids=["model_mismatch", "no_config", "no_such_step", "no_checkpoint"],
)
def test_bad_arguments_are_one_line_and_write_nothing(hf_dir, converted, tmp_path, capsys, args, message):
    values = {"hf": hf_dir, "out": tmp_path / "out", "tmp": tmp_path, "ckpt": converted}
    _assert_refused([a.format(**values) for a in args], message, tmp_path, capsys)


def test_an_existing_output_is_never_replaced(hf_dir, converted, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine").write_text("kept")
    for args in (["from-hf", "--hf", str(hf_dir)], ["to-hf", "--ckpt", str(converted)]):
        assert convert.main([*args, "--out", str(out)]) == 2
        assert (
            capsys.readouterr().err == f"error: {out} exists; choose a new --out (nothing is overwritten)\n"
        )
    assert os.listdir(out) == ["mine"]


def test_a_conversion_that_fails_midway_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("stopped midway")

    monkeypatch.setattr(hf_llama, "load_params", fail)
    with pytest.raises(RuntimeError, match="stopped midway"):
        convert.from_hf(str(hf_dir), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def _assert_refused(argv, message, tmp_path, capsys):
    before = sorted(os.listdir(tmp_path))
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == before  # no output, no .partial directory


def test_bf16_export_rounds_to_nearest_even_as_torch_does(tmp_path):
    """Float32 masters between bf16 values (ties included) are written as torch's .to(bfloat16) rounds."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((64, 48), dtype=np.float32)
    ties = (values.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # halfway between two
    values[:8] = ties[:8].view(np.float32)
    index = hf_llama.write_safetensors(str(tmp_path), iter([("w", values.T)]), "bfloat16", 1 << 30)
    with hf_llama.safe_open(str(tmp_path / index["weight_map"]["w"]), framework="numpy") as f:
        written = f.get_tensor("w")
    want = torch.from_numpy(np.ascontiguousarray(values.T)).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(written.view(np.int16), want)
