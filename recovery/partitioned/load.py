"""recovery.partitioned.load: reading one full set of a partitioned directory (docs/format.md,
"Partitioned directories") at any world size, every rank alike.

For a set of n shares and W ranks, rank ``i mod W`` alone reads share i (its bytes of the shared
payload, every piece's checksum checked) and sends them to the others; each rank reads its own
per-rank part. The shared tensors that the caller already holds (``into``: the live model, an
optimizer with state) are read and received straight into them, the rest into one staging buffer.
The ranks agree on which shares failed (a set that fails is given up by every rank alike). Without
a process group (W = 1) the same code reads everything itself.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import fastio
from lowdiff.distributed import dtensors
from lowdiff.errors import CheckpointError, CorruptCheckpointError
from lowdiff.format import tree
from lowdiff.format.fullckpt import payload_tensor
from lowdiff.format.payloadread import apart, placeable, read_payload
from lowdiff.format.records import dtype_from_name
from lowdiff.format.schema import PAGE, PAYLOAD_OFFSET, FullIndex, FullState, TensorEntry
from lowdiff.format.sharefile import ShareBody, read_full_share_index, read_own
from recovery.partitioned.plan import LOCAL, FullSet, LocalFiles
from recovery.plan import warn


def _agree_problems(problems: dict, world: int) -> dict:
    """Every rank's {share: why} joined (a collective when ``world`` > 1)."""
    if world == 1:
        return problems
    gathered: list = [None] * world
    dist.all_gather_object(gathered, problems)
    out: dict = {}
    for part in gathered:
        for share, why in part.items():
            out.setdefault(share, why)
    return out


@dataclasses.dataclass
class _Loaded:
    index: object              # this rank's FullShareIndex (its own share, or share 0 for a new rank)
    state: FullState
    path: str


def _read_indexes(fset: FullSet, problems: dict, files: LocalFiles = LOCAL, reads: list | None = None,
                  world: int = 1) -> dict:
    """Every share's index, checked to be of one set (a share that is not: ``problems``). Where
    ranks hold only the files they read (``files.remote``), each reads the indexes of its
    ``reads`` and the ranks exchange them (a collective), so no rank fetches another's share for
    its index; the same problems then stop every rank."""
    indexes = {}
    remote = files.remote and world > 1
    for i in (reads if remote and reads is not None else range(fset.count)):
        path = fset.files[i]
        try:
            with fastio.Reader(files.ready(path)) as reader:
                indexes[i] = read_full_share_index(path, reader)
        except (CheckpointError, OSError, EOFError) as exc:
            problems[i] = f"{path} does not verify ({exc})"
    if remote:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (indexes, problems))
        for found, failed in gathered:
            indexes = {**found, **indexes}
            for share, why in failed.items():
                problems.setdefault(share, why)
    if problems:
        return indexes
    first = indexes[0]
    for i, index in indexes.items():
        if (index.step, index.session, index.run, index.count, index.layout) != \
                (fset.step, fset.session, first.run, fset.count, first.layout):
            problems[i] = f"{fset.files[i]} is not a share of the same set as {fset.files[0]}"
    # HSDP ("2-D meshes"): each chunk a share names another share for is that share's, by their
    # indexes (every rank has them all, so every rank finds the same). Else a rank would take, or a
    # resharding cut, the chunk from one that is not it.
    for i, index in indexes.items():
        for key, where in sorted(index.elsewhere.items()):
            holder = indexes.get(where["share"])
            lacking = dtensors.lacks_chunk(index, holder, key) if holder is not None else None
            if lacking and where["share"] not in problems:
                problems[where["share"]] = f"{fset.files[where['share']]} is named by share {i} ({fset.files[i]}) " \
                                           f"for chunks it does not hold: it has {lacking}"
    return indexes


def _read_own_part(path: str, index, problems: dict, share: int, files: LocalFiles = LOCAL):
    """This rank's own per-rank part (tensors and state skeleton), or None (then ``problems``)."""
    try:
        with fastio.Reader(files.ready(path)) as reader:
            return read_own(path, reader, index)
    except (CheckpointError, OSError, EOFError) as exc:
        problems[share] = f"{path} does not verify ({exc})"
        return None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (the same memory, no autograd)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _placement(layout: tuple, live: dict, world: int) -> dict:
    """{key: live tensor} of the shared tensors read straight into the caller's tensors: those
    ``payloadread.placeable`` and ``apart`` allow on every rank (the ranks exchange them piece by
    piece into the same places, so they agree on the set first)."""
    entries = [TensorEntry(e["offset"], e["nbytes"], key=e["key"], dtype=e["dtype"], shape=tuple(e["shape"]))
               for e in layout]
    wanted = apart({e.key: live[e.key] for e in entries if e.key in live and placeable(e, live[e.key])})
    if world > 1:
        mask = torch.tensor([e.key in wanted for e in entries], dtype=torch.int32)
        dist.all_reduce(mask, op=dist.ReduceOp.MIN)
        wanted = {e.key: wanted[e.key] for e, agreed in zip(entries, mask.tolist()) if agreed}
    return wanted


