"""Full checkpoints striped over several local devices: the device directories of a trainer, the
names of a checkpoint's stripes, their parallel write (one fastio engine, so one queue, per device)
and the removal of a retired checkpoint's stripes (docs/format.md, "Striped full checkpoints").

The checkpoint's own directory is device 0; ``stripe_dirs`` are the others. A payload is cut into
one stripe per device, in whole pages, and every stripe is written and committed (temporary name,
``fdatasync``, rename, directory ``fsync``) before the checkpoint file that names them is: the
checkpoint exists only once every stripe is durable.
"""
from __future__ import annotations

import os
import re
import threading

import fastio
from lowdiff import faults
from lowdiff.errors import MissingDeviceError
from lowdiff.format.schema import PAGE, Stripe

STRIPE_RE = re.compile(r"^full-(\d{12})-([0-9a-f]{8})-s(\d{2})\.lds$")
# fastio.Writer's temporary name of a stripe (".NAME.tmp-PID-RAND").
STRIPE_TEMP_RE = re.compile(r"^\.(full-\d{12}-[0-9a-f]{8}-s\d{2}\.lds)\.tmp-(\d+)-[0-9a-f]+$")
MAX_DEVICES = 100   # two digits in a stripe's name


def stripe_name(step: int, session: str, number: int) -> str:
    return f"full-{step:012d}-{session}-s{number:02d}.lds"


def split(payload_bytes: int, count: int) -> list[tuple[int, int]]:
    """``[(start, nbytes)]``: ``payload_bytes`` (whole pages) cut into ``count`` stripes of about
    equal size in whole pages (fewer when the payload has fewer pages; none when it is empty)."""
    pages = payload_bytes // PAGE
    count = min(count, pages)
    out, start = [], 0
    for number in range(count):
        nbytes = (pages // count + (1 if number < pages % count else 0)) * PAGE
        out.append((start, nbytes))
        start += nbytes
    return out


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

    def write(self, step: int, session: str, payload: memoryview) -> tuple[Stripe, ...]:
        """Write ``payload`` as stripes, one per device, in parallel; return them once every one is
        durable under its name. If one fails, the stripes this call committed are removed (no
        manifest or checkpoint file names them yet) and the first error is raised."""
        parts = split(len(payload), len(self._engines))
        dirs = (None, *self.stripe_dirs)
        results: list = [None] * len(parts)
        errors: list = []

        def write_one(number: int, start: int, nbytes: int) -> None:
            try:
                piece = payload[start:start + nbytes]
                name = stripe_name(step, session, number)
                path = os.path.join(dirs[number] or self.directory, name)
                with fastio.Writer(path, size_hint=nbytes, engine=self._engines[number]) as writer:
                    writer.write(piece)
                    crc = fastio.crc32c(piece)   # while the device writes (the GIL is released)
                results[number] = Stripe(dirs[number], name, start, nbytes, crc)
                faults.point("stripe-write")
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=write_one, args=(number, start, nbytes), daemon=True,
                                    name=f"lowdiff-stripe-{number}")
                   for number, (start, nbytes) in enumerate(parts)]
        for thread in threads[1:]:
            thread.start()
        write_one(0, *parts[0])   # device 0 on this thread
        for thread in threads[1:]:
            thread.join()
        if errors:
            remove_stripes(self.directory, [s for s in results if s is not None])
            raise errors[0]
        return tuple(results)

    def dead_temps(self) -> list[str]:
        """Temporary stripe files on every device whose writer process is gone."""
        out = []
        for directory in (self.directory, *self.stripe_dirs):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            out += [os.path.join(directory, n) for n in names if _dead_writer(n)]
        return out

    def close(self) -> None:
        """End the engines (after their queued writes). Idempotent."""
        engines, self._engines = self._engines, []
        for engine in engines:
            engine.close()


def check_devices(directory: str, manifest) -> None:
    """Raise MissingDeviceError naming the first device directory that a full checkpoint
    ``manifest`` lists has stripes in and that does not exist (a drive not mounted): a trainer
    would otherwise create it empty, and its checkpoints would read as damaged."""
    for full in manifest.fulls:
        for number, stripe in enumerate(full.stripes):
            if stripe.dir is not None and not os.path.isdir(stripe.dir):
                raise MissingDeviceError(f"{os.path.join(directory, full.file)}: stripe {number} of its payload is "
                                         f"in {stripe.dir}, which does not exist (a drive that is not mounted?); "
                                         f"mount it and start again")


def stripe_path(directory: str, stripe: Stripe) -> str:
    """Where ``stripe`` of a checkpoint in ``directory`` is (its ``dir`` None: ``directory``)."""
    return os.path.join(stripe.dir if stripe.dir is not None else directory, stripe.file)


def remove_stripes(directory: str, stripes) -> None:
    """Delete the ``stripes`` of a checkpoint of ``directory`` (retired, or never named by a
    committed file) whose files still have their size; a missing device directory or file is
    left as it is (a drive not mounted is no reason to delete anything else)."""
    for stripe in stripes:
        path = stripe_path(directory, stripe)
        try:
            if os.stat(path).st_size == stripe.nbytes:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _dead_writer(name: str) -> bool:
    m = STRIPE_TEMP_RE.match(name)
    if not m or int(m.group(2)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(2)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
