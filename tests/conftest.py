"""Fixtures shared by every test package: a seeded RNG and one fresh fastio engine per backend."""
from __future__ import annotations

import importlib.util
import zlib

import numpy as np
import pytest

BACKENDS = ("uring", "pwrite")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id: reproducible per test, distinct across tests."""
    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture(params=BACKENDS)
def backend_name(request) -> str:
    """"uring" or "pwrite"; skips "uring" where io_uring or its extension is unusable."""
    name = request.param
    if name == "uring":
        from fastio._select import uring_available

        usable, why = uring_available()
        if not usable:
            pytest.skip(f"io_uring backend unusable here: {why}")
        if importlib.util.find_spec("fastio._uring_engine") is None:
            pytest.skip("io_uring backend not in this tree: fastio/_uring_engine.py is missing")
    return name


@pytest.fixture
def backend(backend_name):
    """A fresh engine of ``backend_name`` (pass it as ``engine=`` to Writer/Reader); closed afterwards."""
    import fastio

    engine = fastio.make_engine(fastio.FastioConfig(backend=backend_name))
    try:
        yield engine
    finally:
        engine.close()