def _piece_target(piece, layout: dict, placed: dict) -> torch.Tensor:
    """Where ``piece``'s bytes go in its live tensor."""
    low = piece.offset - layout[piece.key]["offset"]
    return _byte_view(placed[piece.key])[low:low + piece.nbytes]


def _read_share_payload(path: str, index, layout: dict, placed: dict, staging) -> None:
    """Share ``index``'s bytes of the shared payload: the pieces of placed tensors into them, the
    rest into ``staging`` at their offsets in the shared payload; every piece's CRC-32C checked
    in the same pass (payloadread)."""
    entries = [TensorEntry(PAYLOAD_OFFSET + p.offset - index.start, p.nbytes, crc32c=p.crc32c, key=p.key,
                           dtype="uint8", shape=(p.nbytes,)) for p in index.pieces]
    into = {p.key: _piece_target(p, layout, placed) for p in index.pieces if p.key in placed}
    with fastio.Reader(path) as reader, ShareBody(path, reader, index) as body:   # (a striped share: its stripes)
        _, got = read_payload(path, body, index.end - index.start, entries, True, into, buffer=staging,
                              base=index.start)
    # Every rank receives these pieces in the live tensors: all must have been read there.
    assert got.keys() == into.keys(), sorted(set(into) - set(got))


def _exchange_bytes(indexes: dict, staging, layout: dict, placed: dict, count: int, world: int) -> None:
    """Send each share's bytes from the rank that read it to every other rank."""
    if world == 1:
        return
    whole = staging.tensor(indexes[0].shared_bytes) if indexes[0].shared_bytes else None
    for i in range(count):
        for target in _exchange_targets(indexes[i].pieces, whole, layout, placed):
            dist.broadcast(target, src=i % world)


def _exchange_targets(pieces, whole, layout: dict, placed: dict):
    """Where a share's bytes go, in the order every rank sends and receives them: a placed
    tensor's piece straight into that tensor, each run of other pieces into the staging buffer."""
    run = None
    for piece in pieces:
        if piece.key in placed:
            if run is not None:
                yield whole[run[0]:run[1]]
                run = None
            yield _piece_target(piece, layout, placed)
        else:
            run = (piece.offset if run is None else run[0], piece.offset + piece.nbytes)
    if run is not None:
        yield whole[run[0]:run[1]]


def _state_of(path: str, index, shared, own_part, chunk=None, borrowed=None) -> FullState:
    """The full state: shared tensors from ``shared(layout entry)``, own tensors from ``own_part``,
    the chunks another share holds (``index.elsewhere``, HSDP) from ``borrowed(key)``; a DTensor's
    chunk (sharded state) as ``chunk(key, local tensor, chunk entry)`` makes it."""
    layout = {e["key"]: e for e in index.layout}
    own, objects = own_part

    def lookup(key):
        if key in layout:
            return shared(layout[key])
        if key in index.elsewhere and borrowed is not None:
            local = borrowed(key)
            return chunk(key, local, index.dtensors[key]) if chunk is not None else local
        if key in own:
            entry, data = own[key]
            dtype = dtype_from_name(entry.dtype, path)
            local = torch.frombuffer(data, dtype=dtype).view(entry.shape) if entry.nbytes else \
                torch.empty(entry.shape, dtype=dtype)
            if key in index.dtensors and chunk is not None:
                return chunk(key, local, index.dtensors[key])
            return local
        raise CorruptCheckpointError(path, f"index has no tensor {key!r}")
    return FullState.from_tree(path, tree.join_tensors(tree.loads(objects, path), lookup))


def _outline(path: str):
    def shared(entry):
        return torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"], path), device="meta")
    return shared


def _from_staging(path: str, payload: torch.Tensor, placed: dict):
    def shared(entry):
        if entry["key"] in placed:
            return placed[entry["key"]]
        return payload_tensor(payload, entry["offset"], entry["nbytes"], dtype_from_name(entry["dtype"], path),
                              entry["shape"], entry["key"])
    return shared


def _give_up(fset: FullSet, problems: dict) -> None:
    for share, why in sorted(problems.items()):
        warn(f"lowdiff: share {share} of the full checkpoint of step {fset.step}: {why}; falling back to an older set")


