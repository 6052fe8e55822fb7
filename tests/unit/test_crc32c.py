"""fastio.crc32c: CRC-32C (Castagnoli) of buffers, hardware path checked against the table path."""
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastio
from fastio._memops import crc32c_backend, crc32c_software, crc32c_sse42

IMPLEMENTATIONS = [fastio.crc32c, crc32c_sse42, crc32c_software]


def reference_crc32c(data: bytes, value: int = 0) -> int:
    """Bit by bit, reflected polynomial 0x82F63B78, inverted before and after."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_backend_is_known():
    assert crc32c_backend() in ("vpclmulqdq", "sse4.2", "software")


def test_folding_constants_are_the_powers_of_x_they_claim():
    """crc32c_core.c's AVX-512 folds across D bytes multiply each 128-bit lane's low half by
    x^(8D+32) and its high half by x^(8D-32) mod P (reflected, shifted left by one): derived here,
    so a wrong constant fails by name and not only as a wrong checksum on CPUs that run the path."""
    from test_fastio_crc32 import reflected, x_power_mod  # (this directory is on sys.path under pytest)
    poly = 0x11EDC6F41   # Castagnoli, normal form with the x^32 term

    def folded(power: int) -> str:
        return f"0x{reflected(x_power_mod(power, poly), 32) << 1:09x}ull"

    source = (Path(__file__).parents[2] / "fastio" / "crc32c_core.c").read_text()
    for distance in (256, 64, 48, 32, 16):
        line = next(line for line in source.splitlines()
                    if line.startswith(f"static const uint64_t FOLD_{distance}[2]"))
        assert f"{{{folded(8 * distance + 32)}, {folded(8 * distance - 32)}}}" in line, distance


@pytest.mark.parametrize("crc", IMPLEMENTATIONS)
@pytest.mark.parametrize("data, expected", [
    (b"", 0),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
])
def test_known_vectors(crc, data, expected):
    assert crc(data) == expected
    assert reference_crc32c(data) == expected


@settings(deadline=None, max_examples=200)
@given(data=st.binary(max_size=4096), value=st.integers(0, 2**32 - 1))
def test_matches_the_bitwise_reference(data, value):
    expected = reference_crc32c(data, value)
    for crc in IMPLEMENTATIONS:
        assert crc(data, value) == expected


@settings(deadline=None, max_examples=200)
@given(data=st.binary(max_size=4096), cut=st.floats(0, 1))
def test_chaining_at_any_split_point(data, cut):
    split = int(len(data) * cut)
    for crc in IMPLEMENTATIONS:
        assert crc(data[split:], crc(data[:split])) == crc(data)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 767, 768, 769, 1023, 1024, 1025, 1024 + 15, 1024 + 16, 1024 + 63,
                                    1024 + 64, 1280 - 1, 1280, 1280 + 17, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1,
                                    100_003])
def test_unaligned_starts_and_odd_lengths(rng, length):
    """Slices at offsets 1..15: the head bytes before an 8-byte boundary, every 3-way block size,
    and the AVX-512 folding's edges (from 1 KiB: 256-byte steps, then 64- and 16-byte blocks, then
    the bytes left to the crc32 instruction)."""
    buffer = rng.integers(0, 256, length + 16, dtype=np.uint8)
    assert fastio.crc32c(buffer[:0]) == 0
    for offset in range(1, 16):
        view = memoryview(buffer)[offset:offset + length]
        expected = crc32c_software(view)
        assert fastio.crc32c(view) == expected
        assert fastio.crc32c(bytes(view)) == expected
        assert crc32c_sse42(view) == expected
    assert reference_crc32c(bytes(buffer[3:3 + min(length, 800)])) == fastio.crc32c(buffer[3:3 + min(length, 800)])


def test_hardware_and_software_agree_on_64_mib(rng):
    data = np.frombuffer(rng.bytes(64 << 20), dtype=np.uint8)
    assert fastio.crc32c(data) == crc32c_software(data) == crc32c_sse42(data)
    # and chained over uneven pieces
    value = 0
    for start, end in [(0, 5), (5, 1 << 20), (1 << 20, (40 << 20) + 3), ((40 << 20) + 3, data.size)]:
        value = fastio.crc32c(data[start:end], value)
    assert value == crc32c_software(data)


def test_accepts_every_c_contiguous_buffer_kind():
    payload = bytes(range(256)) * 5
    expected = reference_crc32c(payload)
    readonly = np.frombuffer(payload, dtype=np.uint8)
    assert not readonly.flags.writeable
    for data in (payload, bytearray(payload), memoryview(payload), memoryview(bytearray(payload)).toreadonly(),
                 readonly, readonly.view(np.float32), readonly.reshape(10, 128), memoryview(readonly)):
        assert fastio.crc32c(data) == expected, type(data)
        assert crc32c_software(data) == expected, type(data)


@pytest.mark.parametrize("crc", IMPLEMENTATIONS)
def test_non_contiguous_buffer_is_rejected_clearly(crc):
    strided = np.arange(64, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        crc(strided)
    with pytest.raises(ValueError, match="C-contiguous"):
        crc(memoryview(np.zeros((4, 4), dtype=np.uint8, order="F")))


def test_non_buffers_and_bad_values_are_rejected():
    with pytest.raises(TypeError):
        fastio.crc32c("text")
    with pytest.raises(OverflowError):
        fastio.crc32c(b"", 1 << 32)
    with pytest.raises(OverflowError):
        fastio.crc32c(b"", -1)


@pytest.mark.parametrize("checksum, mib, of_zeros", [(fastio.crc32c, 2048, 0x527D5351),   # crc32c_sse42 of them
                                                      (fastio.crc32, 256, None)])        # zlib.crc32 of them
def test_other_threads_run_while_it_checksums(checksum, mib, of_zeros):
    """Large buffers are checksummed without the GIL (fastio.crc32c, and fastio.crc32, which step
    records use): a Python thread keeps running meanwhile."""
    # Zero pages cost no memory, and stay in cache: each call takes tens of milliseconds (the
    # AVX-512 CRC-32C needs 2 GiB for that; 256 MiB took it 4 ms, too short a window on a busy machine).
    data = np.zeros(mib << 20, dtype=np.uint8)
    if of_zeros is None:
        of_zeros = zlib.crc32(data)
    for _attempt in range(3):  # retries guard only against a busy machine starving the counter
        stamps = []
        running = threading.Event()
        stop = threading.Event()

        def count(stamps=stamps, running=running, stop=stop):
            running.set()
            while not stop.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0.0002)  # hand the GIL back at once, so stamps cannot pile up before the call
        counter = threading.Thread(target=count)
        counter.start()
        running.wait()
        try:
            started = time.perf_counter()
            value = checksum(data)
            ended = time.perf_counter()
        finally:
            stop.set()
            counter.join()
        assert value == of_zeros
        # Stamps in the middle half of the call: with the GIL held there would be none at all.
        quarter = (ended - started) / 4
        if any(started + quarter < t < ended - quarter for t in stamps):
            return
    pytest.fail(f"no other Python thread ran during three long {checksum.__name__} calls")


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)),
                                                      max_size=8))
def test_crc32c_regions_is_crc32c_of_each_region(data, spans):
    buffer = np.frombuffer(bytearray(data or b"\0"), dtype=np.uint8)
    base = buffer.ctypes.data
    regions = [(min(a, buffer.size), min(b, buffer.size - min(a, buffer.size))) for a, b in spans]
    got = fastio.crc32c_regions([base + start for start, _ in regions], [size for _, size in regions])
    assert got == [fastio.crc32c(buffer[start:start + size].tobytes()) for start, size in regions]


def test_crc32c_regions_refuses_a_null_address_and_mismatched_lists():
    with pytest.raises(ValueError, match="region 0 has a null address"):
        fastio.crc32c_regions([0], [4])
    with pytest.raises(ValueError, match="2 addresses and 1 sizes"):
        fastio.crc32c_regions([1, 2], [0])
    assert fastio.crc32c_regions([0], [0]) == [0]
