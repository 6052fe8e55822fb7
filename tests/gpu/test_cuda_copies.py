"""The GPU path's copies on a real device, piece by piece (tests/gpu/test_device_pieces.py checks
their ordering with fakes on the CPU): a full checkpoint's tensors copied into page-locked memory
with one torch call per device (chunk by chunk into registered staging), a step's TopK record
sorted on the device and copied to pinned memory back to back in parameter order, and the dense
copies made in one concatenation. Each must give the bytes the CPU path gives. Skipped without
CUDA."""
from __future__ import annotations

import pytest
import torch

from lowdiff.capture.devicecopy import DeviceCopy
from lowdiff.format.records import Compressed, StepRecord, encode_record
from lowdiff.persist.pinned import CudaRing, byte_view
from lowdiff.step.compress import TopK, compress_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_full_checkpoints_tensors_reach_page_locked_memory_in_one_call_per_device(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=gen).to(dtype).cuda() for n, dtype in
               [(1000, torch.float32), (3, torch.bfloat16), (5000, torch.float16), (7, torch.float64)]]
    sizes = [s.numel() * s.element_size() for s in sources]
    staging = torch.zeros(sum(sizes), dtype=torch.uint8, pin_memory=True)
    destinations = list(staging.split(sizes))
    calls, refused = [], []
    foreach = torch._foreach_copy_

    def counted(dsts, srcs, non_blocking=False):
        calls.append(len(dsts))
        try:
            return foreach(dsts, srcs, non_blocking=non_blocking)
        except Exception as exc:   # the ring would fall back to a call per tensor: say so here
            refused.append(exc)
            raise
    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    ring = CudaRing()
    device = sources[0].device
    ring.mark([device])
    ring.wait_marked()
    ring.copy_all_async(destinations, [byte_view(s) for s in sources])
    ring.record_done(device).synchronize()
    assert calls == [len(sources)] and refused == []
    for dst, src in zip(destinations, sources):
        assert torch.equal(dst, byte_view(src).cpu())


def test_a_full_checkpoint_lands_chunk_by_chunk_in_registered_staging():
    import fastio
    from lowdiff.persist.pinned import PinnedStaging
    gen = torch.Generator().manual_seed(4)
    sources = [torch.randn(n, generator=gen).cuda() for n in (300_000, 7, 123_457, 1_000_000)]
    sizes = [s.numel() * 4 for s in sources]
    buffer = fastio.aligned_buffer(sum(sizes), populate=True)
    destinations = list(buffer.tensor(sum(sizes)).view(torch.float32).split([s.numel() for s in sources]))
    pinned = PinnedStaging(landing_bytes=1 << 20)
    try:
        pinned.mark(sources)
        landing = pinned.copy(destinations, sources, (buffer.address, buffer.capacity_bytes))
        assert landing is not None and pinned.direct_copies == 1   # registered, copied into directly
        boundaries = list(landing.boundaries())
        assert len(boundaries) == -(-sum(sizes) // (1 << 20)) and boundaries == sorted(boundaries)
        landing.wait_all()
        for dst, src in zip(destinations, sources):
            assert torch.equal(dst, src.cpu())
    finally:
        pinned.forget_all()


def test_a_topk_record_copied_from_the_device_encodes_to_the_cpu_records_bytes():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) for n in (5000, 100, 8192, 64, 4096)]
    compressor = TopK(ratio=0.05, min_numel=4096)
    on_cpu = compress_all(compressor, [g.clone() for g in grads], {})
    on_gpu = compress_all(compressor, [g.cuda() for g in grads], {})
    copy = DeviceCopy(torch.device("cuda", torch.cuda.current_device()))
    host, ready = copy.to_host(on_gpu)
    ready()
    values = [g.values for g in host]
    assert all(v.device.type == "cpu" for v in values)
    assert all(b.data_ptr() == a.data_ptr() + a.numel() * 4 for a, b in zip(values, values[1:]))  # back to back
    cpu_bytes = b"".join(map(bytes, encode_record(StepRecord(3, False, on_cpu, {}))))
    gpu_bytes = b"".join(map(bytes, encode_record(StepRecord(3, False, host, {}))))
    assert cpu_bytes == gpu_bytes   # the same kept values and indices, sorted the same way


def test_dense_copies_made_at_once_equal_one_clone_each():
    grads = [torch.randn(n, device="cuda") for n in (3, 64, 1000, 1)]
    out = compress_all(TopK(ratio=0.1, min_numel=10_000), grads, {})
    assert [g.kind for g in out] == ["dense"] * 4
    assert all(torch.equal(c.values, g.reshape(-1)) and c.values.data_ptr() != g.data_ptr() for c, g in zip(out, grads))
    assert isinstance(out[0], Compressed)
