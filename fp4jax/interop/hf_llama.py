"""Hugging Face `LlamaForCausalLM` directories <-> fp4jax Llama params, one tensor at a time.

A Hugging Face directory holds config.json and the weights: model.safetensors, or several
model-XXXXX-of-YYYYY.safetensors listed by model.safetensors.index.json. Only safetensors' numpy API is
used (no torch, no transformers).

Layout (fp4jax param <- Hugging Face tensor; block i's params are `block_{i}/...`, or layer i - start of
the stacked `blocks_{start}_{stop}/...` when the layers are scanned):

    embed/embedding   (V, D)     <- model.embed_tokens.weight                      (V, D)   as is
    attn_norm/scale   (D,)       <- model.layers.{i}.input_layernorm.weight         (D,)     as is
    attn/q/kernel     (D, N, H)  <- model.layers.{i}.self_attn.q_proj.weight        (N H, D) transposed
    attn/k/kernel     (D, K, H)  <- model.layers.{i}.self_attn.k_proj.weight        (K H, D) transposed
    attn/v/kernel     (D, K, H)  <- model.layers.{i}.self_attn.v_proj.weight        (K H, D) transposed
    attn/o/kernel     (N, H, D)  <- model.layers.{i}.self_attn.o_proj.weight        (D, N H) transposed
    mlp_norm/scale    (D,)       <- model.layers.{i}.post_attention_layernorm.weight (D,)    as is
    mlp/gate/kernel   (D, F)     <- model.layers.{i}.mlp.gate_proj.weight           (F, D)   transposed
    mlp/up/kernel     (D, F)     <- model.layers.{i}.mlp.up_proj.weight             (F, D)   transposed
    mlp/down/kernel   (F, D)     <- model.layers.{i}.mlp.down_proj.weight           (D, F)   transposed
    final_norm/scale  (D,)       <- model.norm.weight                               (D,)     as is
    lm_head           (D, V)     <- lm_head.weight (model.embed_tokens.weight if tied) (V, D) transposed

"Transposed" is W.T reshaped: a torch Linear's weight is (out features, in features) with the heads
outer and head_dim inner (feature n H + h), fp4jax's kernel is (in..., out...). RoPE needs no permutation:
transformers' `rotate_half` and fp4jax's `apply_rope` both rotate the pairs (x[r], x[r + H/2]); the
permutation of q/k rows that Meta's original `consolidated.*.pth` checkpoints need (interleaved pairs) is
already applied in every Hugging Face Llama directory.

Invariants: one Hugging Face tensor at a time is read (the rows this process's devices need: whole rows,
as safetensors reads them), each device's slice converted to float32 and placed on the mesh before the
next tensor is read, so a process converts and places only its devices' slices; export writes the
float32 master params rounded to the requested dtype (round to nearest even). Every check of the input
runs on config.json and the safetensors headers before any tensor is read.
"""

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from fp4jax.models.llama import SIZES, Llama, LlamaConfig, init_variables, llama_config
from fp4jax.models.sharding import logical_shardings
from fp4jax.training.errors import UserError
from fp4jax.training.weights import ARCH_FIELDS