def reads_of(fset: FullSet, rank: int, world: int, as_share: int | None = None) -> list:
    """The shares whose files this rank reads itself, its own first: its own (or the one whose
    per-rank state it takes) and share i for every i = rank mod ``world``."""
    own = as_share if as_share is not None else rank if rank < fset.count else 0
    return [own] + [i for i in range(rank, fset.count, world) if i != own]


def load_set(fset: FullSet, rank: int, world: int, check_full, into, as_share: int | None = None,
             files: LocalFiles = LOCAL) -> _Loaded | None:
    """The set's state on this rank, or None (every rank alike) when a share does not verify.
    ``as_share`` (one process, no process group: a sharded ``export``): share ``as_share``'s own
    state instead of rank 0's, its DTensor chunks as the plain tensors they were written as.

    Indexes and this rank's own part come first: with them the state's outline is checked
    (``check_full``) before a byte is read into the caller's tensors (``into()``, as
    ``fullckpt.live_targets``). The shared tensors those hold are then read and exchanged straight
    into them; the rest into one staging buffer. A share that fails its checksums after that
    leaves part of its bytes in those tensors: the older set that resume falls back to overwrites
    them, as a plain directory's does. ``files``: how the set's files are reached (they may arrive
    as they are asked for: recovery.partitioned.bucket)."""
    own = as_share if as_share is not None else rank if rank < fset.count else 0
    problems: dict = {}
    indexes = _read_indexes(fset, problems, files, reads_of(fset, rank, world, as_share), world)
    own_part = None if problems else _read_own_part(fset.files[own], indexes[own], problems, own, files)
    outline = None
    if own_part is not None:
        try:
            outline = _state_of(fset.files[own], indexes[own], _outline(fset.files[own]), own_part,
                                lambda key, local, entry: dtensors.outline(entry, local.dtype),
                                _outline_elsewhere(fset.files[own], indexes[own]))
        except CorruptCheckpointError as exc:
            problems[own] = str(exc)
    problems = _agree_problems(problems, world)
    if problems:
        _give_up(fset, problems)
        return None
    index = full_index(indexes[own])
    check_full(fset.files[own], index, outline)
    first = indexes[0]
    layout = {e["key"]: e for e in first.layout}
    live = into() if into is not None else {}
    placed = _placement(first.layout, live, world)
    staging = fastio.aligned_buffer(max(first.shared_bytes, PAGE))
    for i in range(rank, fset.count, world):
        try:
            _read_share_payload(files.ready(fset.files[i]), indexes[i], layout, placed, staging)
        except (CheckpointError, OSError, EOFError) as exc:
            problems[i] = f"{fset.files[i]} does not verify ({exc})"
    problems = _agree_problems(problems, world)
    if problems:
        _give_up(fset, problems)
        return None
    # Resharding (another world size, or no sharded model: export) cuts each chunk from the recorded
    # chunks that overlap it: read and check those now, so that a damaged one makes every rank fall
    # back to an older set instead of failing half-way through the rebuild.
    # So are the chunks of this rank's own share that another share holds (HSDP, "2-D meshes").
    chunks: dict = {}   # share -> {key: (chunk entry, tensor)}
    resharding = as_share is None and (world != fset.count or not dtensors.meshes_of(live.values()))
    if indexes[own].dtensors and (resharding or indexes[own].elsewhere):
        live_of = _live_lookup(indexes[own], live)
        lent = {e["share"] for e in indexes[own].elsewhere.values()}
        for i in range(fset.count):
            if not (resharding and any(_overlaps(entry, live_of(key)) for key, entry in _held(indexes[i]))) and \
                    i not in lent:
                continue   # none of its chunks is part of what this rank rebuilds: not read (not fetched)
            try:   # (that share holds what this one names it for: checked with the indexes)
                _read_chunks(fset, indexes, i, chunks, files)
            except (CheckpointError, OSError, EOFError) as exc:
                problems[i] = f"{fset.files[i]} does not verify ({exc})"
        problems = _agree_problems(problems, world)
        if problems:
            _give_up(fset, problems)
            return None
    _exchange_bytes(indexes, staging, layout, placed, fset.count, world)
    payload = staging.tensor(first.shared_bytes) if first.shared_bytes else torch.empty(0, dtype=torch.uint8)
    rebuild = _chunk_rebuilder(fset, rank, live, indexes, chunks, files) if as_share is None else \
        (lambda key, local, entry: local)   # the share's own chunks, as written: nothing to cut
    state = _state_of(fset.files[own], indexes[own], _from_staging(fset.files[own], payload, placed), own_part,
                      rebuild, lambda key: _lent(indexes[own], key, chunks))
    return _Loaded(indexes[own], state, fset.files[own])


def _held(index):
    """(key, chunk entry) of the DTensor chunks share ``index`` holds itself (not ``elsewhere``)."""
    return [(key, entry) for key, entry in index.dtensors.items() if key not in index.elsewhere]


