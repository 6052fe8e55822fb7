"""The pieces of the GPU data path that need no GPU, on the CPU: how a full checkpoint is cut into
chunks, the bound and the ordering of the pinned ring (persist.pinned), and the ordering of a
record's device-to-host copies (capture.devicecopy). The stream and event operations are replaced
by fakes that run a copy either at once or only when its event is waited for, so a ring that reads
a slot before waiting, or reuses a slot before draining it, produces wrong bytes; end to end, those
bytes are a real run's checkpoints, resumed and compared with an uninterrupted run."""
from __future__ import annotations

import pytest
import torch

import lowdiff
import recovery
from lowdiff.capture.devicecopy import CopyEngine, DeviceCopy
from lowdiff.format.records import Compressed
from lowdiff.persist.pinned import PinnedStaging, plan_chunks


# --------------------------------------------------------------------------- chunking
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096, 10_000])
def test_chunks_cover_every_byte_once_in_order_within_the_bound(chunk):
    sizes = [0, 5, 4096, 1, 0, 9999, 64, 3]
    chunks = plan_chunks(sizes, chunk)
    seen = [[] for _ in sizes]
    for pieces in chunks:
        assert sum(length for _, _, length, _ in pieces) <= chunk
        offset = 0
        for index, start, length, slot_offset in pieces:
            assert length > 0 and slot_offset == offset   # packed back to back in the slot
            offset += length
            seen[index].append((start, length))
    flat = [(i, s) for i, pieces in enumerate(seen) for s, _ in pieces]
    assert flat == sorted(flat)                             # source order
    for size, pieces in zip(sizes, seen):
        covered = 0
        for start, length in pieces:
            assert start == covered
            covered += length
        assert covered == size
    assert all(len(c) for c in chunks) and (len(chunks) == 0) == (sum(sizes) == 0)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        plan_chunks([1], 0)


# --------------------------------------------------------------------------- the pinned ring
class _Event:
    def __init__(self, ring, upto):
        self.ring, self.upto = ring, upto

    def synchronize(self):
        self.ring.log.append(("sync", self.upto))
        self.ring.run(self.upto)


class FakeRing:
    """Host tensors stand for device ones. ``eager``: a copy runs when enqueued (a fast GPU);
    otherwise only when an event after it is waited for (a slow one)."""

    def __init__(self, eager: bool):
        self.eager = eager
        self.queue: list = []       # enqueued copies, run in order
        self.done = 0
        self.log: list = []
        self.slots_allocated = 0

    @staticmethod
    def handles(tensor):
        return tensor.numel() > 0 and tensor.dtype != torch.int64   # RNG/step tensors stay "host"

    def slot(self, nbytes):
        self.slots_allocated += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def mark(self, devices):
        self.log.append(("mark",))

    def wait_marked(self):
        self.log.append(("wait_marked",))

    def copy_async(self, dst, src):
        assert self.log and self.log[-1][0] in ("wait_marked", "copy", "record", "sync"), self.log[-3:]
        self.queue.append((dst, src.clone()))   # the source as it is now, as a stream would see it
        self.log.append(("copy", len(self.queue)))
        if self.eager:
            self.run(len(self.queue))

    def record_done(self, device):
        self.log.append(("record", len(self.queue)))
        return _Event(self, len(self.queue))

    def run(self, upto):
        while self.done < upto:
            dst, src = self.queue[self.done]
            dst.copy_(src)
            self.done += 1


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_ring_copies_every_byte_with_bounded_slots(eager, slots):
    gen = torch.Generator().manual_seed(slots)
    sources = [torch.randn(n, generator=gen).to(dtype) for n, dtype in
               [(1000, torch.float32), (3, torch.bfloat16), (0, torch.float32), (5000, torch.float16),
                (7, torch.int64), (2048, torch.float32)]]
    destinations = [torch.zeros_like(s) for s in sources]
    ring = FakeRing(eager)
    staging = PinnedStaging(chunk_bytes=1500, slots=slots, ring=ring)
    assert staging.bound_bytes == 1500 * slots
    staging.mark(sources)
    staging.copy(destinations, sources)
    for d, s in zip(destinations, sources):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))
    assert ring.slots_allocated == slots   # the bound: never more pinned slots than asked for
    chunks = len(plan_chunks([s.numel() * s.element_size() for s in sources if FakeRing.handles(s)], 1500))
    assert staging.chunks_copied == chunks
    # Reused at the next checkpoint, not allocated again.
    staging.copy(destinations, sources)
    assert ring.slots_allocated == slots
    assert ring.log[0] == ("mark",) and ring.log[1] == ("wait_marked",)


