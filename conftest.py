"""Simulated devices for every test and doctest: set before JAX is first imported.

A subprocess (or a developer) may ask for another device count by setting
XLA_FLAGS itself; only a missing count defaults to 8.

The tests also compile with LLVM's optimisations off (``--xla_backend_optimization_level=0``),
unless XLA_FLAGS sets a level: it cuts the suite's compile time by about a quarter, and
changes nothing the tests compare -- XLA's HLO passes, the compiled HLO text (collectives)
and ``memory_analysis()`` are the same at every level; only the machine code is slower,
and no test times it (benchmarks/ runs at XLA's default level).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
