"""Mesh, logical-axis rules and sharded initialisation.

Mesh axes (data, fsdp, tensor): `data` replicates params and splits the batch; `fsdp` splits the batch
and shards params / optimizer state along their "embed" dimension (ZeRO-3 style, gathered per layer by
XLA); `tensor` shards heads, kv heads, the MLP hidden dimension and the vocabulary (Megatron style).

Models name array dimensions logically ("embed", "heads", ...); LOGICAL_RULES, the one table, maps those
names to mesh axes. A name absent from the table, or whose mesh axis another dimension of the same array
already uses, is replicated.

Usage (the trainer):

    mesh = make_mesh(data=-1, fsdp=8)
    state, state_shardings = init_sharded(init_fn, mesh, rng)   # never materialised on one device
    with sharding_context(mesh):                                # activation constraints take effect
        step = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding(mesh)), ...)

Invariants: init_sharded's state is unboxed (plain arrays) and `shardings` has exactly its tree structure;
every sharded dimension is divisible by its mesh axes' size (checked, one-line ValueError otherwise).
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "LOGICAL_RULES",
    "MESH_AXES",
    "batch_sharding",
    "check_global_batch",
    "data_parallel_size",
    "init_sharded",
    "lazy_init_sharded",
    "logical_shardings",
    "make_mesh",
    "sharding_context",
]

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    # params; heads / kv_heads / mlp / vocab also name activation dimensions (same sharding)
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); one size may be -1 (fill the rest).

    Axis types are Auto, so sharding is propagated by XLA from the constraints (no sharding-in-types).
    """
    devices = list(jax.devices() if devices is None else devices)
    n, sizes = len(devices), [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(
            f"mesh sizes data={data} fsdp={fsdp} tensor={tensor}: use positive sizes and at most one -1"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes and n % known == 0:
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} does not fit {n} devices: "
            f"choose sizes whose product is {n}, or set one of them to -1 to fill"
        )
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=axis_types, devices=devices)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules=LOGICAL_RULES):
    """Makes `mesh` and `rules` current, so nn.with_logical_constraint and boxed params take effect.

    Trace (jit / eval_shape / first call) the model inside it; outside it the constraints are no-ops.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def _check_divisible(path, shape, spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, axes in zip(shape, spec, strict=False):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        size = math.prod(mesh.shape[a] for a in axes)
        if dim % size:
            raise ValueError(
                f"{jax.tree_util.keystr(path)} of shape {tuple(shape)} cannot be sharded as {spec}: "
                f"dimension {dim} is not divisible by {'*'.join(axes)} = {size}; change the mesh or the model"
            )


def _unbox_no_constraint(tree: Any) -> Any:
    """The values inside metadata boxes, without the sharding constraint `unbox()` applies under a mesh."""

    def value(x):
        if isinstance(x, nn.Partitioned):
            return x.unbox(apply_constraint=False)
        return x.unbox() if isinstance(x, nn.meta.AxisMetadata) else x  # plain leaves: replicated

    return jax.tree.map(value, tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedShardings for a tree holding nn.LogicallyPartitioned boxes (e.g. from jax.eval_shape(init)).

    The result has the tree's *unboxed* structure; unboxed leaves (step counters, fp8 amax histories) are
    replicated.
    """
    specs = nn.get_partition_spec(abstract_tree)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    leaves = jax.tree_util.tree_leaves_with_path(_unbox_no_constraint(abstract_tree))
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        _check_divisible(path, leaf.shape, sharding.spec, mesh)
    return shardings


def init_sharded(init_fn: Callable[..., Any], mesh: Mesh, *args, rules=LOGICAL_RULES) -> tuple[Any, Any]:
    """Runs `init_fn(*args)` directly into its sharded layout: eval_shape -> logical specs -> mesh
    shardings -> jit(init_fn, out_shardings). No array ever lives whole on one device.

    `init_fn` should return its tree still boxed (e.g. build the optimizer state from the boxed params, so
    Adam's moments inherit the params' logical names); the returned state is unboxed.
    Returns (state, shardings) with identical tree structures.
    """
    _, shardings, init = lazy_init_sharded(init_fn, mesh, *args, rules=rules)
    return init(), shardings


def lazy_init_sharded(init_fn: Callable[..., Any], mesh: Mesh, *args, rules=LOGICAL_RULES):
    """init_sharded's work without running init_fn: (the unboxed abstract state, its shardings, init),
    where init() returns the state init_sharded returns. A run that restores a checkpoint into the abstract
    state never initialises one (on an 8B model, an initialisation and its memory thrown away)."""
    abstract = jax.eval_shape(init_fn, *args)
    shardings = logical_shardings(abstract, mesh, rules)

    def init():
        with sharding_context(mesh, rules):
            return jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), out_shardings=shardings)(*args)

    return _unbox_no_constraint(abstract), shardings, init


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split: data * fsdp."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_global_batch(global_batch: int, mesh: Mesh) -> None:
    """ValueError (one line) unless the global batch splits evenly over data * fsdp."""
    n = data_parallel_size(mesh)
    if global_batch % n:
        raise ValueError(
            f"global batch {global_batch} is not divisible by data*fsdp = "
            f"{mesh.shape['data']}*{mesh.shape['fsdp']} = {n}: use a multiple of {n} or change the mesh"
        )


def batch_sharding(mesh: Mesh, global_batch: int | None = None, rules=LOGICAL_RULES) -> NamedSharding:
    """Sharding of [B, T] token / target arrays: B over (data, fsdp), T replicated.

    With `global_batch`, also checks it is divisible by data * fsdp.
    """
    if global_batch is not None:
        check_global_batch(global_batch, mesh)
    return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "length"), rules))
