"""Shared fixtures. Tests import the plain implementations from tests/reference.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Keep the two cores of a CI machine for the test that is running, not for oversubscribed threads.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: tests compare distributions, not samples, and never depend on global RNG."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def one_thread():
    """For tests of many small tensor ops: on a shared, oversubscribed machine each op's thread-pool handshake
    costs more than the op itself. One thread for the test, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    """tests/server_harness.py's tiny served Model (2-layer random Llama, vocab ~300), one per test module: the
    modules that take it change its state (caches, heads, runners), so none sees another's. A module that needs
    another model defines its own `model`, which overrides this one."""
    from server_harness import tiny_served_model

    return tiny_served_model()


@pytest.fixture(scope="module")
def client(model):
    """A FastAPI TestClient over `create_app(model)` (the module's `model`), open for the module's tests."""
    from fastapi.testclient import TestClient

    from lmhead.server import create_app

    with TestClient(create_app(model)) as c:
        yield c
