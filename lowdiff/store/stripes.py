"""Full checkpoints striped over several local devices: the device directories of a trainer, the
names of a checkpoint's stripes, their parallel write (one fastio engine, so one queue, per device)
and the removal of a retired checkpoint's stripes (docs/format.md, "Striped full checkpoints").

The checkpoint's own directory is device 0; ``stripe_dirs`` are the others. A payload is laid out
over the devices in units of STRIPE_UNIT_BYTES, round robin (RAID-0), one stripe file per device, and
every stripe is written and committed (temporary name,
``fdatasync``, rename, directory ``fsync``) before the checkpoint file that names them is: the
checkpoint exists only once every stripe is durable. Differential batches go to the devices in turn,
one whole file each (docs/format.md, "Differential batches on the drives"): ``batch_directory``.
"""
from __future__ import annotations

import itertools
import os
import re
import threading

import fastio
from lowdiff import faults
from lowdiff.errors import MissingDeviceError
from lowdiff.format.schema import PAGE, Stripe, stripe_pieces

STRIPE_RE = re.compile(r"^full-(\d{12})-([0-9a-f]{8})-s(\d{2})\.lds$")
# fastio.Writer's temporary name of a stripe (".NAME.tmp-PID-RAND").
STRIPE_TEMP_RE = re.compile(r"^\.(full-\d{12}-[0-9a-f]{8}-s\d{2}\.lds)\.tmp-(\d+)-[0-9a-f]+$")
# ... and of a differential batch written to another device (the checkpoint directory's own are
# lowdiff.store.inventory's to find).
BATCH_TEMP_RE = re.compile(r"^\.(diff-\d{12}-\d{12}-[0-9a-f]{8}\.ldd)\.tmp-(\d+)-[0-9a-f]+$")
MAX_DEVICES = 100   # two digits in a stripe's name
# The unit of the layout: payload bytes [i * U, (i + 1) * U) go to device i mod N. Small enough that
# a payload read in file order (32 MiB chunks, lowdiff.format.payloadread) keeps every device busy at
# once, large enough that each is one request of the size the devices like.
STRIPE_UNIT_BYTES = 1 << 20


def stripe_name(step: int, session: str, number: int) -> str:
    return f"full-{step:012d}-{session}-s{number:02d}.lds"


