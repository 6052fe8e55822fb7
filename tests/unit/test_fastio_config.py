"""FastioConfig validation, the environment as the one source of defaults, and backend choice."""
import dataclasses

import pytest

import fastio
from fastio._config import BACKEND_CHOICES


def test_public_names_are_pinned():
    assert sorted(fastio.__all__) == sorted([
        "ALIGN_BYTES", "AlignedBuffer", "BULK", "FastioConfig", "Reader", "URGENT", "Writer",
        "aligned_buffer", "backend", "buffer_address", "copy_regions", "crc32", "crc32_shift", "crc32c",
        "crc32c_regions", "engine", "make_engine"])


def test_unknown_backend_in_environment_lists_the_choices(monkeypatch):
    monkeypatch.setenv("FASTIO_BACKEND", "spdk")
    with pytest.raises(ValueError) as info:
        fastio.FastioConfig.from_env()
    message = str(info.value)
    assert "FASTIO_BACKEND" in message and "'spdk'" in message
    for choice in BACKEND_CHOICES:
        assert choice in message


@pytest.mark.parametrize("name", BACKEND_CHOICES)
def test_known_backend_in_environment_is_used(monkeypatch, name):
    monkeypatch.setenv("FASTIO_BACKEND", name)
    assert fastio.FastioConfig.from_env().backend == name


def test_explicit_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("FASTIO_BACKEND", "uring")
    monkeypatch.setenv("FASTIO_DIRECT", "0")
    config = fastio.FastioConfig.from_env(backend="pwrite")
    assert config.backend == "pwrite"
    assert config.direct is False
    assert fastio.FastioConfig.from_env(direct=True).direct is True


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("false", False), ("no", False)])
def test_direct_from_environment(monkeypatch, value, expected):
    monkeypatch.delenv("FASTIO_BACKEND", raising=False)
    monkeypatch.setenv("FASTIO_DIRECT", value)
    assert fastio.FastioConfig.from_env().direct is expected


def test_empty_environment_gives_defaults(monkeypatch):
    monkeypatch.delenv("FASTIO_BACKEND", raising=False)
    monkeypatch.delenv("FASTIO_DIRECT", raising=False)
    assert fastio.FastioConfig.from_env() == fastio.FastioConfig()


def test_unknown_backend_argument_lists_the_choices():
    with pytest.raises(ValueError, match="auto, uring, pwrite"):
        fastio.FastioConfig(backend="posix")


@pytest.mark.parametrize("field, value", [
    ("chunk_bytes", 0), ("chunk_bytes", 4095), ("chunk_bytes", -4096),
    ("staging_slot_bytes", 1000), ("staging_slot_bytes", 0),
    ("queue_depth", 0), ("threads", 0), ("staging_slots", 0),
])
def test_invalid_numbers_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        fastio.FastioConfig(**{field: value})
    assert f"FastioConfig.{field}={value}" in str(info.value)


def test_config_is_frozen():
    config = fastio.FastioConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "pwrite"


def test_make_engine_obeys_explicit_backend(backend_name, backend):
    assert backend.name == backend_name


def test_explicit_uring_without_io_uring_raises(monkeypatch):
    from fastio import _select

    monkeypatch.setattr(_select, "_probe_result", (False, "pretend: io_uring_setup refused"))
    with pytest.raises(OSError, match="pretend: io_uring_setup refused"):
        fastio.make_engine(fastio.FastioConfig(backend="uring"))
    engine = fastio.make_engine(fastio.FastioConfig(backend="auto"))  # falls back, with a warning
    try:
        assert engine.name == "pwrite"
    finally:
        engine.close()


def test_aligned_buffer_is_page_aligned_and_sized():
    for nbytes in (0, 1, 4095, 4096, 4097, (1 << 20) + 1):
        buffer = fastio.aligned_buffer(nbytes)
        assert buffer.address % fastio.ALIGN_BYTES == 0
        assert buffer.nbytes == nbytes
        assert buffer.capacity_bytes % fastio.ALIGN_BYTES == 0 and buffer.capacity_bytes >= nbytes
        assert len(buffer.view()) == nbytes
        assert buffer.numpy().size == nbytes
        assert buffer.tensor().numel() == nbytes
    with pytest.raises(ValueError):
        fastio.aligned_buffer(-1)


def test_engine_rejects_submissions_after_close(backend_name):
    engine = fastio.make_engine(fastio.FastioConfig(backend=backend_name))
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        engine.submit_write(0, memoryview(b"x"), 0, "nowhere")
