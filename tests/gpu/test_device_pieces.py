"""The pieces of the GPU data path that need no GPU, on the CPU: how a full checkpoint is cut into
chunks, the bound and the ordering of the pinned ring (persist.pinned), and the ordering of a
record's device-to-host copies (capture.devicecopy). The stream and event operations are replaced
by fakes that run a copy either at once or only when its event is waited for, so a ring that reads
a slot before waiting, or reuses a slot before draining it, produces wrong bytes; end to end, those
bytes are a real run's checkpoints, resumed and compared with an uninterrupted run."""
from __future__ import annotations

import threading

import pytest
import torch

import lowdiff
import recovery
from lowdiff.capture.devicecopy import CopyEngine, DeviceCopy
from lowdiff.format.records import Compressed
from lowdiff.persist.pinned import PinnedStaging, landing_ends, plan_chunks


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
        # Waiting for an event is safe from several threads at once on a real device (the persist
        # thread writing landed pieces, the training thread in release()); so must running the
        # queue be here, or two threads could each copy one entry and count it twice.
        self.running = threading.Lock()

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
        # Read when the copy runs, as a stream would: a source changed before then is an error.
        self.queue.append((dst, src, src._version))
        self.log.append(("copy", len(self.queue)))
        if self.eager:
            self.run(len(self.queue))

    def copy_all_async(self, destinations, sources):
        for dst, src in zip(destinations, sources):
            self.copy_async(dst, src)

    def record_done(self, device):
        self.log.append(("record", len(self.queue)))
        return _Event(self, len(self.queue))

    def run(self, upto):
        with self.running:
            while self.done < upto:
                dst, src, version = self.queue[self.done]
                assert src._version == version, "a source was modified before its copy to the host landed"
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


class RegisteringRing(FakeRing):
    """A ring whose host memory can be page-locked (``register``), as CUDA's can; ``grant``
    False stands for a registration the driver refuses (a memory-lock limit)."""

    def __init__(self, eager: bool, grant: bool = True):
        super().__init__(eager)
        self.grant = grant
        self.registered: dict = {}
        self.calls: list = []

    def register(self, address, nbytes):
        self.calls.append(("register", address, nbytes))
        assert address not in self.registered, "registered twice without unregistering"
        if self.grant:
            self.registered[address] = nbytes
        return self.grant

    def unregister(self, address):
        self.calls.append(("unregister", address))
        del self.registered[address]


@pytest.mark.parametrize("eager", [True, False])
def test_registered_staging_is_copied_into_directly_and_registered_once(eager):
    gen = torch.Generator().manual_seed(5)
    sources = [torch.randn(n, generator=gen) for n in (1000, 3, 0, 4096)]
    staging = torch.zeros(sum(s.numel() for s in sources), dtype=torch.float32)
    destinations = list(torch.split(staging, [s.numel() for s in sources]))
    ring = RegisteringRing(eager)
    pinned = PinnedStaging(chunk_bytes=64, slots=2, ring=ring)
    where = (staging.data_ptr(), staging.numel() * 4)
    for round_ in range(2):
        sources = [s + round_ for s in sources]
        pinned.mark(sources)
        landing = pinned.copy(destinations, sources, where)
        landing.wait_all()
        for d, s in zip(destinations, sources):   # every copy landed once its landing was waited for
            assert torch.equal(d, s)
    assert ring.calls == [("register", *where)]   # once: the buffer is reused
    assert ring.slots_allocated == 0 and pinned.chunks_copied == 0 and pinned.direct_copies == 2
    pinned.forget(where[0])
    assert ring.registered == {} and ring.calls[-1] == ("unregister", where[0])