def _outline_elsewhere(path: str, index):
    def borrowed(key):
        entry = index.dtensors[key]
        return torch.empty(entry["shape"], dtype=dtype_from_name(index.elsewhere[key]["dtype"], path), device="meta")
    return borrowed


def _lent(index, key: str, read: dict) -> torch.Tensor:
    """This share's chunk of ``key`` that another share holds (read and checked above)."""
    entry, tensor = read[index.elsewhere[key]["share"]][key]
    return tensor.view(entry["shape"])


def _chunk_rebuilder(fset: FullSet, rank: int, live: dict, indexes: dict, read: dict, files: LocalFiles = LOCAL):
    """How a DTensor chunk read back becomes the DTensor on the live mesh: this rank's own chunk at
    the world size and mesh it was written with; else (resharding) this rank's chunk on the live
    mesh, cut from the recorded chunks of every share that overlap it (docs/format.md, "Sharded
    state"), for optimizers that work element by element only."""
    meshes = dtensors.meshes_of(live.values())
    own = rank if rank < fset.count else 0
    live_of = _live_lookup(indexes[own], live)

    def rebuild(key, local, entry):
        target = live_of(key)
        if target is None and meshes:   # a sharded model without this tensor: its mesh must be the recorded one
            return dtensors.rebuild(fset.files[own], key, local, entry, meshes)
        if target is not None and rank < fset.count and dtensors.same_chunk(entry, target):
            return dtensors.rewrap(local, target)
        # Another world size or mesh, or no sharded model at all (export, an unsharded model): this
        # rank's new chunk, or the whole tensor, cut from every share's recorded chunk.
        dtensors.check_reshardable(fset.files[own], indexes[own].optimizer_class)
        pieces = [_recorded_chunk(fset, indexes, share, key, read, files) for share in range(fset.count)
                  if key not in indexes[share].elsewhere and _overlaps(indexes[share].dtensors.get(key), target)]
        whole = dtensors.assemble(target, local.dtype, pieces)
        return whole if target is None else dtensors.rewrap(whole, target)
    return rebuild


def _live_lookup(index, live: dict):
    """``live_of(key)``: the live DTensor a recorded tensor ``key`` is rebuilt into (an optimizer
    state's by its parameter's slot), or None (no DTensor: the whole tensor is rebuilt)."""
    slot_keys = {slot: f"/model/{key}" for key, slot in index.param_aliases.items()}

    def live_of(key: str):
        target = live.get(key)
        if target is None and key.startswith("/optimizer/state/"):
            slot = key.split("/")[3]
            target = live.get(slot_keys.get(int(slot), "")) if slot.isdigit() else None
        return target if dtensors.is_dtensor(target) else None
    return live_of


def _overlaps(entry: dict | None, target) -> bool:
    """Whether the recorded chunk ``entry`` holds part of what is rebuilt into ``target`` (its
    live chunk; None: the whole tensor). An unknown chunk (None) counts as overlapping: it is read,
    and its absence is then the error."""
    if entry is None or target is None:
        return True
    _, _, _, shape, offsets = dtensors.live_chunk(target)
    return all(max(lo, o) < min(lo + n, o + m)
               for lo, n, o, m in zip(offsets, shape, entry["offsets"], entry["shape"]))


def _read_chunks(fset: FullSet, indexes: dict, share: int, read: dict, files: LocalFiles = LOCAL) -> None:
    """Read share ``share``'s DTensor chunks into ``read[share]`` (once), checksums checked."""
    if share in read:
        return
    path, index = fset.files[share], indexes[share]
    with fastio.Reader(files.ready(path)) as reader:
        own, _ = read_own(path, reader, index)
    read[share] = {k: (index.dtensors[k], torch.frombuffer(data, dtype=dtype_from_name(e.dtype, path))
                       if e.nbytes else torch.empty(0, dtype=dtype_from_name(e.dtype, path)))
                   for k, (e, data) in own.items() if k in index.dtensors}


def _recorded_chunk(fset: FullSet, indexes: dict, share: int, key: str, read: dict,
                    files: LocalFiles = LOCAL) -> tuple:
    """(chunk entry, tensor) of ``key`` in share ``share``, its checksum checked."""
    _read_chunks(fset, indexes, share, read, files)
    if key not in read[share]:
        raise CorruptCheckpointError(fset.files[share], f"share {share} holds no chunk of {key!r}")
    return read[share][key]


def full_index(share) -> FullIndex:
    """The fields of a full checkpoint's index that compat checks and replay read."""
    return FullIndex(share.step, share.session, share.run, 0, (), share.objects, share.param_names,
                     share.param_aliases, share.optimizer_class, share.compressor)


