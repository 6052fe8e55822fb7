"""lowdiff.distributed.nonzero: the elements a sparse record of a gradient must hold, judged by bits."""
import pytest
import torch

from lowdiff.distributed.ddp import AggregatedRecorder
from lowdiff.distributed.nonzero import _nonzero_torch, nonzero_elements
from lowdiff.step.compress import decompress_into


def bits_reference(flat: torch.Tensor):
    as_bytes = flat.contiguous().view(torch.uint8).view(flat.numel(), flat.element_size())
    positions = as_bytes.ne(0).any(dim=1).nonzero().view(-1)
    return positions.to(torch.int32), flat[positions]


def sparse_tensor(count: int, density: float, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(count, dtype=dtype)
    picked = torch.randperm(count, generator=g)[:int(count * density)]
    flat[picked] = torch.randn(picked.numel(), generator=g).to(dtype)
    return flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("count", [0, 1, 7, 31, 33, 1000, 70_001])
def test_same_as_a_bitwise_reference(dtype, count):
    flat = sparse_tensor(count, 0.05, dtype, seed=count)
    indices, values = nonzero_elements(flat)
    want_indices, want_values = bits_reference(flat)
    assert indices.dtype == torch.int32 and values.dtype == dtype
    assert torch.equal(indices, want_indices)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))


def test_negative_zero_and_nan_payloads_are_kept():
    flat = torch.zeros(100)
    flat[3] = -0.0
    flat.view(torch.int32)[50] = 0x7FC00123   # a NaN with a payload
    flat[99] = 1.5
    indices, values = nonzero_elements(flat)
    assert indices.tolist() == [3, 50, 99]
    assert values.view(torch.int32).tolist() == [flat.view(torch.int32)[i].item() for i in (3, 50, 99)]


@pytest.mark.parametrize("expected", [0, 1, 10, 500, 100_000])
def test_any_guess_of_the_count_gives_the_same_result(expected):
    flat = sparse_tensor(50_000, 0.01, torch.float32, seed=3)
    want_indices, want_values = bits_reference(flat)
    indices, values = nonzero_elements(flat, expected)
    assert torch.equal(indices, want_indices) and torch.equal(values, want_values)


def test_all_zero_and_all_nonzero():
    assert nonzero_elements(torch.zeros(4096))[0].numel() == 0
    full = torch.arange(1, 4097, dtype=torch.float32)
    indices, values = nonzero_elements(full)
    assert torch.equal(indices, torch.arange(4096, dtype=torch.int32)) and torch.equal(values, full)


def test_a_view_that_starts_inside_its_storage():
    base = sparse_tensor(10_000, 0.05, torch.float32, seed=5)
    flat = base[3:]   # not 32-byte aligned
    indices, values = nonzero_elements(flat)
    want_indices, want_values = bits_reference(flat)
    assert torch.equal(indices, want_indices) and torch.equal(values, want_values)


def test_torch_fallback_agrees():
    flat = sparse_tensor(5000, 0.05, torch.float32, seed=6)
    flat[10] = -0.0
    a, b = nonzero_elements(flat), _nonzero_torch(flat)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


def test_aggregated_record_replays_to_the_same_bytes():
    """Under DDP the record of the hook's aggregate must give back its exact bytes, -0.0 included
    (a gradient clipped to underflow, or changed by the user between backward and step)."""
    recorder = AggregatedRecorder(sparse=True)
    for step in range(3):   # the count remembered from the last step is only a hint
        grad = sparse_tensor(20_000, 0.02 * (step + 1), torch.float32, seed=step).view(100, 200)
        grad.view(-1)[7 + step] = -0.0
        record = recorder.compress(grad, slot=0, residuals={})
        replayed = torch.full_like(grad, 3.0)
        decompress_into(record, replayed)
        assert torch.equal(replayed.view(torch.int32), grad.view(torch.int32))


@pytest.mark.parametrize("capacity", [0, 1, 7, 8, 9, 15, 16, 17, 100, 1000])
@pytest.mark.parametrize("itemsize_dtype", [torch.int32, torch.int64, torch.int16])
def test_the_scan_stores_the_first_capacity_and_never_writes_past_it(capacity, itemsize_dtype):
    """The 4-byte scan stores 8 lanes at a time (AVX2 where the CPU has it): it must still store
    exactly the first ``capacity`` elements and nothing beyond them, and count them all."""
    from lowdiff.distributed._nonzero import nonzero_into
    g = torch.Generator().manual_seed(capacity)
    flat = torch.zeros(1003, dtype=itemsize_dtype)
    picked = torch.randperm(1003, generator=g)[:300]
    flat[picked] = torch.randint(1, 1000, (300,), generator=g, dtype=itemsize_dtype)
    flat[0] = 0
    flat[1002] = 5                                  # in the tail after the last whole block of 8
    want_indices, want_values = bits_reference(flat)
    guard = 24
    positions = torch.full((capacity + guard,), -7, dtype=torch.int32)
    values = torch.full((capacity + guard,), -7, dtype=itemsize_dtype)
    found = nonzero_into(flat.data_ptr(), flat.numel(), flat.element_size(), positions.data_ptr(),
                         values.data_ptr(), capacity)
    assert found == want_indices.numel()
    stored = min(capacity, found)
    assert torch.equal(positions[:stored], want_indices[:stored])
    assert torch.equal(values[:stored], want_values[:stored])
    assert (positions[capacity:] == -7).all() and (values[capacity:] == -7).all(), "written past capacity"
