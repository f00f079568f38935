"""Test setup: 8 fake CPU devices, so sharding is exercised on every machine.

The flag must be set before jax initialises its backends, hence at import time of conftest.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
