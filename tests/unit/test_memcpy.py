"""fastio.copy_regions: the GIL-free bulk copy lowdiff's background snapshots use."""
import threading
import time

import numpy as np
import pytest

import fastio


def address(array: np.ndarray) -> int:
    return array.ctypes.data


def test_copies_every_region_and_counts_bytes(rng):
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4095, 4096, 1 << 20, 0, 77)]
    targets = [np.zeros_like(s) for s in sources]
    copied = fastio.copy_regions([address(t) for t in targets], [address(s) for s in sources],
                                 [s.nbytes for s in sources])
    assert copied == sum(s.nbytes for s in sources)
    for s, t in zip(sources, targets):
        assert np.array_equal(s, t)


def test_copies_into_offsets_of_one_buffer(rng):
    """The snapshot case: many tensors into one aligned buffer at chosen offsets."""
    staging = fastio.aligned_buffer(3 * 4096)
    view = np.frombuffer(staging.view(), dtype=np.uint8)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (100, 4096, 10)]
    offsets = [0, 4096, 8192]
    fastio.copy_regions([address(view) + o for o in offsets], [address(p) for p in parts], [p.nbytes for p in parts])
    for o, p in zip(offsets, parts):
        assert np.array_equal(view[o:o + p.nbytes], p)
    assert not view[100:4096].any()


def test_nothing_to_copy():
    assert fastio.copy_regions([], [], []) == 0


def test_mismatched_lists_are_rejected():
    with pytest.raises(ValueError, match="2 destinations, 1 sources and 2 sizes"):
        fastio.copy_regions([1, 2], [3], [4, 5])


def test_null_address_is_rejected_before_anything_is_copied():
    source = np.arange(8, dtype=np.uint8)
    target = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="region 1 has a null address"):
        fastio.copy_regions([address(target), 0], [address(source), address(source)], [8, 8])
    assert not target.any()
    # an empty region may have any address: nothing is read or written
    assert fastio.copy_regions([0], [0], [0]) == 0


def test_other_threads_run_while_it_copies():
    """The copy holds no GIL: a Python thread keeps making progress during a long copy."""
    source = np.ones(256 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
    counter = threading.Thread(target=count)
    counter.start()
    try:
        started = time.perf_counter()
        fastio.copy_regions([address(target)] * 8, [address(source)] * 8, [source.nbytes] * 8)
        ended = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    assert target.all()
    # Ticks in the middle half of the copy: with the GIL held there would be none at all.
    quarter = (ended - started) / 4
    assert any(started + quarter < t < ended - quarter for t in ticks)


def test_checksums_are_the_crc32c_of_each_region(rng):
    """Copy and checksum in one pass: chunks of 256 KiB, so regions around that size matter."""
    sizes = (0, 1, 4097, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 3 * 256 * 1024 + 17)
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    targets = [np.zeros_like(s) for s in sources]
    crcs = fastio.copy_regions([address(t) for t in targets], [address(s) for s in sources], list(sizes),
                               checksums=True)
    assert crcs == [fastio.crc32c(s) for s in sources]
    for s, t in zip(sources, targets):
        assert np.array_equal(s, t)
    assert fastio.copy_regions([], [], [], checksums=True) == []


@pytest.mark.parametrize("size", [1087, 1088, 1089, 1088 + 255, 1088 + 256 + 63, 1088 + 256 + 64 + 15,
                                  1088 + 256 + 64 + 16 + 7, 100_003, (1 << 20) + 5])
def test_checksummed_copy_at_every_destination_alignment(rng, size):
    """The one-pass copy (AVX-512 folding, streaming stores to a 64-byte aligned destination) copies
    a head until the destination is aligned, then 256-, 64- and 16-byte blocks, then a tail: every
    destination offset within 64 bytes, and sizes at each stage's edge, give the exact bytes, the
    CRC-32C of the table path, and nothing written outside the region."""
    from fastio._memops import crc32c_software
    source = rng.integers(0, 256, size + 64, dtype=np.uint8)
    for start in (0, 5):
        for offset in range(0, 64, 7):
            target = np.zeros(size + 128, dtype=np.uint8)
            view = target[offset:offset + size]
            crcs = fastio.copy_regions([address(view)], [address(source[start:])], [size], checksums=True)
            assert crcs == [crc32c_software(source[start:start + size])]
            assert np.array_equal(view, source[start:start + size])
            assert not target[:offset].any() and not target[offset + size:].any()


def test_populate_faults_pages_in_and_keeps_them_zero():
    buffer = fastio.aligned_buffer(5 * 4096 + 100)
    assert buffer.populate(4096, 3 * 4096) is True   # Linux 5.14+ (this project's machines)
    assert buffer.populate(0, 10**9) is True          # clamped to the mapping
    assert buffer.populate(4096, 4096) is True        # nothing to do
    assert not buffer.numpy().any()
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        buffer.populate(100)