# --------------------------------------------------------------------------- a record's copies
class FakeEngine(CopyEngine):
    """Copies that land only when their event is waited for (or never, if nobody waits)."""

    def __init__(self):
        self.pending: list = []
        self.log: list = []

    def stream_waits_for_current(self, device):
        self.log.append("wait-current")

    def copy_to_host(self, src):
        host = torch.zeros_like(src)    # what pinned memory holds before the copy lands
        self.pending.append((host, src.clone()))
        self.log.append("copy")
        return host

    def record_done(self):
        self.log.append("record")
        pending, self.pending = self.pending, []

        class Event:
            def synchronize(self_inner):
                for dst, src in pending:
                    dst.copy_(src)
        return Event()


def test_device_copy_orders_and_defers():
    engine = FakeEngine()
    copy = DeviceCopy(torch.device("cpu"), engine)
    values, indices = torch.tensor([1.5, -2.0]), torch.tensor([3, 9])
    grads = [Compressed("sparse", 10, values, indices, sorted=True), Compressed("none", 4, None),
             Compressed("dense", 2, torch.tensor([4.0, 5.0]))]
    out, ready = copy.to_host(grads)
    # One copy per dtype (values float32, indices int64), after the wait for the compute stream.
    assert engine.log == ["wait-current", "copy", "copy", "record"]
    assert out[1] is grads[1] and out[0].values is not values
    assert not out[0].values.any()          # not landed yet: a reader must wait
    ready()
    ready()                                 # idempotent
    assert torch.equal(out[0].values, values) and torch.equal(out[0].indices, indices)
    assert torch.equal(out[2].values, grads[2].values)
    assert copy.to_host([Compressed("none", 1, None)])[1] is None


# --------------------------------------------------------------------------- end to end, real files
def _train(directory, steps, fake, resume_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, str(directory),
                       compressor=lowdiff.TopK(ratio=0.3, min_numel=64), full_every=4, batch_steps=3)
    if fake:
        # The GPU path's orderings with fake streams: records and full checkpoints land late.
        opt._capture._device_copy = DeviceCopy(torch.device("cpu"), FakeEngine())
        opt._fulls._pinned = PinnedStaging(chunk_bytes=999, slots=2, ring=FakeRing(eager=False))
        opt._fulls._snapshot.device_copy = opt._fulls._pinned
    start = recovery.resume(str(directory), model, opt) if resume_at is not None else 0
    assert start == (resume_at or 0)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return model, opt


def test_run_through_fake_device_copies_resumes_exactly(tmp_path):
    ref_model, ref_opt = _train(tmp_path / "ref", 14, fake=False)
    _train(tmp_path / "run", 9, fake=True)
    # Resume from the last full checkpoint (8) and its record (9), written through the fakes.
    model, opt = _train(tmp_path / "run", 14, fake=True, resume_at=9)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    for sa, sb in zip(ref_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------- replica of a GPU model
def test_cpu_replica_of_a_gpu_model_is_refused_unless_accepted():
    from types import SimpleNamespace

    from lowdiff.persist.replica import check_replica_arguments
    # A stand-in for a CUDA parameter (no GPU here; tests/gpu/test_cuda_resume.py uses a real one).
    on_gpu = [SimpleNamespace(device=torch.device("cuda", 0))]
    with pytest.raises(ValueError, match="allow_inexact_gpu=True"):
        check_replica_arguments(lowdiff.Dense(), on_gpu)
    check_replica_arguments(lowdiff.Dense(), on_gpu, allow_inexact_gpu=True)
    check_replica_arguments(lowdiff.Dense(), [torch.zeros(1)])
    with pytest.raises(ValueError, match="allow_inexact_gpu"):
        lowdiff.Replica(allow_inexact_gpu=1)
