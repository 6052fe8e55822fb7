"""Properties of the step-record encoding, batch files and compressors, and the public names."""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastio
import lowdiff
import recovery
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.batchfile import BatchReader, write_batch
from lowdiff.format.records import RECORD_HEADER, StepRecord, decode_record, encode_record
from lowdiff.step.compress import Compressed, Dense, TopK, decompress_into

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ------------------------------------------------------------------ strategies
@st.composite
def values_of(draw, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` with random bit patterns (NaNs, infs, -0.0 included): exactness
    must not depend on the values being 'nice'."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    return torch.frombuffer(bytearray(raw), dtype=dtype) if count else torch.empty(0, dtype=dtype)


@st.composite
def sparse_grads(draw) -> Compressed:
    numel = draw(st.integers(1, 2**31 - 1))
    nnz = draw(st.integers(1, min(numel, 40)))
    indices = sorted(draw(st.sets(st.integers(0, numel - 1), min_size=nnz, max_size=nnz)))
    dtype = draw(st.sampled_from(DTYPES))
    return Compressed("sparse", numel, draw(values_of(nnz, dtype)), torch.tensor(indices, dtype=torch.int32))


@st.composite
def dense_grads(draw) -> Compressed:
    numel = draw(st.integers(0, 64))
    return Compressed("dense", numel, draw(values_of(numel, draw(st.sampled_from(DTYPES)))))


grads = st.one_of(sparse_grads(), dense_grads(), st.just(Compressed("none", 0, None)))


@st.composite
def handed_over_unsorted(draw) -> tuple[Compressed, Compressed]:
    """(what a compressor may hand over: int64 indices in any order, values permuted with them;
    what must be recorded: the same gradient with int32 indices sorted ascending)."""
    canonical = draw(sparse_grads())
    order = torch.tensor(draw(st.permutations(range(canonical.indices.numel()))), dtype=torch.int64)
    unsorted = Compressed("sparse", canonical.numel, canonical.values[order], canonical.indices.long()[order],
                          sorted=False)
    return unsorted, canonical


@st.composite
def step_records(draw) -> StepRecord:
    step = draw(st.integers(1, 2**40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))  # deterministic per example
    objects = {"groups_used": [{"lr": draw(st.floats(allow_nan=False)), "betas": (0.9, 0.999)}],
               "rng": {"torch": gen.get_state()},
               "buffers": {"bn.running_mean": torch.randn(3, generator=gen)},
               "extra": {"sampler": {"epoch": draw(st.integers(0, 10)), "position": 3}}}
    return StepRecord(step, draw(st.booleans()), draw(st.lists(grads, max_size=6)), objects)


def encoded(record: StepRecord) -> bytes:
    return b"".join(bytes(b) for b in encode_record(record))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.contiguous().view(torch.uint8).tolist() == b.contiguous().view(torch.uint8).tolist()


def assert_same_record(decoded: StepRecord, record: StepRecord) -> None:
    assert decoded.step == record.step and decoded.skipped == record.skipped
    assert len(decoded.grads) == len(record.grads)
    for got, want in zip(decoded.grads, record.grads):
        assert (got.kind, got.numel) == (want.kind, want.numel)
        if want.kind == "none":
            assert got.values is None
            continue
        assert same_bits(got.values, want.values), "gradient values must round trip bit for bit"
        if want.kind == "sparse":
            assert got.indices.dtype == torch.int32
            assert torch.equal(got.indices, want.indices)
    assert_same_tree(decoded.objects, record.objects)


def assert_same_tree(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for key in want:
            assert_same_tree(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_tree(a, b)
    else:
        assert got == want or (got != got and want != want)  # NaN == NaN here


# ------------------------------------------------------------------ records
@SETTINGS
@given(step_records())
def test_record_round_trip(record):
    data = encoded(record)
    assert_same_record(decode_record(data, "mem", 0, expected_step=record.step), record)


@SETTINGS
@given(step_records(), st.integers(0, 15))
def test_a_record_decoded_from_a_buffer_handed_over_is_the_same_and_made_of_views_of_it(record, shift):
    """``owned``: at any alignment of the buffer the bytes decode to the same record, and the values
    are views of the buffer (moved into alignment there, not copied out); not ``owned``: copies."""
    data = encoded(record)
    buffer = bytearray(shift) + bytearray(data)
    start = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    decoded = decode_record(memoryview(buffer)[shift:], "mem", 0, expected_step=record.step, owned=True)
    assert_same_record(decoded, record)
    at = 0   # each value's offset among the record's value bytes (they start 8-aligned)
    for v in (g.values for g in decoded.grads if g.values is not None and g.values.numel()):
        if at % v.element_size() == 0:   # else (mixed dtypes) a copy is fine
            assert start <= v.data_ptr() < start + len(buffer) and v.data_ptr() % v.element_size() == 0
        at += v.numel() * v.element_size()
    copied = decode_record(data, "mem", 0, expected_step=record.step)
    assert_same_record(copied, record)
    assert not any(start <= g.values.data_ptr() < start + len(buffer)
                   for g in copied.grads if g.values is not None and g.values.numel())


def test_dense_values_decoded_from_their_own_buffer_join_without_a_copy():
    from lowdiff.step.apply import GradientBuffers
    params = [torch.zeros(3, 5), torch.zeros(7), torch.zeros(2, 2)]
    grads = [Compressed("dense", p.numel(), torch.randn(p.numel())) for p in params]
    data = encoded(StepRecord(4, False, grads, {"groups_used": [], "groups_after": []}))
    for shift in range(8):
        buffer = bytearray(shift) + bytearray(data)
        record = decode_record(memoryview(buffer)[shift:], "mem", 0, expected_step=4, owned=True)
        (update,) = GradientBuffers(params).prepare(record).updates
        assert update.indices is None and torch.equal(update.values, torch.cat([g.values for g in grads]))
        assert update.values.data_ptr() == record.grads[0].values.data_ptr()   # one view, no concatenation


def test_values_lying_back_to_back_are_written_in_place_with_the_same_bytes():
    from lowdiff.format.records import _on_cpu
    from lowdiff.format.tree import joined_in_place
    joined = torch.randn(40)
    pieces = list(joined.split([7, 0, 13, 20]))
    view = joined_in_place(pieces)
    assert view is not None and view.data_ptr() == joined.data_ptr() and torch.equal(view, joined)
    assert _on_cpu(pieces).data_ptr() == joined.data_ptr()                  # no copy
    apart = [joined[:7], joined[8:20]]                                       # a gap
    swapped = [pieces[2], pieces[0]]                                         # out of order
    other = [joined[:7], torch.randn(13)]                                    # two storages
    mixed = [joined[:7], joined[7:20].view(torch.int32)]                    # two dtypes
    for case in (apart, swapped, other, mixed[:1]):
        assert joined_in_place(case) is None
    assert joined_in_place(mixed) is None
    assert torch.equal(_on_cpu(apart), torch.cat(apart)) and _on_cpu(apart).data_ptr() != joined.data_ptr()
    # A record whose values are views of one buffer encodes to the bytes of one whose values are not.
    dense = [Compressed("dense", 7, pieces[0]), Compressed("dense", 13, pieces[2]),
             Compressed("dense", 20, pieces[3])]
    copies = [Compressed("dense", g.numel, g.values.clone()) for g in dense]
    first, second = (b"".join(map(bytes, encode_record(StepRecord(2, False, g, {})))) for g in (dense, copies))
    assert first == second


@SETTINGS
@given(sparse_grads())
def test_delta_encoded_indices_round_trip_exactly(grad):
    record = StepRecord(7, False, [grad], {})
    (got,) = decode_record(encoded(record), "mem", 0).grads
    assert got.indices.tolist() == grad.indices.tolist()
    # and the gradient it stands for is the same dense tensor (indices remapped into a small one)
    if int(grad.indices.max()) >= 4096:
        return
    numel = int(grad.indices.max()) + 1
    want = torch.zeros(numel, dtype=grad.values.dtype)
    have = torch.zeros(numel, dtype=grad.values.dtype)
    decompress_into(Compressed("sparse", numel, grad.values, grad.indices), want)
    decompress_into(Compressed("sparse", numel, got.values, got.indices), have)
    assert same_bits(have, want)


def test_indices_at_the_int32_limits_round_trip():
    idx = torch.tensor([0, 1, 2**31 - 2, 2**31 - 1], dtype=torch.int32)
    record = StepRecord(1, False, [Compressed("sparse", 2**31, torch.arange(4.0), idx)], {})
    (got,) = decode_record(encoded(record), "mem", 0).grads
    assert got.indices.tolist() == idx.tolist()


def test_unsorted_indices_at_the_packed_sort_limit_are_recorded_sorted_with_their_values():
    # Two tensors of 2**31 - 1 elements together: the largest total the encoder sorts as packed
    # (key, position) pairs; the second tensor's keys reach 2**31 - 2.
    first, second = 2**30, 2**31 - 1 - 2**30
    a = Compressed("sparse", first, torch.tensor([3.0, 1.0, 2.0]), torch.tensor([first - 1, 0, 5]), sorted=False)
    b = Compressed("sparse", second, torch.tensor([4.0, 5.0]), torch.tensor([second - 1, 7]), sorted=False)
    got = decode_record(encoded(StepRecord(1, False, [a, b], {})), "mem", 0).grads
    assert [g.indices.tolist() for g in got] == [[0, 5, first - 1], [7, second - 1]]
    assert [g.values.tolist() for g in got] == [[1.0, 2.0, 3.0], [5.0, 4.0]]


def test_a_large_structured_part_compressed_by_several_zstd_threads_round_trips(monkeypatch):
    from lowdiff.format import records
    monkeypatch.setattr(records, "_zstd_threads", lambda: 2)   # as on a machine with 4+ cores
    monkeypatch.setattr(records, "_local", type(records._local)())
    numel = 3 * records.PARALLEL_ZSTD_BYTES   # deltas of 2 bytes: past the threshold
    idx = torch.randperm(4 * numel, generator=torch.Generator().manual_seed(0))[:numel].sort().values
    record = StepRecord(2, False, [Compressed("sparse", 4 * numel, torch.randn(numel), idx.to(torch.int32))], {})
    data = encoded(record)
    assert hasattr(records._local, "zstd_parallel")   # the threaded context did the work
    assert_same_record(decode_record(data, "mem", 0, expected_step=2), record)


@SETTINGS
@given(step_records(), st.data())
def test_any_truncation_of_a_record_is_detected(record, data):
    blob = encoded(record)
    cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        decode_record(blob[:cut], "some/file.ldd", 128)
    assert info.value.path == "some/file.ldd" and "offset 128" in str(info.value)


@SETTINGS
@given(step_records(), st.data())
def test_a_bit_flip_in_a_record_body_fails_the_checksum(record, data):
    blob = bytearray(encoded(record))
    position = data.draw(st.integers(RECORD_HEADER.size, len(blob) - 1), label="byte")
    blob[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        decode_record(bytes(blob), "f", 0, expected_step=record.step)


# Header fields: magic (0-3), version (4-5), flags (6-7, none defined: any set flag is rejected),
# step (8-15), packed length (16-19), raw length (20-27), crc (28-31).
@SETTINGS
@given(step_records(), st.integers(0, RECORD_HEADER.size - 1), st.integers(0, 7))
def test_a_bit_flip_in_a_record_header_is_detected(record, position, bit):
    blob = bytearray(encoded(record))
    blob[position] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError, match="unknown flags" if position in (6, 7) else None):
        decode_record(bytes(blob), "f", 0, expected_step=record.step)


# ------------------------------------------------------------------ batch files
def _batch_records(count: int = 4, first: int = 11):
    gen = torch.Generator().manual_seed(5)
    records = []
    for step in range(first, first + count):
        idx = torch.sort(torch.randperm(1000, generator=gen)[:20].to(torch.int32)).values
        grads = [Compressed("sparse", 1000, torch.randn(20, generator=gen), idx),
                 Compressed("dense", 8, torch.randn(8, generator=gen).to(torch.bfloat16)),
                 Compressed("none", 0, None)]
        records.append(StepRecord(step, False, grads, {"extra": {"n": step}}))
    return records


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    """(bytes of a 4-record batch file, the records, [(step, offset, nbytes)] from its index)."""
    path = str(tmp_path_factory.mktemp("batch") / "diff-000000000011-000000000014-abcdef01.ldd")
    records = _batch_records()
    write_batch(path, "abcdef01", [(r.step, encode_record(r)) for r in records])
    with BatchReader(path) as reader:
        assert reader.index_error is None
        entries = list(reader.entries)
        for position, record in enumerate(records):
            assert_same_record(reader.read_record(position), record)
    with open(path, "rb") as f:
        return f.read(), records, entries


def test_batch_file_index_lists_consecutive_records(batch_file):
    data, records, entries = batch_file
    assert [e[0] for e in entries] == [r.step for r in records]
    assert entries[0][1] == 16  # right after the preamble
    for (_, offset, nbytes), (_, next_offset, _) in zip(entries, entries[1:]):
        assert offset + nbytes == next_offset


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_any_truncation_of_a_batch_file_is_detected_and_the_valid_prefix_kept(batch_file, data):
    blob, records, entries = batch_file
    cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "diff-000000000011-000000000014-abcdef01.ldd")
        with open(path, "wb") as f:
            f.write(blob[:cut])
        with BatchReader(path) as reader:
            assert isinstance(reader.index_error, CorruptCheckpointError), f"truncation at {cut} went unnoticed"
            assert reader.index_error.path == path
            complete = [e for e in entries if e[1] + e[2] <= cut]
            assert reader.entries == complete
            for position, record in enumerate(records[:len(complete)]):
                assert_same_record(reader.read_record(position), record)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_bit_flip_in_a_batch_record_is_detected(batch_file, data):
    blob, records, entries = batch_file
    which = data.draw(st.integers(0, len(entries) - 1), label="record")
    _, offset, nbytes = entries[which]
    position = data.draw(st.integers(offset, offset + nbytes - 1), label="byte")  # header bytes included
    damaged = bytearray(blob)
    damaged[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "diff-000000000011-000000000014-abcdef01.ldd")
        with open(path, "wb") as f:
            f.write(damaged)
        with BatchReader(path) as reader:
            assert reader.index_error is None
            for position_ in range(which):
                assert_same_record(reader.read_record(position_), records[position_])
            with pytest.raises(CorruptCheckpointError) as info:
                reader.read_record(which)
            assert info.value.path == path


# ------------------------------------------------------------------ compressors
@st.composite
def gradients(draw, min_numel=1, max_numel=3000):
    numel = draw(st.integers(min_numel, max_numel))
    seed = draw(st.integers(0, 2**32 - 1))
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):  # ties and zeros
        grad = torch.round(grad * 2) / 2
    shape = draw(st.sampled_from([(numel,), (1, numel)]))
    return grad.reshape(shape)


@SETTINGS
@given(st.lists(st.one_of(handed_over_unsorted(), grads.map(lambda g: (g, g))), min_size=1, max_size=6))
def test_unsorted_indices_are_recorded_sorted_with_their_values(pairs):
    handed, canonical = [p[0] for p in pairs], [p[1] for p in pairs]
    decoded = decode_record(encoded(StepRecord(7, False, handed, {})), "<mem>", 0)
    assert_same_record(decoded, StepRecord(7, False, canonical, {}))


@SETTINGS
@given(gradients(), st.floats(0.0001, 1.0), st.integers(1, 512))
def test_topk_picks_the_largest_unique_and_records_them_sorted_int32(grad, ratio, min_numel):
    before = grad.clone()
    compressor = TopK(ratio=ratio, min_numel=min_numel)
    out = compressor.compress(grad, 0, {})
    flat = grad.reshape(-1)
    assert torch.equal(grad, before), "compress must not modify the gradient"
    assert out.numel == flat.numel()
    if flat.numel() < min_numel:
        assert out.kind == "dense" and out.indices is None
        assert same_bits(out.values, flat)
        return
    assert out.kind == "sparse"
    k = max(1, int(ratio * flat.numel()))
    assert out.indices.numel() == k and out.values.numel() == k
    assert same_bits(out.values, flat[out.indices.long()]), "values[i] belongs at indices[i]"
    # what is recorded: int32 indices, sorted and unique, the values permuted with them
    recorded = decode_record(b"".join(bytes(memoryview(p).cast("B")) for p in
                                      encode_record(StepRecord(1, False, [out], {}))), "<mem>", 0).grads[0]
    assert recorded.indices.dtype == torch.int32 and recorded.sorted
    idx = recorded.indices.to(torch.int64)
    assert bool((idx[1:] > idx[:-1]).all()), "recorded indices must be sorted and unique"
    assert 0 <= int(idx[0]) and int(idx[-1]) < flat.numel()
    assert same_bits(recorded.values, flat[idx])
    dropped = torch.ones(flat.numel(), dtype=torch.bool)
    dropped[idx] = False
    if dropped.any():
        assert flat[idx].abs().min() >= flat[dropped].abs().max()
    # decompress_into reproduces exactly: kept values in place, zero elsewhere
    target = torch.full_like(grad, float("nan"))
    decompress_into(out, target)
    want = torch.zeros_like(flat)
    want[idx] = flat[idx]
    assert same_bits(target.reshape(-1), want)


@SETTINGS
@given(gradients(max_numel=200))
def test_dense_records_the_gradient_unchanged(grad):
    out = Dense().compress(grad, 3, {})
    assert out.kind == "dense" and out.indices is None and out.numel == grad.numel()
    assert same_bits(out.values, grad.reshape(-1))
    assert out.values.data_ptr() != grad.data_ptr(), "the record must not alias the live gradient"
    target = torch.zeros_like(grad)
    decompress_into(out, target)
    assert same_bits(target, grad)


@SETTINGS
@given(st.lists(gradients(min_numel=600, max_numel=600), min_size=1, max_size=4), st.floats(0.001, 0.5))
def test_topk_error_feedback_keeps_what_was_not_sent(steps, ratio):
    compressor = TopK(ratio=ratio, error_feedback=True, min_numel=64)
    residuals: dict = {}
    previous = torch.zeros(600)
    for grad in steps:
        out = compressor.compress(grad, 5, residuals)
        sent = decompress_into(out, torch.zeros(600))
        want = (grad.reshape(-1) + previous) - sent
        assert torch.equal(residuals[5], want)
        assert torch.equal(sent[out.indices.long()], (grad.reshape(-1) + previous)[out.indices.long()])
        previous = residuals[5].clone()


def test_topk_error_feedback_on_a_tiny_tensor_sends_everything():
    compressor = TopK(ratio=0.1, error_feedback=True, min_numel=64)
    residuals = {0: torch.full((10,), 0.25)}
    grad = torch.arange(10.0)
    out = compressor.compress(grad, 0, residuals)
    assert out.kind == "dense" and torch.equal(out.values, grad + 0.25)
    assert residuals.get(0) is None or not residuals[0].any()


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_topk_rejects_bad_ratio(bad):
    with pytest.raises(ValueError, match="ratio"):
        TopK(ratio=bad)


# ------------------------------------------------------------------ public names
def test_public_names_are_pinned():
    assert sorted(lowdiff.__all__) == [
        "Auto", "CheckpointError", "CheckpointFileError", "CheckpointLockedError", "CorruptCheckpointError",
        "Dense", "DirectoryBusyError", "Fixed", "ForeignFileError", "IncompatibleCheckpointError", "KeepAll",
        "KeepEvery", "KeepLast", "LowDiffOptimizer", "MissingDeviceError", "MissingRankDirectoryError",
        "NoCheckpointError",
        "Options", "Replica", "ResumableLoader", "Tiers", "TopK", "VersionMismatchError",
        "init_process_group", "wrap"]
    assert sorted(recovery.__all__) == ["Resumed", "VerifyReport", "export", "resume", "verify"]
    assert sorted(fastio.__all__) == [
        "ALIGN_BYTES", "AlignedBuffer", "BULK", "FastioConfig", "Reader", "URGENT", "Writer",
        "aligned_buffer", "backend", "buffer_address", "copy_regions", "crc32", "crc32_shift", "crc32c",
        "crc32c_regions", "engine", "make_engine"]
    for module in (lowdiff, recovery, fastio):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name} is in __all__ but missing"
    errors = [lowdiff.CorruptCheckpointError, lowdiff.ForeignFileError, lowdiff.VersionMismatchError,
              lowdiff.CheckpointLockedError, lowdiff.NoCheckpointError]
    assert all(issubclass(e, lowdiff.CheckpointError) for e in errors)
    assert issubclass(lowdiff.ForeignFileError, lowdiff.CorruptCheckpointError)
    # A newer format is not damage: no handler of damage may swallow it (or delete the file).
    assert not issubclass(lowdiff.VersionMismatchError, lowdiff.CorruptCheckpointError)
    assert issubclass(lowdiff.VersionMismatchError, lowdiff.CheckpointFileError)


def test_record_header_layout_is_pinned():
    """The header is 32 bytes, little-endian, as docs/format.md states."""
    record = StepRecord(0x0102030405, False, [Compressed("dense", 2, torch.tensor([1.0, 2.0]))], {})
    header = bytes(encode_record(record)[0])
    assert len(header) == 32 == RECORD_HEADER.size
    magic, version, flags, step = struct.unpack_from("<4sHHQ", header)
    assert (magic, version, flags, step) == (b"LDRC", 1, 0, 0x0102030405)
    (raw_bytes,) = struct.unpack_from("<Q", header, 20)
    assert raw_bytes == 8
    assert np.frombuffer(encoded(record)[-8:], dtype=np.float32).tolist() == [1.0, 2.0]


def test_a_dense_step_is_applied_from_the_records_values_without_a_copy():
    """The optimizer steps on views of the record's values (a dense record is the size of the
    model: no copy of it into the gradient buffers); afterwards the parameters have their buffer
    views back, and a later sparse step still writes exactly its gradient."""
    from lowdiff.step.apply import GradientBuffers
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.optim.SGD(twins, lr=0.1, momentum=0.9)
    groups = [{k: v for k, v in opt.param_groups[0].items() if k != "params"}]
    dense = [Compressed("dense", p.numel(), torch.randn(p.numel())) for p in params]
    sparse = [Compressed("sparse", 15, torch.tensor([2.0, -1.0]), torch.tensor([3, 9], dtype=torch.int32)),
              Compressed("sparse", 7, torch.tensor([0.5]), torch.tensor([6], dtype=torch.int32))]
    buffers = GradientBuffers(params)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append([p.grad.data_ptr() for p in params]))
    for step, grads in enumerate([dense, sparse, dense, sparse]):
        objects = {"groups_used": groups, "groups_after": groups}
        data = bytearray(encoded(StepRecord(step, False, grads, objects)))
        record = decode_record(memoryview(data), "mem", 0, expected_step=step, owned=True)
        buffers.apply(buffers.prepare(record), opt)
        for twin, g in zip(twins, grads):
            flat = torch.zeros(twin.numel())
            decompress_into(g, flat)
            twin.grad = flat.view(twin.shape)
        twin_opt.step()
        assert all(torch.equal(p, t) for p, t in zip(params, twins)), f"step {step} differs"
        start = np.frombuffer(data, dtype=np.uint8).ctypes.data
        lent = [start <= ptr < start + len(data) for ptr in seen[-1]]
        assert lent == [grads is dense] * 2, f"step {step}: gradients in the record's memory: {lent}"
        assert all(p.grad is view for p, view in zip(params, buffers.views))


def reference_deltas(flat: np.ndarray, counts: list) -> tuple[bytes, list]:
    """The index deltas as the format defines them, in plain numpy: per tensor its first index,
    then differences, as u16 when all of that tensor's fit, else u32."""
    parts, widths, start = [], [], 0
    for count in counts:
        piece = np.diff(flat[start:start + count], prepend=0)
        width = 2 if not count or piece.max() <= 0xFFFF else 4
        parts.append(piece.astype(np.uint16 if width == 2 else np.uint32).tobytes())
        widths.append(width)
        start += count
    return b"".join(parts), widths


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 2**31 - 1), st.integers(0, 300), st.integers(0, 2**32 - 1)),
                min_size=1, max_size=6))
def test_index_deltas_match_the_format_definition_and_decode_back(tensors):
    """lowdiff.format._deltas against the format's definition: mixed widths, empty tensors, a tensor
    whose indices start high (its first delta is its first index)."""
    from lowdiff.format._deltas import decode_deltas_many, encode_deltas
    flats, counts = [], []
    for numel, count, seed in tensors:
        picked = np.random.default_rng(seed).choice(numel, size=min(count, numel), replace=False)
        flats.append(np.sort(picked).astype(np.int64))
        counts.append(len(picked))
    flat = np.concatenate(flats)
    data, widths = encode_deltas(flat, counts)
    assert (bytes(data), widths) == reference_deltas(flat, counts)
    numels = np.array([numel for numel, _, _ in tensors], dtype=np.int64)
    got, bad = decode_deltas_many(bytes(data), 0, np.array(counts, dtype=np.int64), np.array(widths, dtype=np.int64),
                                  numels)
    assert bad == -1 and got.dtype == np.int32 and got.tolist() == flat.tolist()


@pytest.mark.parametrize("indices, numel", [([3, 3], 10), ([4, 10], 10), ([0, 0], 2)])
def test_a_record_with_repeated_or_out_of_range_indices_is_corrupt(indices, numel):
    """Indices the format forbids (a repeat, one at or past the tensor's size) are caught when
    the record is decoded, even though its checksum holds."""
    grad = Compressed("sparse", numel, torch.ones(len(indices)), torch.tensor(indices))
    blob = encoded(StepRecord(3, False, [grad], {}))
    with pytest.raises(CorruptCheckpointError, match="not sorted, unique and < ") as info:
        decode_record(blob, "bad.ldd", 64)
    assert info.value.path == "bad.ldd"


@pytest.mark.parametrize("values", [1, 2, 3, 5, 8])
def test_written_records_put_their_values_at_a_multiple_of_8_and_decode_in_place(tmp_path, values):
    """write_batch pads a record's packed part with a zstd skippable frame where that puts its
    values 8-aligned in the file (docs/format.md); replay then decodes them as views of its read
    buffer, with the CRC (adjusted without rereading the values) holding."""
    records, originals = [], []
    for step in range(1, 9):   # odd value counts move every later record's offset
        dtype = torch.float64 if step % 2 else torch.float32   # one dtype per record: all views
        grads = [Compressed("dense", values + step, torch.randn(values + step, dtype=dtype)),
                 Compressed("dense", step, torch.randn(step, dtype=dtype))]
        originals.append(StepRecord(step, False, grads, {"groups_used": [], "groups_after": [], "s": "x" * step}))
        records.append((step, encode_record(originals[-1])))
    records.append((9, encode_record(StepRecord(9, True, [], {"groups_used": []}))))   # no values: no padding
    path = str(tmp_path / "b.ldd")
    write_batch(path, "0a1b2c3d", records)
    with open(path, "rb") as f:
        blob = f.read()
    reader = BatchReader(path)
    try:
        padded = 0
        for position, original in enumerate(originals):
            step, offset, nbytes = reader.entries[position]
            _, _, _, _, packed_len, raw_len, _ = RECORD_HEADER.unpack_from(blob, offset)
            assert (offset + RECORD_HEADER.size + packed_len) % 8 == 0
            padded += packed_len != len(records[position][1][1])
            data, buffer = reader.read_for_replay(position, _NewMemory())
            decoded = reader.decode_record(position, data, owned=True)
            assert_same_record(decoded, original)
            start = fastio.buffer_address(buffer.view())
            for grad in decoded.grads:   # views of the read buffer: nothing was moved or copied
                assert start <= grad.values.data_ptr() < start + buffer.capacity_bytes
        assert padded, "no record needed padding: the test does not exercise it"
        assert reader.decode_record(8, reader.read_record_bytes(8)).skipped
    finally:
        reader.close()


class _NewMemory:
    def take(self, nbytes):
        return fastio.aligned_buffer(nbytes)


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 300), st.booleans(), st.sampled_from([torch.int32, torch.int64])),
                min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_a_decoded_record_prepared_for_replay_places_every_value_where_the_naive_placement_does(shapes, seed):
    """GradientBuffers.prepare builds a buffer's positions in one C pass (flat_positions) from the
    values and indices a record decodes to (views of one buffer, split): the same int64 positions
    and values as placing each gradient by itself, dense and sparse mixed, from a decoded record
    and from one held in memory (int32 or int64 indices)."""
    from lowdiff.step.apply import GradientBuffers
    gen = torch.Generator().manual_seed(seed)
    params = [torch.zeros(numel) for numel, _, _ in shapes]
    grads = []
    for numel, sparse, index_dtype in shapes:
        if sparse:
            count = 1 + int(torch.randint(numel, (1,), generator=gen))
            indices = torch.randperm(numel, generator=gen)[:count].sort().values.to(index_dtype)
            grads.append(Compressed("sparse", numel, torch.randn(count, generator=gen), indices))
        else:
            grads.append(Compressed("dense", numel, torch.randn(numel, generator=gen)))
    record = StepRecord(3, False, grads, {})
    offsets = np.cumsum([0] + [p.numel() for p in params[:-1]])
    naive = np.concatenate([np.arange(o, o + g.numel) if g.kind == "dense" else g.indices.numpy() + o
                            for g, o in zip(grads, offsets)]).astype(np.int64)
    data = bytearray(encoded(record))
    for source in (record, decode_record(memoryview(data), "mem", 0, owned=True)):
        (update,) = GradientBuffers(params).prepare(source).updates
        assert torch.equal(update.values, torch.cat([g.values for g in grads]))
        if all(g.kind == "dense" for g in grads):
            assert update.indices is None
        else:
            assert update.indices.dtype == torch.int64 and np.array_equal(update.indices.numpy(), naive)


def test_index_deltas_decoded_in_one_pass_name_the_first_tensor_they_do_not_fit():
    from lowdiff.format._deltas import decode_deltas_many, encode_deltas
    indices = np.array([1, 5, 9, 0, 3, 70000, 70001], dtype=np.int64)
    deltas, widths = encode_deltas(indices, [3, 2, 2])
    counts, wide = np.array([3, 2, 2]), np.array(widths, dtype=np.int64)
    decoded, bad = decode_deltas_many(bytes(deltas), 0, counts, wide, np.array([10, 4, 80000]))
    assert bad == -1 and decoded.tolist() == indices.tolist() and decoded.dtype == np.int32
    assert decode_deltas_many(bytes(deltas), 0, counts, wide, np.array([10, 3, 80000])) == (None, 1)   # 3 >= 3
    with pytest.raises(ValueError, match="outside the data"):
        decode_deltas_many(bytes(deltas)[:-1], 0, counts, wide, np.array([10, 4, 80000]))
