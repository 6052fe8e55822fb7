"""A striped full checkpoint (or full-checkpoint share) drained to the shared tier as one unstriped file
(docs/format.md, "Storage tiers" and "Striped full checkpoints"): the shared tier holds no stripe
and resumes alone, on any machine, without the local drives.

For an object store (lowdiff.tiers.bucket uploads local files), the copy is first made in a
scratch directory of the local tier, ``.upload-PID/``, uploaded, then removed; a scratch directory
of a process that is gone is removed by the next trainer of the tier (``remove_dead_scratch``).

The copy is the file a run without ``stripe_dirs`` would have written: the preamble padded to a
page, the payload (gathered from every stripe, each stripe's CRC-32C checked on the way), the
objects section, the index without ``stripes``/``stripe_bytes`` (its tensor entries unchanged:
their offsets were already those of an unstriped file), the trailer. It is committed with the same
protocol and read-back check as any drained file.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time

import numpy as np

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import container
from lowdiff.format.fullckpt import read_full_index
from lowdiff.format.payloadread import StripedPayload
from lowdiff.format.schema import PAGE, PAYLOAD_OFFSET, FullIndex
from lowdiff.format.sharefile import FullShareIndex, read_full_share_index

_CHUNK_BYTES = 8 << 20
SCRATCH_RE = re.compile(r"^\.upload-(\d+)$")   # (docs/format.md, "What may be deleted")


def unstriped_index(index, objects_offset: int):
    """``index`` of a striped checkpoint (FullIndex) or full-checkpoint share (FullShareIndex) as
    the index of the same file written unstriped, its objects section at ``objects_offset``."""
    return dataclasses.replace(index, objects=dataclasses.replace(index.objects, offset=objects_offset),
                               stripes=(), stripe_bytes=0)


def _striped_index(source: str) -> tuple[int, FullIndex | FullShareIndex, int]:
    """(container kind, index, bytes at PAYLOAD_OFFSET of the unstriped file) of ``source``: a
    striped full checkpoint, or a striped share (its body: docs/format.md, "More drives than ranks")."""
    if container.file_kind(source) == container.KIND_FULL_SHARE:
        with fastio.Reader(source) as reader:
            share = read_full_share_index(source, reader)
        return container.KIND_FULL_SHARE, share, share.body_bytes
    index: FullIndex = read_full_index(source)
    return container.KIND_FULL, index, index.payload_bytes


def copy_unstriped(source: str, target: str, check_copy, engine=None, verify: bool = True,
                   timings: dict | None = None) -> int:
    """Write the striped full checkpoint ``source`` (its stripes where its index says) to ``target``
    as one unstriped file, committed (temporary name, fdatasync, read-back check when ``verify``,
    rename, directory fsync) like lowdiff.tiers.drainer.copy_file, whose read-back ``check_copy``
    is passed in; return its size. A stripe or objects section that fails its checksum raises
    CorruptCheckpointError naming it, and nothing appears at ``target``."""
    started = time.perf_counter()
    kind, index, payload_bytes = _striped_index(source)
    with fastio.Reader(source) as reader:
        objects = bytes(reader.read(index.objects.offset, index.objects.nbytes))
    if index.objects.crc32c is not None and fastio.crc32c(objects) != index.objects.crc32c:
        raise CorruptCheckpointError(source, f"objects section at offset {index.objects.offset} fails its checksum")
    # One reused buffer one byte past a page boundary: fastio.Writer copies misaligned memory into its
    # staging ring at each write, so the buffer may be refilled (see copy_file).
    raw = np.empty(_CHUNK_BYTES + 2 * fastio.ALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % fastio.ALIGN_BYTES + 1
    buffer = raw[start:start + _CHUNK_BYTES]
    crc = 0
    verify_s = 0.0

    def read_back(written: str) -> None:
        nonlocal verify_s
        began = time.perf_counter()
        check_copy(written, target, writer.size, crc, engine)
        verify_s = time.perf_counter() - began

    with StripedPayload(source, index.stripes, index.stripe_bytes, check_stripes=True) as payload, \
            fastio.Writer(target, size_hint=PAYLOAD_OFFSET + payload_bytes + len(objects) + 8192,
                          engine=engine) as writer:
        head = container.preamble_bytes(kind).ljust(PAGE, b"\0")
        crc = fastio.crc32c(head)
        writer.write(head)
        for offset in range(0, payload_bytes, _CHUNK_BYTES):
            n = min(_CHUNK_BYTES, payload_bytes - offset)
            payload.submit_read_into(PAYLOAD_OFFSET + offset, buffer[:n])()
            crc = fastio.crc32c(buffer[:n], crc)
            writer.write(buffer[:n])
        payload.check()   # every stripe's CRC-32C: a damaged local stripe is not drained
        objects_offset = writer.write(objects)
        body = container.encode_index(unstriped_index(index, objects_offset).to_json())
        index_offset = writer.write(body)
        tail = container.trailer_bytes(index_offset, body, kind)
        writer.write(tail)
        crc = fastio.crc32c(tail, fastio.crc32c(body, fastio.crc32c(objects, crc)))
        faults.point("drain-write")
        writer.commit(check=read_back if verify else None)
    if timings is not None:
        timings["copy_s"] = timings.get("copy_s", 0.0) + time.perf_counter() - started - verify_s
        timings["verify_s"] = timings.get("verify_s", 0.0) + verify_s
    return writer.size



def scratch_directory(directory: str) -> str:
    """This process's empty scratch directory ``directory/.upload-PID`` (what an earlier use left
    is removed first)."""
    path = os.path.join(directory, f".upload-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path)
    return path


def remove_dead_scratch(directory: str) -> None:
    """Remove the ``.upload-PID`` scratch directories of ``directory`` whose process is gone (an
    unstriped copy a killed drainer was uploading: never listed anywhere, never the only copy)."""
    for name in os.listdir(directory):
        m = SCRATCH_RE.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except PermissionError:
            pass