__all__ = [
    "ARCH_FIELDS",
    "EXPORT_DTYPES",
    "INDEX_FILE",
    "ConversionError",
    "Leaf",
    "ShardReader",
    "abstract_params",
    "check_tensors",
    "hf_config",
    "hf_shape",
    "hf_tensors",
    "llama_config_from_hf",
    "leaves",
    "load_params",
    "read_hf_config",
    "tensor_files",
    "tensor_specs",
    "trainer_model",
    "write_safetensors",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
READABLE_DTYPES = ("BF16", "F16", "F32")

# The LlamaConfig fields that make the architecture, and config.json's name of each.
HF_FIELD = dict(
    zip(
        ARCH_FIELDS,
        (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "rope_theta",
            "rope_scaling",
            "rms_norm_eps",
        ),
        strict=True,
    )
)
# The Llama 3.1 frequency scaling, the one fp4jax implements (llama.llama31_scale_frequencies' defaults),
# and the context length Meta's Llama 3.1 configs declare with it.
LLAMA31_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31_CONTEXT = 131072
# Buffers some older exports carry next to the weights; recomputed from the config, never read.
IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class ConversionError(UserError):
    """A Hugging Face directory or fp4jax checkpoint that cannot be converted; one line naming why."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One fp4jax param and its Hugging Face tensor. `n_in` None: the same layout; else the param is the
    tensor transposed and reshaped, its first `n_in` dimensions being the tensor's columns (inputs)."""

    hf_name: str  # "{i}": the block's index
    n_in: int | None


BLOCK_TENSORS = {
    ("attn_norm", "scale"): TensorMap("model.layers.{i}.input_layernorm.weight", None),
    ("attn", "q", "kernel"): TensorMap("model.layers.{i}.self_attn.q_proj.weight", 1),
    ("attn", "k", "kernel"): TensorMap("model.layers.{i}.self_attn.k_proj.weight", 1),
    ("attn", "v", "kernel"): TensorMap("model.layers.{i}.self_attn.v_proj.weight", 1),
    ("attn", "o", "kernel"): TensorMap("model.layers.{i}.self_attn.o_proj.weight", 2),
    ("mlp_norm", "scale"): TensorMap("model.layers.{i}.post_attention_layernorm.weight", None),
    ("mlp", "gate", "kernel"): TensorMap("model.layers.{i}.mlp.gate_proj.weight", 1),
    ("mlp", "up", "kernel"): TensorMap("model.layers.{i}.mlp.up_proj.weight", 1),
    ("mlp", "down", "kernel"): TensorMap("model.layers.{i}.mlp.down_proj.weight", 1),
}
EMBEDDING = "model.embed_tokens.weight"
TOP_TENSORS = {
    ("embed", "embedding"): TensorMap(EMBEDDING, None),
    ("final_norm", "scale"): TensorMap("model.norm.weight", None),
    ("lm_head",): TensorMap("lm_head.weight", 1),
}


# ------------------------------------------------------------------------------------------- config


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Hugging Face directory, as a dict."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} does not exist; --hf must be a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConversionError(
            f"{path} is not readable JSON ({type(exc).__name__}): fix or replace it"
        ) from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds no JSON object: fix or replace it")
    return config


def _require(hf: dict, key: str):
    if key not in hf:
        raise ConversionError(
            f"config.json has no {key}: not a Llama config; add it or use another directory"
        )
    return hf[key]


def _check_is_llama(hf: dict) -> None:
    """ConversionError naming the field unless config.json describes a plain LlamaForCausalLM."""
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type") != "llama" or architectures != ["LlamaForCausalLM"]:
        raise ConversionError(
            f"config.json describes model_type {hf.get('model_type')!r}, architectures {architectures}: only "
            "Llama (LlamaForCausalLM) converts"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise ConversionError(
                f"config.json's {key} is {hf[key]!r}; fp4jax's Llama has {key}={want!r}, so it cannot hold "
                "this model"
            )


def _rope(hf: dict) -> tuple[float, bool]:
    """(rope_theta, whether the Llama 3.1 scaling applies), from config.json as transformers 4 writes it
    (rope_theta, rope_scaling) or 5 (rope_parameters); ConversionError for any other scaling."""
    parameters = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", parameters.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or parameters
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, False
    if kind != "llama3":
        raise ConversionError(
            f"config.json's rope_scaling.rope_type is {kind!r}; fp4jax implements 'llama3' (Llama 3.1) only"
        )
    for key, want in LLAMA31_ROPE_SCALING.items():
        if float(scaling.get(key, math.nan)) != want:
            raise ConversionError(
                f"config.json's rope_scaling.{key} is {scaling.get(key)}; fp4jax implements Llama 3.1's "
                f"scaling ({', '.join(f'{k}={v}' for k, v in LLAMA31_ROPE_SCALING.items())})"
            )
    return theta, True


def llama_config_from_hf(hf: dict, model: str | None = None) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json: its architecture (ARCH_FIELDS), checked to be one
    fp4jax's Llama can hold and, with `model` (a size name), to equal that model's but for the vocabulary
    (a run takes its tokenizer's); ConversionError naming the first field that differs otherwise."""
    _check_is_llama(hf)
    n_heads = int(_require(hf, "num_attention_heads"))
    d_model = int(_require(hf, "hidden_size"))
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ConversionError(
            f"config.json's num_key_value_heads {n_kv_heads} does not divide num_attention_heads {n_heads} "
            "(grouped-query attention needs it to)"
        )
    theta, scaling = _rope(hf)
    fields = {
        "vocab_size": int(_require(hf, "vocab_size")),
        "d_model": d_model,
        "n_layers": int(_require(hf, "num_hidden_layers")),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": int(hf.get("head_dim") or d_model // n_heads),
        "d_ff": int(_require(hf, "intermediate_size")),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
    }
    if model is not None:
        if model not in SIZES:
            raise ConversionError(f"unknown --model {model!r}; the fp4jax models are {', '.join(SIZES)}")
        named = llama_config(model)
        for field, value in fields.items():  # the vocabulary is the tokenizer's (model.vocab_size)
            if field != "vocab_size" and getattr(named, field) != value:
                raise ConversionError(
                    f"config.json's {HF_FIELD[field]} is {value}, model {model}'s {field} is "
                    f"{getattr(named, field)}: name the matching model, or leave out --model to take the "
                    "architecture from config.json"
                )
    try:
        return LlamaConfig(**fields)
    except ValueError as exc:
        raise ConversionError(f"config.json: {exc}") from exc


def trainer_model(cfg: LlamaConfig, model: str | None = None) -> dict:
    """{"size": name, field: value, ...}: the trainer's `model` config keys that give `cfg`'s
    architecture: `model` (else the size that differs from cfg in the fewest fields) and the fields where
    cfg differs from it."""

    def changed(size: str) -> dict:
        base = llama_config(size)
        return {f: getattr(cfg, f) for f in ARCH_FIELDS if getattr(base, f) != getattr(cfg, f)}

    model = model or min(SIZES, key=lambda size: len(changed(size)))
    return {"size": model, **changed(model)}


def hf_config(cfg: LlamaConfig, dtype: str, token_ids: dict | None = None) -> dict:
    """config.json for `cfg`, in the form transformers 4 writes (rope_theta, rope_scaling at the top),
    which transformers 4 and 5 read; embeddings untied (fp4jax trains the LM head apart)."""
    scaling = {"rope_type": "llama3", **LLAMA31_ROPE_SCALING} if cfg.rope_scaling else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": LLAMA31_CONTEXT if cfg.rope_scaling else cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "torch_dtype": dtype,
        **(token_ids or {}),
    }


# ------------------------------------------------------------------------------------ tensors, files


def tensor_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: safetensors file} of a directory: from model.safetensors.index.json, or the names in
    model.safetensors when the directory has only that file."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConversionError(f"{index_path} has no readable weight_map ({type(exc).__name__})") from exc
        files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise ConversionError(
                    f"{INDEX_FILE} lists {os.path.basename(file)}, which is not in {hf_dir}"
                )
        return files
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    shards = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if shards:
        raise ConversionError(
            f"{hf_dir} holds {len(shards)} safetensors files but no {INDEX_FILE}: restore the index that "
            "came with them"
        )
    raise ConversionError(
        f"{hf_dir} holds no {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors model directory"
    )


