"""Simulated devices for every test and doctest: set before JAX is first imported.

A subprocess (or a developer) may ask for another device count by setting
XLA_FLAGS itself; only a missing count defaults to 8.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
