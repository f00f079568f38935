"""Private to fp4jax.ops: the fused quantizer, its tile math, the GEMM back ends and the device probes.

Nothing outside fp4jax/ops imports these modules (tests/test_ops_face.py checks it); their supported
names are re-exported by fp4jax.ops.
"""

__all__: list[str] = []