def tensor_specs(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} read from the files' headers (no tensor data)."""
    specs = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, framework="numpy") as f:
                present = set(f.keys())
                for name in (n for n, path in files.items() if path == file):
                    if name not in present:
                        raise ConversionError(
                            f"{INDEX_FILE} puts {name} in {os.path.basename(file)}, which lacks it"
                        )
                    piece = f.get_slice(name)
                    specs[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except ConversionError:
            raise
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise ConversionError(f"{file} is not a readable safetensors file ({exc})") from exc
    return specs


def abstract_params(cfg: LlamaConfig):
    """The params of Llama(cfg) as ShapeDtypeStructs in nn.LogicallyPartitioned boxes (nothing allocated),
    laid out as cfg.scan_layers says (training.setup's init, without its optimizer)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    init = functools.partial(init_variables, Llama(cfg))
    return jax.eval_shape(init, {"params": jax.random.key(0)}, tokens)["params"]


def _unboxed(tree):
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def _layers_of(top: str) -> range | None:
    """The blocks a top-level param name holds: blocks_{a}_{b} -> a..b-1, block_{i} -> i, else None."""
    stacked = re.fullmatch(r"blocks_(\d+)_(\d+)", top)
    if stacked:
        return range(int(stacked[1]), int(stacked[2]))
    single = re.fullmatch(r"block_(\d+)", top)
    return range(int(single[1]), int(single[1]) + 1) if single else None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One fp4jax param and where its values come from: `names[j]` is layer j's tensor (one name when
    the param is not stacked); `layer_shape` is one layer's fp4jax shape."""

    path: tuple[str, ...]
    stacked: bool
    names: tuple[str, ...]
    n_in: int | None
    layer_shape: tuple[int, ...]


def leaves(cfg: LlamaConfig, tied: bool = False) -> list[Leaf]:
    """The params of Llama(cfg), in tree order, each with its Hugging Face tensors (`tied`: the LM head
    is read from the embedding)."""
    out = []
    for path, spec in jax.tree_util.tree_flatten_with_path(_unboxed(abstract_params(cfg)))[0]:
        keys = _keys(path)
        layers = _layers_of(keys[0])
        if layers is None:
            entry = TOP_TENSORS[keys]
            name = EMBEDDING if tied and keys == ("lm_head",) else entry.hf_name
            out.append(Leaf(keys, False, (name,), entry.n_in, tuple(spec.shape)))
            continue
        entry = BLOCK_TENSORS[keys[1:]]
        stacked = keys[0].startswith("blocks_")
        shape = tuple(spec.shape[1:] if stacked else spec.shape)
        names = tuple(entry.hf_name.format(i=i) for i in layers)
        out.append(Leaf(keys, stacked, names, entry.n_in, shape))
    return out


def hf_shape(layer_shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    if n_in is None:
        return layer_shape
    return (math.prod(layer_shape[n_in:]), math.prod(layer_shape[:n_in]))


def check_tensors(specs: dict, cfg: LlamaConfig, tied: bool) -> None:
    """ConversionError naming the first tensor that is missing, has another shape than config.json
    implies, a dtype other than bf16 / f16 / f32, or is not part of a Llama model."""
    wanted = {}
    for leaf in leaves(cfg, tied):
        for name in leaf.names:
            wanted[name] = hf_shape(leaf.layer_shape, leaf.n_in)
    for name, shape in wanted.items():
        if name not in specs:
            raise ConversionError(
                f"tensor {name} is missing from the safetensors files: the directory is incomplete"
            )
        have, dtype = specs[name]
        if have != shape:
            raise ConversionError(
                f"tensor {name} has shape {have}, config.json implies {shape}: the weights and config.json "
                "disagree"
            )
        if dtype not in READABLE_DTYPES:
            raise ConversionError(
                f"tensor {name} is {dtype}; convertible dtypes: {', '.join(READABLE_DTYPES)}"
            )
    extra = sorted(n for n in specs if n not in wanted and not IGNORED_TENSORS.fullmatch(n))
    if extra and not (tied and extra == ["lm_head.weight"]):
        raise ConversionError(
            f"tensor {extra[0]} is not part of a Llama model of this config.json ({len(extra)} such)"
        )


# --------------------------------------------------------------------------------------------- import


def _group(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, tuple[int, ...], tuple]:
    """A group of fp4jax dimensions flattened into one Hugging Face dimension: (the flat slice that
    covers `index`, the shape to unflatten what it reads into, the index that then trims it)."""
    bounds = [s.indices(n) for s, n in zip(index, shape, strict=True)]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"strided shard index {index}")
    (start, stop, _), inner = bounds[0], math.prod(shape[1:])
    local = (stop - start, *shape[1:])
    trim = (slice(None), *(slice(a, b) for a, b, _ in bounds[1:]))
    return slice(start * inner, stop * inner), local, trim


class ShardReader:
    """Reads the float32 values of fp4jax param slices (of one layer, shape `layer_shape`) from the
    Hugging Face tensor `name`, one slice per call.

    safetensors' numpy slicing reads only the rows asked for but the whole of each row (a column slice of
    a (V, D) tensor reads all of it: measured with safetensors 0.8), so the rows a slice needs are read
    as a block and kept while the next slices need the same rows (FSDP cuts the columns: one read per
    tensor); the slice is converted to float32 in the same copy that transposes it. Host memory: that
    block in the file's dtype and one slice in float32.
    """

    def __init__(self, file: str, name: str, n_in: int | None, layer_shape: tuple[int, ...]):
        self.file, self.name, self.n_in, self.shape = file, name, n_in, tuple(layer_shape)
        self.rows, self.block = None, None

    def _rows(self, rows: slice) -> np.ndarray:
        key = rows.indices(10**18)
        if key != self.rows:
            self.block = None  # the previous block is freed before the next one is read
            with safe_open(self.file, framework="numpy") as f:
                self.block = f.get_slice(self.name)[rows]
            self.rows = key
        return self.block

    def __call__(self, index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        if self.n_in is None:
            return np.asarray(self._rows(index[0])[(slice(None), *index[1:])], dtype=np.float32)
        cols, in_shape, in_trim = _group(self.shape[: self.n_in], index[: self.n_in])
        rows, out_shape, out_trim = _group(self.shape[self.n_in :], index[self.n_in :])
        block = self._rows(rows)[:, cols]
        flat = np.empty(block.shape[::-1], np.float32)
        np.copyto(flat, block.T)
        values = flat.reshape(in_shape + out_shape)  # a view: flat is contiguous
        return np.ascontiguousarray(values[in_trim + out_trim])  # a copy only where head_dim is cut

    def close(self):
        self.rows, self.block = None, None


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(stacked, layer, j, sharding):
    return jax.lax.with_sharding_constraint(
        jax.lax.dynamic_update_index_in_dim(stacked, layer, j, 0), sharding
    )


def _place_layer(files, leaf: Leaf, j: int, sharding) -> jax.Array:
    """Layer j's tensor on the mesh, one device's slice at a time (ShardReader): a device holding the
    same slice as the one before it reuses it."""
    name = leaf.names[j]
    reader = ShardReader(files[name], name, leaf.n_in, leaf.layer_shape)
    pieces, last_index, last = [], None, None
    for device, index in sharding.addressable_devices_indices_map(leaf.layer_shape).items():
        bounds = tuple(s.indices(n) for s, n in zip(index, leaf.layer_shape, strict=False))
        if bounds != last_index:
            last_index, last = bounds, None
            last = reader(index)
        pieces.append(jax.device_put(last, device))
    reader.close()
    return jax.make_array_from_single_device_arrays(leaf.layer_shape, sharding, pieces)


def _place_leaf(files, leaf: Leaf, sharding: NamedSharding) -> jax.Array:
    """One param on the mesh. A stacked param starts as zeros in its sharding and takes its layers one at
    a time (the stack is donated: updated in place), so the host holds one layer's tensor at most."""
    if not leaf.stacked:
        return _place_layer(files, leaf, 0, sharding)
    spec = tuple(sharding.spec) + (None,) * (1 + len(leaf.layer_shape) - len(sharding.spec))
    layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))
    shape = (len(leaf.names), *leaf.layer_shape)
    stacked = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
    for j in range(len(leaf.names)):
        stacked = _set_layer(stacked, _place_layer(files, leaf, j, layer_sharding), j, sharding)
    return stacked


