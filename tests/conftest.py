"""Fixtures shared by every test package: a seeded RNG and one fresh fastio engine per backend."""
from __future__ import annotations

import importlib.util
import os
import zlib

import numpy as np
import pytest

BACKENDS = ("uring", "pwrite")


def _uring_unusable(why: str) -> None:
    """Skip a test of the io_uring backend where it cannot run; on CI (``CI`` set, as .ci/run runs)
    fail instead, so that a broken ``fastio._uring`` build cannot pass on the fallback backend
    alone. ``LOWDIFF_ALLOW_NO_URING=1`` allows the skip on a CI machine where io_uring is truly
    unavailable (a container that blocks it)."""
    if os.environ.get("CI") and os.environ.get("LOWDIFF_ALLOW_NO_URING") != "1":
        pytest.fail(f"io_uring backend unusable on CI: {why} (set LOWDIFF_ALLOW_NO_URING=1 where io_uring "
                    f"is truly unavailable)", pytrace=False)
    pytest.skip(f"io_uring backend unusable here: {why}")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id: reproducible per test, distinct across tests."""
    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture
def uring_unusable():
    """The function that skips (on CI: fails) a test of io_uring that cannot run here."""
    return _uring_unusable


@pytest.fixture(params=BACKENDS)
def backend_name(request) -> str:
    """"uring" or "pwrite"; skips "uring" where io_uring or its extension is unusable."""
    name = request.param
    if name == "uring":
        from fastio._select import uring_available

        usable, why = uring_available()
        if not usable:
            _uring_unusable(why)
        if importlib.util.find_spec("fastio._uring_engine") is None:
            _uring_unusable("fastio/_uring_engine.py is missing")
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