def stripe_unit(payload_bytes: int, devices: int) -> int:
    """The unit of a payload's layout: STRIPE_UNIT_BYTES, or for a payload smaller than a unit per
    device, its share per device in whole pages (so that a small checkpoint is spread too)."""
    share = -(-payload_bytes // devices)
    return min(STRIPE_UNIT_BYTES, max(PAGE, -(-share // PAGE) * PAGE))


def stripe_count(payload_bytes: int, devices: int, unit: int) -> int:
    """How many devices a payload is striped over: each holds at least one unit."""
    return min(devices, -(-payload_bytes // unit))


def check_stripe_dirs(directory: str, stripe_dirs) -> tuple[str, ...]:
    """The absolute device directories of ``stripe_dirs`` (besides ``directory``), refused when
    one repeats another or ``directory``: a stripe per device, each device once."""
    home = os.path.abspath(os.fspath(directory))
    dirs = tuple(os.path.abspath(os.fspath(d)) for d in stripe_dirs)
    seen = {os.path.realpath(home)}
    for d in dirs:
        if os.path.realpath(d) in seen:
            raise ValueError(f"stripe directory {d} is given twice (or is the checkpoint directory {home}): "
                             f"each device is given once")
        seen.add(os.path.realpath(d))
    if len(dirs) + 1 > MAX_DEVICES:
        raise ValueError(f"{len(dirs) + 1} devices: at most {MAX_DEVICES} are supported")
    return dirs


class StripeDevices:
    """The devices a trainer stripes full checkpoints over: ``directory`` (device 0) and
    ``stripe_dirs`` (absolute, existing). Owns one fastio engine per device; ``close()`` ends them."""

    def __init__(self, directory: str, stripe_dirs: tuple[str, ...]):
        self.directory = os.path.abspath(directory)
        self.stripe_dirs = tuple(stripe_dirs)
        config = fastio.FastioConfig.from_env()
        self._engines = [fastio.make_engine(config) for _ in range(len(stripe_dirs) + 1)]
        self._batches = itertools.count()   # batches this session placed (round robin)

    def batch_directory(self) -> str:
        """The directory the next differential batch goes to: the devices in turn, device 0 first.
        Round robin, not the least-loaded device: one writer writes batches one at a time, and every
        full checkpoint loads the devices alike (a stripe each), so none is busier when a batch is
        written; in turn, a chain's consecutive batches are on different devices (a replay reads
        them ahead in parallel) and each device holds an equal share of them."""
        dirs = (self.directory, *self.stripe_dirs)
        return dirs[next(self._batches) % len(dirs)]

    def write(self, step: int, session: str, payload: memoryview) -> tuple[int, tuple[Stripe, ...]]:
        """Write ``payload`` as stripes, one per device, in parallel; return (unit, stripes) once
        every one is durable under its name. If one fails, the stripes this call committed are
        removed (no manifest or checkpoint file names them yet) and the first error is raised."""
        unit = stripe_unit(len(payload), len(self._engines))
        count = stripe_count(len(payload), len(self._engines), unit)
        dirs = (None, *self.stripe_dirs)
        results: list = [None] * count
        errors: list = []
        pieces = stripe_pieces(unit, count, 0, len(payload))

        def write_one(number: int) -> None:
            try:
                name = stripe_name(step, session, number)
                path = os.path.join(dirs[number] or self.directory, name)
                mine = [(position, nbytes) for device, _, position, nbytes in pieces if device == number]
                crc, nbytes_all = 0, sum(n for _, n in mine)
                with fastio.Writer(path, size_hint=nbytes_all, engine=self._engines[number]) as writer:
                    for position, nbytes in mine:   # every unit is page-aligned: written without a copy
                        piece = payload[position:position + nbytes]
                        writer.write(piece)
                        crc = fastio.crc32c(piece, crc)   # while the device writes (the GIL is released)
                results[number] = Stripe(dirs[number], name, nbytes_all, crc)
                faults.point("stripe-write")
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=write_one, args=(number,), daemon=True, name=f"lowdiff-stripe-{number}")
                   for number in range(1, count)]
        for thread in threads:
            thread.start()
        write_one(0)   # device 0 on this thread
        for thread in threads:
            thread.join()
        if errors:
            remove_stripes(self.directory, [s for s in results if s is not None])
            raise errors[0]
        return unit, tuple(results)

    def dead_temps(self) -> list[str]:
        """Temporary stripe files on every device, and batch files on the other devices, whose
        writer process is gone."""
        out = []
        for directory in (self.directory, *self.stripe_dirs):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            other = directory != self.directory
            out += [os.path.join(directory, n) for n in names
                    if _dead_writer(STRIPE_TEMP_RE, n) or (other and _dead_writer(BATCH_TEMP_RE, n))]
        return out

    def close(self) -> None:
        """End the engines (after their queued writes). Idempotent."""
        engines, self._engines = self._engines, []
        for engine in engines:
            engine.close()


def check_batch_device(directory: str, batch) -> None:
    """Raise MissingDeviceError when ``batch`` (a manifest entry of ``directory``) is on another
    drive whose directory does not exist: never read as a missing or damaged file."""
    if batch.dir is not None and not os.path.isdir(batch.dir):
        raise MissingDeviceError(f"{os.path.join(batch.dir, batch.file)}: differential batch of steps {batch.first}.."
                                 f"{batch.last} listed in {directory} is in {batch.dir}, which does not exist (a "
                                 f"drive that is not mounted?); mount it and start again")


def check_devices(directory: str, manifest) -> None:
    """Raise MissingDeviceError naming the first device directory that a full checkpoint
    ``manifest`` lists has stripes in, or a batch it lists is in, and that does not exist (a drive
    not mounted): a trainer would otherwise create it empty, and its checkpoints would read as
    damaged (and be dropped from the manifest)."""
    for batch in manifest.batches:
        check_batch_device(directory, batch)
    for full in manifest.fulls:
        for number, stripe in enumerate(full.stripes):
            if stripe.dir is not None and not os.path.isdir(stripe.dir):
                raise MissingDeviceError(f"{os.path.join(directory, full.file)}: stripe {number} of its payload is "
                                         f"in {stripe.dir}, which does not exist (a drive that is not mounted?); "
                                         f"mount it and start again")


def stripe_path(directory: str, stripe: Stripe) -> str:
    """Where ``stripe`` of a checkpoint in ``directory`` is (its ``dir`` None: ``directory``)."""
    return os.path.join(stripe.dir if stripe.dir is not None else directory, stripe.file)


def remove_stripes(directory: str, stripes, fault: str | None = None) -> None:
    """Delete the ``stripes`` of a checkpoint of ``directory`` (retired, or never named by a
    committed file) whose files still have their size; a missing device directory or file is
    left as it is (a drive not mounted is no reason to delete anything else). ``fault``: the
    fault point (lowdiff.faults) reached after each deletion."""
    for stripe in stripes:
        path = stripe_path(directory, stripe)
        try:
            if os.stat(path).st_size == stripe.nbytes:
                os.unlink(path)
        except FileNotFoundError:
            continue
        if fault is not None:
            faults.point(fault)


def _dead_writer(pattern: re.Pattern, name: str) -> bool:
    m = pattern.match(name)
    if not m or int(m.group(2)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(2)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