def test_staging_that_cannot_be_registered_goes_through_the_ring():
    sources = [torch.arange(700, dtype=torch.float32)]
    destinations = [torch.zeros(700)]
    ring = RegisteringRing(eager=False, grant=False)
    pinned = PinnedStaging(chunk_bytes=1000, slots=2, ring=ring)
    for _ in range(2):
        pinned.mark(sources)
        pinned.copy(destinations, sources, (destinations[0].data_ptr(), 2800))
        assert torch.equal(destinations[0], sources[0])
    assert [c[0] for c in ring.calls] == ["register"]   # refused once, not asked again
    assert pinned.direct_copies == 0 and pinned.chunks_copied == 6 and ring.slots_allocated == 2


def test_landing_ends_are_below_every_later_chunk_and_never_decrease():
    # In staging order (a full checkpoint's layout): each chunk's end is where the next begins.
    assert landing_ends([0, 100, 250], [90, 240, 300]) == [100, 250, 300]
    # A later chunk writing below an earlier one's end holds that boundary back.
    assert landing_ends([0, 500, 40], [100, 600, 60]) == [40, 40, 600]
    assert landing_ends([7], [9]) == [9] and landing_ends([], []) == []


def test_registered_copies_land_chunk_by_chunk_and_each_boundary_is_final():
    gen = torch.Generator().manual_seed(11)
    sources = [torch.randn(n, generator=gen) for n in (300, 2, 700, 0, 64)]
    staging = torch.zeros(sum(s.numel() for s in sources) + 40, dtype=torch.float32)
    destinations, at = [], 0
    for s in sources:                            # gaps between tensors, as the file's layout has
        destinations.append(staging[at:at + s.numel()])
        at += s.numel() + 10
    ring = RegisteringRing(eager=False)
    pinned = PinnedStaging(slots=2, ring=ring, landing_bytes=1000)
    pinned.mark(sources)
    landing = pinned.copy(destinations, sources, (staging.data_ptr(), staging.numel() * 4))
    assert landing is not None and not staging.any()     # enqueued, nothing landed yet
    final = staging.clone()
    for d, s in zip(destinations, sources):
        final[d.data_ptr() // 4 - staging.data_ptr() // 4:][:s.numel()] = s
    seen = []
    for boundary in landing.boundaries():
        below = boundary // 4
        assert torch.equal(staging[:below], final[:below]), f"bytes below {boundary} not landed"
        seen.append(boundary)
    assert seen == sorted(seen) and len(seen) == len(plan_chunks([s.numel() * 4 for s in sources], 1000))
    landing.wait_all()
    assert torch.equal(staging, final) and pinned.direct_copies == 1


def test_a_full_checkpoint_is_written_as_its_device_copies_land(tmp_path, monkeypatch):
    """Each piece of the payload goes to the file only after the events of the copies below its end
    have been waited for (a fake device that copies only then would leave wrong bytes otherwise),
    in more than one piece, and the file loads back as the state."""
    import fastio
    from lowdiff.format.fullckpt import Snapshot, load_full
    from lowdiff.format.schema import PAYLOAD_OFFSET, TrainedWith
    gen = torch.Generator().manual_seed(2)
    weights = {f"w{i}": torch.randn(n, generator=gen) for i, n in enumerate((3000, 5, 2500, 1100))}
    state = {"model": weights, "optimizer": {"state": {}, "param_groups": []}, "scheduler": None, "extra": {},
             "rng": {}, "residuals": {}, "grad_scaler": None}
    ring = RegisteringRing(eager=False)
    snapshot = Snapshot()
    snapshot.device_copy = PinnedStaging(slots=2, ring=ring, landing_bytes=4096)
    snapshot.stage(3, state, TrainedWith(tuple(weights), {k: i for i, k in enumerate(weights)},
                                         "torch.optim.sgd.SGD", "Dense()"))
    snapshot.device_copy.mark(snapshot.staged_tensors())
    snapshot.copy(on_training_thread=False)
    writes = []
    real_write = fastio.Writer.write

    def logged(writer, obj, **kw):
        writes.append((writer.size, len(ring.log)))   # where in the file, after how many fake-device events
        return real_write(writer, obj, **kw)
    monkeypatch.setattr(fastio.Writer, "write", logged)
    path = str(tmp_path / "full.ldf")
    assert snapshot.persist(path, "session", run="run")
    payload_end = PAYLOAD_OFFSET + snapshot.payload_bytes
    syncs = [i for i, entry in enumerate(ring.log) if entry[0] == "sync"]
    pieces = [log for offset, log in writes if PAYLOAD_OFFSET <= offset < payload_end]
    assert len(pieces) >= 3, writes                     # written piece by piece, not once at the end
    assert pieces == sorted(set(pieces)), writes        # a wait between every two pieces
    assert writes[0][1] <= syncs[0] < pieces[0]         # the preamble before any wait, each piece after one
    _, loaded = load_full(path)
    for key, tensor in weights.items():
        assert torch.equal(loaded.model[key], tensor)


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


def test_unsorted_sparse_gradients_are_sorted_on_the_device_into_the_same_record_bytes():
    from lowdiff.format.records import StepRecord, encode_record
    gen = torch.Generator().manual_seed(3)
    grads = []
    for numel, dtype in [(1000, torch.float32), (64, torch.bfloat16), (5000, torch.float32), (7, torch.float32)]:
        count = max(1, numel // 10)
        indices = torch.randperm(numel, generator=gen)[:count]   # unsorted, as TopK hands them over
        grads.append(Compressed("sparse", numel, torch.randn(count, generator=gen).to(dtype), indices, sorted=False))
    grads.insert(2, Compressed("dense", 3, torch.randn(3, generator=gen)))
    grads.insert(1, Compressed("none", 4, None))
    out, ready = DeviceCopy(torch.device("cpu"), FakeEngine()).to_host(grads)
    ready()
    for before, after in zip(grads, out):
        if before.kind != "sparse":
            continue
        assert after.sorted and after.indices.dtype == torch.int32
        assert torch.equal(after.indices, before.indices.sort().values.to(torch.int32))
        assert torch.equal(after.values, before.values[before.indices.argsort()])
    # Each dtype's host copy holds its gradients back to back in parameter order: the encoder
    # writes them from there without joining them again.
    floats = [g.values for g in out if g.values is not None and g.values.dtype == torch.float32]
    assert all(b.data_ptr() == a.data_ptr() + a.numel() * 4 for a, b in zip(floats, floats[1:]))
    # What reaches the disk is what the writer's own sort would have written.
    original = encode_record(StepRecord(7, False, grads, {"lr": 0.1}))
    on_device = encode_record(StepRecord(7, False, out, {"lr": 0.1}))
    assert b"".join(map(bytes, original)) == b"".join(map(bytes, on_device))


# --------------------------------------------------------------------------- end to end, real files
def _train(directory, steps, fake, resume_at=None, ring=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, str(directory),
                       compressor=lowdiff.TopK(ratio=0.3, min_numel=64), full_every=4, batch_steps=3)
    if fake:
        # The GPU path's orderings with fake streams: records and full checkpoints land late.
        opt._capture._device_copy = DeviceCopy(torch.device("cpu"), FakeEngine())
        opt._fulls._pinned = PinnedStaging(chunk_bytes=999, slots=2, ring=ring or FakeRing(eager=False),
                                           landing_bytes=999)
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


@pytest.mark.parametrize("registered", [False, True])
def test_run_through_fake_device_copies_resumes_exactly(tmp_path, registered):
    ref_model, ref_opt = _train(tmp_path / "ref", 14, fake=False)
    ring = RegisteringRing(eager=False) if registered else None
    _, first = _train(tmp_path / "run", 9, fake=True, ring=ring)
    if registered:   # the staging buffer was page-locked, copied into directly, unlocked at close
        assert first._fulls._pinned.direct_copies >= 1 and ring.registered == {}
        assert [c[0] for c in ring.calls] == ["register", "unregister"]
    # Resume from the last full checkpoint (8) and its record (9), written through the fakes.
    model, opt = _train(tmp_path / "run", 14, fake=True, resume_at=9, ring=ring)
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