def load_params(hf_dir: str, cfg: LlamaConfig, mesh, tied: bool = False, on_tensor: Callable = None):
    """The params of Llama(cfg) from a checked Hugging Face directory (`check_tensors`), float32, placed
    on `mesh` as the trainer shards them (fp4jax.models.sharding), tensor by tensor. `on_tensor(path)` is
    called after each param is placed (progress)."""
    files = tensor_files(hf_dir)
    boxed = abstract_params(cfg)
    shardings = logical_shardings(boxed, mesh)
    flat_shardings = jax.tree.leaves(shardings)
    placed = []
    for leaf, sharding in zip(leaves(cfg, tied), flat_shardings, strict=True):
        placed.append(_place_leaf(files, leaf, sharding))
        if on_tensor is not None:
            on_tensor(leaf.path)
    return jax.tree.unflatten(jax.tree.structure(shardings), placed)


# --------------------------------------------------------------------------------------------- export


def hf_tensors(cfg: LlamaConfig, read_leaf: Callable[[tuple[str, ...]], np.ndarray]) -> Iterator[tuple]:
    """(Hugging Face name, float32 tensor in its layout, possibly a strided view) for every tensor of
    Llama(cfg), reading one param at a time with `read_leaf(path)` (a stacked param whole, then its
    layers one after the other)."""
    for leaf in leaves(cfg):
        values = read_leaf(leaf.path)
        layers = values if leaf.stacked else [values]
        for name, layer in zip(leaf.names, layers, strict=True):
            layer = np.asarray(layer)
            if leaf.n_in is not None:  # a transposed view: write_safetensors copies it once, rounded
                layer = layer.reshape(hf_shape(layer.shape, leaf.n_in)[::-1]).T
            yield name, layer
        del values, layers


def write_safetensors(out_dir: str, tensors: Iterator[tuple], dtype: str, max_shard_bytes: int) -> dict:
    """Writes `tensors` (name, float32 array) rounded to `dtype` into model-XXXXX-of-YYYYY.safetensors
    files of at most `max_shard_bytes` each (a larger tensor alone in its file) and
    model.safetensors.index.json; returns the index. One file's tensors are in memory at a time."""
    np_dtype = EXPORT_DTYPES[dtype]
    shard, shard_bytes, written, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            path = os.path.join(out_dir, f"part-{len(written):05d}.safetensors")
            save_file(shard, path, metadata={"format": "pt"})
            written.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, values in tensors:
        array = np.ascontiguousarray(values, dtype=np_dtype)
        if shard and shard_bytes + array.nbytes > max_shard_bytes:
            flush()
        shard[name], shard_bytes, total = array, shard_bytes + array.nbytes, total + array.nbytes
    flush()
    for k, (path, names) in enumerate(written):
        final = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, os.path.join(out_dir, final))
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return index
