"""fastio.crc32: zlib's CRC-32 by carry-less multiplication, checked against zlib itself (the
checksum lowdiff's step records carry) and against the table path."""
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastio
from fastio._memops import crc32_backend, crc32_software

POLY = 0x104C11DB7   # zlib's polynomial, normal form with the x^32 term


def x_power_mod(n: int, poly: int = POLY) -> int:
    """x^n mod ``poly`` (a 33-bit polynomial with its x^32 term; test_crc32c.py uses Castagnoli's)."""
    r = 1
    for _ in range(n):
        r <<= 1
        if r & (1 << 32):
            r ^= poly
    return r


def reflected(value: int, bits: int) -> int:
    return int(f"{value:0{bits}b}"[::-1], 2)


def polynomial_quotient(a: int, b: int) -> int:
    q = 0
    while a.bit_length() >= b.bit_length():
        shift = a.bit_length() - b.bit_length()
        q |= 1 << shift
        a ^= b << shift
    return q


def test_folding_constants_are_the_powers_of_x_they_claim():
    """The constants in crc32_core.c, derived: x^k mod P bit-reflected and shifted left by one
    for the folds, and the Barrett pair P and mu = x^64 div P reflected to 33 bits."""
    source = (Path(__file__).parents[2] / "fastio" / "crc32_core.c").read_text()
    folds = {512 + 32: "K1_K2", 512 - 32: "K1_K2", 128 + 32: "K3_K4", 128 - 32: "K3_K4", 64: "K5_0"}
    for power, name in folds.items():
        constant = reflected(x_power_mod(power), 32) << 1
        line = next(line for line in source.splitlines() if line.startswith(f"static const uint64_t {name}"))
        assert f"0x{constant:09x}ull" in line, (power, name, hex(constant))
    barrett = next(line for line in source.splitlines() if line.startswith("static const uint64_t P_MU"))
    assert f"0x{reflected(POLY, 33):09x}ull" in barrett
    assert f"0x{reflected(polynomial_quotient(1 << 64, POLY), 33):09x}ull" in barrett


def test_backend_is_known():
    assert crc32_backend() in ("pclmul", "software")


@pytest.mark.parametrize("crc", [fastio.crc32, crc32_software])
def test_known_vector(crc):
    assert crc(b"") == 0
    assert crc(b"123456789") == 0xCBF43926


def test_every_length_around_the_fold_boundaries(rng):
    """Lengths 0..300 at start offsets 0..16: below 64 bytes (tables only), the 64-byte fold,
    the 16-byte folds after it and the tail of up to 15 bytes."""
    buffer = rng.integers(0, 256, 400, dtype=np.uint8).tobytes()
    for offset in range(17):
        for length in range(301):
            data = buffer[offset:offset + length]
            seed = (offset * 7919 + length) & 0xFFFFFFFF
            assert fastio.crc32(data, seed) == zlib.crc32(data, seed), (offset, length)
            assert crc32_software(data, seed) == zlib.crc32(data, seed), (offset, length)


@settings(deadline=None, max_examples=200)
@given(data=st.binary(max_size=8192), value=st.integers(0, 2**32 - 1), cut=st.floats(0, 1))
def test_matches_zlib_and_chains_at_any_split(data, value, cut):
    split = int(len(data) * cut)
    expected = zlib.crc32(data, value)
    assert fastio.crc32(data, value) == expected
    assert fastio.crc32(data[split:], fastio.crc32(data[:split], value)) == expected


def test_large_buffers_of_every_buffer_kind(rng):
    data = np.frombuffer(rng.bytes((32 << 20) + 13), dtype=np.uint8)
    expected = zlib.crc32(data)
    assert fastio.crc32(data) == expected
    assert fastio.crc32(memoryview(data)[5:]) == zlib.crc32(memoryview(data)[5:])
    assert fastio.crc32(bytearray(data[:100_003])) == zlib.crc32(data[:100_003])
    floats = data[:(1 << 20)].view(np.float32).reshape(256, -1)
    assert fastio.crc32(floats) == zlib.crc32(floats)
    with pytest.raises(ValueError, match="C-contiguous"):
        fastio.crc32(floats[:, ::2])
    with pytest.raises(OverflowError):
        fastio.crc32(b"", 1 << 32)


@settings(deadline=None, max_examples=200)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_shift_combines_the_crcs_of_two_pieces(a, b):
    """crc32(a + b) == crc32_shift(crc32(a), len(b)) ^ crc32(b): zlib's crc32_combine."""
    assert fastio.crc32_shift(fastio.crc32(a), len(b)) ^ fastio.crc32(b) == zlib.crc32(a + b)


def test_shift_past_gigabytes_takes_no_pass_over_them():
    zeros = np.zeros(3 << 20, dtype=np.uint8)
    assert fastio.crc32_shift(0x12345678, 0) == 0x12345678
    # x^(8n) for n = 3 MiB, checked against feeding 3 MiB of zeros (the raw register's meaning)
    a = b"lowdiff"
    assert fastio.crc32_shift(zlib.crc32(a), zeros.size) ^ zlib.crc32(zeros) == zlib.crc32(a + zeros.tobytes())
    fastio.crc32_shift(1, 1 << 62)   # logarithmic in the length
