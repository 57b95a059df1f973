"""Shared fixtures.  The root conftest.py has already set up 8 simulated CPU devices."""

import os

import jax
import pytest
from hypothesis import settings

# Bounded examples keep the suite inside CI's budget on 2 cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def devices():
    """All simulated devices (8 unless a subprocess asked for another count)."""
    return jax.devices()
