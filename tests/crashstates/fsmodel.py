"""The file-system states a power loss can leave, built from a trace (tracer.py). Not a test module.

The persistence model (what a crash may keep of what was not yet made durable), as ALICE and
CrashMonkey model a journaling file system such as ext4 or xfs:

* file data (``write``, ``ftruncate``, ``fallocate``) is durable once an ``fsync``/``fdatasync`` of
  that file returns; data not yet synced may persist, not persist, or persist torn: any subset of
  its 512-byte sectors, in any order relative to other files' data;
* directory operations (create, ``rename``, ``unlink``, ``mkdir``, ``rmdir``) go through the
  journal in the order they were issued, so a crash keeps a prefix of them; an operation is durable
  once an ``fsync`` of a directory it changed returns (and with it every operation before it).
  An fsync of a file is not counted as making directory operations durable (ext4 does, POSIX does
  not promise it): the states built here are a superset of what ext4 can leave.

``model="per-directory"`` weakens the second rule for file systems without one ordered journal:
each directory's operations keep their order, but directories are independent (a crash may keep
a later operation in one directory and lose an earlier one in another); an operation inside a
directory whose creation was lost is lost with it. Only sampled states are built in that model.

A crash point is the moment just before a barrier (an fsync or fdatasync), or the end of the trace:
every op before it has been issued. ``states(program, point, rng, samples)`` yields the crash states of one
point: each prefix of the directory operations not yet durable with none or all of the pending data,
then ``samples`` random ones (a random prefix; each pending write absent, whole or torn at sector
granularity). States are keyed by their content, so identical states are checked once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

SECTOR_BYTES = 512
META = ("create", "rename", "unlink", "mkdir", "rmdir")
DATA = ("write", "truncate", "extend")


@dataclasses.dataclass
class Program:
    """A trace resolved to inodes: ``ops[i]`` is ("create", path, ino), ("rename", src, dst),
    ("unlink", path), ("mkdir", path), ("rmdir", path), ("write", ino, offset, bytes),
    ("truncate", ino, size), ("extend", ino, size), ("fsync_file", ino), ("fsync_dir", path) or
    ("durable", pid, step)."""
    ops: list
    pids: list

    def barriers(self) -> list[int]:
        """The crash points: before each barrier, and the end."""
        return [i for i, op in enumerate(self.ops) if op[0] in ("fsync_file", "fsync_dir")] + [len(self.ops)]

    def required_step(self, point: int) -> int:
        """The step every process had reported durable before ``point`` (the lowest of them: a
        partitioned set is complete when every rank's share is); -1 when none reported one."""
        best = {pid: -1 for pid in self.pids}
        for op in self.ops[:point]:
            if op[0] == "durable":
                best[op[1]] = max(best[op[1]], op[2])
        return min(best.values()) if best else -1


def parent(path: str) -> str:
    return os.path.dirname(path)


def resolve(traces: list[list]) -> Program:
    """One program from the traces of one or more processes (merged by the monotonic clock),
    with every open file resolved to the inode it names at that moment."""
    raw = sorted((op for trace in traces for op in trace), key=lambda op: op[0])
    names: dict = {}          # path -> inode, as the live process saw them
    handles: dict = {}        # handle -> ("file", ino) | ("dir", path)
    dirs = {""}
    inodes = 0
    ops: list = []
    for _, pid, kind, *args in raw:
        if kind == "open":
            handle, path, created, truncated = args
            if path in dirs:
                handles[handle] = ("dir", path)
                continue
            if path not in names:
                if not created:
                    raise ValueError(f"trace opens {path!r}, which it never created")
                inodes += 1
                names[path] = inodes
                ops.append(("create", path, inodes))
            handles[handle] = ("file", names[path])
            if truncated:
                ops.append(("truncate", names[path], 0))
        elif kind in ("write", "truncate", "extend"):
            what, ino = handles[args[0]]
            ops.append((kind, ino, *args[1:]))
        elif kind == "sync":
            what, target = handles[args[0]]
            ops.append(("fsync_file" if what == "file" else "fsync_dir", target))
        elif kind == "rename":
            src, dst = args
            names[dst] = names.pop(src)
            ops.append(("rename", src, dst))
        elif kind == "unlink":
            names.pop(args[0])
            ops.append(("unlink", args[0]))
        elif kind == "mkdir":
            dirs.add(args[0])
            ops.append(("mkdir", args[0]))
        elif kind == "rmdir":
            dirs.discard(args[0])
            ops.append(("rmdir", args[0]))
        elif kind == "durable":
            ops.append(("durable", pid, args[0]))
        else:
            raise ValueError(f"unknown op {kind!r} in the trace")
    return Program(ops, sorted({op[1] for op in raw}))


def _changed_dirs(op) -> tuple:
    if op[0] == "rename":
        return parent(op[1]), parent(op[2])
    return (parent(op[1]),)


@dataclasses.dataclass(frozen=True)
class Durability:
    """What is durable at one crash point: the data ops (indices) and how many directory ops."""
    point: int
    durable_data: frozenset
    pending_data: tuple
    durable_meta: int
    total_meta: int
    by_dir: dict = dataclasses.field(default_factory=dict)   # directory -> (durable, [meta positions])


def durability(program: Program, point: int) -> Durability:
    ops = program.ops[:point]
    synced_after: dict = {}   # inode -> index of its last fsync before the point
    dir_synced: dict = {}     # directory -> index of its last fsync before the point
    for i, op in enumerate(ops):
        if op[0] == "fsync_file":
            synced_after[op[1]] = i
        elif op[0] == "fsync_dir":
            dir_synced[op[1]] = i
    durable, pending, meta_count, durable_meta = set(), [], 0, 0
    by_dir: dict = {}
    for i, op in enumerate(ops):
        if op[0] in DATA:
            (durable.add(i) if synced_after.get(op[1], -1) > i else pending.append(i))
        elif op[0] in META:
            own = by_dir.setdefault(_changed_dirs(op)[-1], [0, []])
            own[1].append(meta_count)
            meta_count += 1
            if any(dir_synced.get(d, -1) > i for d in _changed_dirs(op)):
                durable_meta = meta_count
                own[0] = len(own[1])
    return Durability(point, frozenset(durable), tuple(pending), durable_meta, meta_count,
                      {d: (n, positions) for d, (n, positions) in by_dir.items()})


@dataclasses.dataclass
class State:
    """A file system: files by path (bytes) and directories; ``how`` says how it was chosen."""
    files: dict
    dirs: set
    how: str

    def key(self) -> str:
        h = hashlib.sha256()
        for d in sorted(self.dirs):
            h.update(b"D" + d.encode() + b"\0")
        for path in sorted(self.files):
            h.update(b"F" + path.encode() + b"\0" + hashlib.sha256(self.files[path]).digest())
        return h.hexdigest()


def build(program: Program, d: Durability, meta_prefix, chosen: dict, how: str) -> State:
    """The state with the first ``meta_prefix`` directory ops (or those whose positions are in
    the set ``meta_prefix``), the durable data ops and the pending ones in ``chosen`` (index ->
    None for all of it, or a set of sector numbers)."""
    kept = range(meta_prefix) if isinstance(meta_prefix, int) else meta_prefix
    data: dict = {}
    names: dict = {}
    dirs = {""}
    meta = 0
    for i, op in enumerate(program.ops[:d.point]):
        kind = op[0]
        if kind in META:
            meta += 1
            if meta - 1 not in kept or parent(op[-1] if kind != "create" else op[1]) not in dirs:
                continue
            if kind == "rename" and op[1] not in names:
                continue
            if kind == "create":
                names[op[1]] = op[2]
                data.setdefault(op[2], bytearray())
            elif kind == "rename":
                names[op[2]] = names.pop(op[1])
            elif kind == "unlink":
                names.pop(op[1], None)
            elif kind == "mkdir":
                dirs.add(op[1])
            else:
                dirs.discard(op[1])
        elif kind in DATA:
            if i not in d.durable_data and i not in chosen:
                continue
            buf = data.setdefault(op[1], bytearray())
            if kind == "write":
                _write(buf, op[2], op[3], chosen.get(i))
            elif kind == "truncate":
                del buf[op[2]:]
                buf.extend(bytes(op[2] - len(buf)))
            else:
                buf.extend(bytes(max(0, op[2] - len(buf))))
    return State({path: bytes(data[ino]) for path, ino in names.items()}, dirs, how)


def _write(buf: bytearray, offset: int, payload: bytes, sectors) -> None:
    if sectors is None:
        pieces = [(offset, payload)]
    else:
        pieces = []
        for s in sorted(sectors):
            lo, hi = max(offset, s * SECTOR_BYTES), min(offset + len(payload), (s + 1) * SECTOR_BYTES)
            pieces.append((lo, payload[lo - offset:hi - offset]))
    for at, piece in pieces:
        if len(buf) < at:
            buf.extend(bytes(at - len(buf)))
        buf[at:at + len(piece)] = piece


def sectors_of(op) -> range:
    return range(op[2] // SECTOR_BYTES, -(-(op[2] + len(op[3])) // SECTOR_BYTES))


def states(program: Program, point: int, rng, samples: int, model: str = "journal"):
    """The crash states of one crash point (see the module docstring), unique by content."""
    d = durability(program, point)
    if model == "per-directory":
        yield from _per_directory(program, d, rng, samples)
        return
    seen: set = set()
    everything = {i: None for i in d.pending_data}

    def fresh(state):
        key = state.key()
        if key not in seen:
            seen.add(key)
            return state
        return None

    for prefix in range(d.durable_meta, d.total_meta + 1):
        for label, chosen in (("no pending data", {}), ("all pending data", everything)):
            state = fresh(build(program, d, prefix, chosen, f"{prefix}/{d.total_meta} dir ops, {label}"))
            if state is not None:
                yield state
    for n in range(samples):
        prefix = int(rng.integers(d.durable_meta, d.total_meta + 1))
        chosen, torn = {}, 0
        for i in d.pending_data:
            roll = rng.random()
            if roll < 1 / 3:
                continue
            op = program.ops[i]
            if roll < 2 / 3 or op[0] != "write":
                chosen[i] = None
            else:
                chosen[i] = {s for s in sectors_of(op) if rng.random() < 0.5}
                torn += 1
        state = fresh(build(program, d, prefix, chosen,
                            f"sample {n}: {prefix}/{d.total_meta} dir ops, {len(chosen)}/{len(d.pending_data)} "
                            f"pending writes ({torn} torn)"))
        if state is not None:
            yield state


def _per_directory(program: Program, d: Durability, rng, samples: int):
    seen: set = set()
    for n in range(samples):
        kept: set = set()
        for durable, positions in d.by_dir.values():
            kept.update(positions[:int(rng.integers(durable, len(positions) + 1))])
        chosen = {i: None for i in d.pending_data if rng.random() < 0.5}
        state = build(program, d, kept, chosen, f"per-directory sample {n}: {len(kept)}/{d.total_meta} dir ops, "
                                                f"{len(chosen)}/{len(d.pending_data)} pending writes")
        if state.key() not in seen:
            seen.add(state.key())
            yield state


def materialize(state: State, root: str) -> None:
    """Make ``root`` hold exactly ``state`` (what a machine would find after the power came back)."""
    if os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root)
    for d in sorted(state.dirs):
        if d:
            os.makedirs(os.path.join(root, d), exist_ok=True)
    for path, data in state.files.items():
        os.makedirs(os.path.join(root, parent(path)), exist_ok=True)
        with open(os.path.join(root, path), "wb") as f:
            f.write(data)


def snapshot(root: str) -> State:
    """The state a directory really holds (to check a trace's completeness against)."""
    files, dirs = {}, {""}
    for top, _subdirs, names in os.walk(root):
        rel = os.path.relpath(top, root)
        rel = "" if rel == "." else rel
        dirs.add(rel)
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                files[os.path.join(rel, name)] = f.read()
    return State(files, dirs, "on disk")
