"""Helpers for test_fault_injection.py (not a test module): real trainer processes run side by side,
the inventory of a checkpoint directory (which files verify, which the manifest retires), in-process
resumes, and damage done to files.

Nothing here mocks lowdiff: trainers are ``python -m lowdiff.cli.demo`` processes, files are real files,
and "verifies" is decided from the bytes on disk (docs/format.md), not from what lowdiff believes.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import struct
import subprocess
import sys
import traceback
import typing
import zlib

import torch

import fastio
import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.cli.demo import build, compressor_from, state_digest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "distributed"))
import forkserver  # noqa: E402

TIMEOUT_S = 300          # only against hangs; nothing is timed
MANIFEST = "MANIFEST.json"
FULL_NAME = re.compile(r"^full-(\d{12})-([0-9a-f]{8})\.ldf$")
DIFF_NAME = re.compile(r"^diff-(\d{12})-(\d{12})-([0-9a-f]{8})\.ldd$")
DIGEST_LINE = re.compile(r"^(\d+) ([0-9a-f]{64})$")
TRAILER = struct.Struct("<QQIHH8s")   # index offset, index length, index crc32, version, kind, magic
PREAMBLE_SIZE = 16
RECORD_HEADER = struct.Struct("<4sHHQIQI")  # magic, version, flags, step, packed len, raw len, crc32
RECORD_HEADER_SIZE = RECORD_HEADER.size


def env(fault: str | None = None) -> dict:
    out = {k: v for k, v in os.environ.items() if k != "LOWDIFF_FAULT"}
    out["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    if fault:
        out["LOWDIFF_FAULT"] = fault
    return out


def read_digests(path) -> dict:
    """{step: digest} of a digests file; a line torn by a kill is ignored."""
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                m = DIGEST_LINE.match(line.strip())
                if m:
                    out[int(m.group(1))] = m.group(2)
    return out


# ------------------------------------------------------------------ trainer processes
@dataclasses.dataclass
class Result:
    """A finished trainer process."""

    name: str
    returncode: int
    lines: list
    stderr: str
    digests: dict

    def final_digest(self, step: int) -> str | None:
        """The digest of the state at ``step``: trained to by this process, or resumed at it (a run
        that resumes at its last step trains nothing, e.g. when the crashed run's fault never came)."""
        if step in self.digests:
            return self.digests[step]
        resumed = self.resumed
        return resumed[1] if resumed is not None and resumed[0] == step else None

    @property
    def resumed(self) -> tuple[int, str] | None:
        """(step, digest) of the "resumed at step S DIGEST" line; None if there is none."""
        for line in self.lines:
            if line.startswith("resumed at step "):
                _, _, _, step, digest = line.split()
                return int(step), digest
        return None

    @property
    def trained(self) -> list:
        return [int(line.split()[1]) for line in self.lines if re.match(r"^step \d+ loss ", line)]

    def tail(self) -> str:
        return f"stdout {self.lines[-3:]}; stderr: {self.stderr[-1500:]}"


@dataclasses.dataclass
class Trainer:
    """``python -m lowdiff.cli.demo train DIR ...``, optionally with ``LOWDIFF_FAULT``; stdout, stderr
    and digests go to files under ``workdir`` named after ``name``."""

    directory: str
    workdir: str
    name: str
    steps: int
    full_every: int
    batch_steps: int
    optimizer: str = "adamw"
    compressor: str = "topk"
    fault: str | None = None

    def argv(self, digests: str) -> list:
        """The trainer's command line (a subclass adds its options)."""
        return [sys.executable, "-m", "lowdiff.cli.demo", "train", str(self.directory), "--steps", str(self.steps),
                "--optimizer", self.optimizer, "--compressor", self.compressor,
                "--full-every", str(self.full_every), "--batch-steps", str(self.batch_steps), "--digests", digests]

    def start(self) -> Running:
        paths = {k: os.path.join(self.workdir, f"{self.name}.{k}") for k in ("out", "err", "digests")}
        # its own process, forked with torch already imported (lowdiff and LOWDIFF_FAULT are its own)
        proc = forkserver.start(self.argv(paths["digests"]), env(self.fault), stdout=paths["out"],
                                stderr=paths["err"], cwd=REPO)
        return Running(self, proc, paths)


@dataclasses.dataclass
class Running:
    trainer: Trainer
    proc: typing.Any   # forkserver.Forked (or subprocess.Popen with LOWDIFF_TEST_FORKSERVER=0)
    paths: dict

    def finish(self) -> Result:
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.trainer.name}: the trainer hung") from None
        with open(self.paths["out"]) as f:
            lines = f.read().splitlines()
        with open(self.paths["err"]) as f:
            stderr = f.read()
        return Result(self.trainer.name, self.proc.returncode, lines, stderr, read_digests(self.paths["digests"]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_scenarios(scenarios: dict, parallel: int = 2) -> dict:
    """Drive generator ``scenarios`` ({name: generator}) side by side. A scenario yields a Trainer
    to run and is sent its Result when the process has ended; everything else it does (checks,
    in-process resumes) runs in this thread between processes. At most ``parallel`` trainers run at
    once (the machine has few cores; a trainer is mostly one busy thread). Returns {name: formatted
    failure} for the scenarios that raised."""
    ready = collections.deque((name, gen, None) for name, gen in scenarios.items())
    running: collections.deque = collections.deque()
    failures = {}
    try:
        while ready or running:
            while ready and len(running) < parallel:
                name, gen, value = ready.popleft()
                try:
                    trainer = gen.send(value)
                except StopIteration:
                    continue
                except Exception as exc:  # noqa: BLE001 - reported with its scenario's name
                    failures[name] = _describe(exc)
                    continue
                running.append((name, gen, trainer.start()))
            if running:
                name, gen, proc = running.popleft()
                try:
                    result = proc.finish()
                except AssertionError as exc:
                    failures[name] = _describe(exc)
                    gen.close()
                    continue
                ready.append((name, gen, result))
    finally:
        for _, gen, proc in running:
            proc.kill()
            gen.close()
    return failures


def _describe(exc: BaseException) -> str:
    """A failed check: its message and where; anything else (an error escaping lowdiff): the end of
    its traceback too."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)
                 if "test_fault_injection" in f.filename or "fault_helpers" in f.filename), "")
    text = f"{type(exc).__name__}: {exc}" + (f" ({here})" if here else "")
    if not isinstance(exc, AssertionError):
        text += "\n" + "".join(traceback.format_list(frames[-4:])).rstrip()
    return text


def raise_failures(failures: dict) -> None:
    if failures:
        raise AssertionError(f"{len(failures)} scenario(s) failed:\n" +
                             "\n".join(f"- {name}: {text}" for name, text in sorted(failures.items())))


# ------------------------------------------------------------------ what is in a directory
def durable_step(directory) -> int:
    """What the library says is durable: the "durable step" line of ``python -m lowdiff inspect
    DIR`` (run in this process); -1 when there is no directory yet."""
    if not os.path.isdir(directory):
        return -1
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["inspect", str(directory)])
    m = re.search(r"^durable step\s+(\d+)$", out.getvalue(), re.M)
    assert status == 0 and m, f"inspect {directory} failed ({status}): {out.getvalue()} {err.getvalue()}"
    return int(m.group(1))


def checkpoint_names(directory) -> list:
    return sorted(n for n in os.listdir(directory) if FULL_NAME.match(n) or DIFF_NAME.match(n))


def _index(path: str) -> dict:
    """The JSON index of a lowdiff file, located by the trailer (docs/format.md)."""
    with open(path, "rb") as f:
        return _parse(f.read(), path)[0]


def _parse(data: bytes, path: str) -> tuple[dict, int]:
    """(index, kind) of a lowdiff file's bytes, checking the preamble, the trailer and the index CRC
    (docs/format.md, "Container"); ValueError if any of it is wrong."""
    if len(data) < PREAMBLE_SIZE + TRAILER.size:
        raise ValueError(f"{path}: too short")
    magic, version, kind = struct.unpack_from("<8sHH", data, 0)
    index_offset, index_len, index_crc, t_version, t_kind, t_magic = TRAILER.unpack(data[-TRAILER.size:])
    if magic != b"LOWDIFF\x00" or t_magic != b"LDINDEX\x00" or version != 1 or t_version != 1 or t_kind != kind:
        raise ValueError(f"{path}: bad preamble or trailer")
    if index_offset + index_len != len(data) - TRAILER.size:
        raise ValueError(f"{path}: the index does not end where the trailer begins")
    raw = data[index_offset:index_offset + index_len]
    if zlib.crc32(raw) != index_crc:
        raise ValueError(f"{path}: index checksum mismatch")
    index = json.loads(raw)
    if not isinstance(index, dict) or index.get("version") != 1 or \
            index.get("kind") != {1: "full", 2: "diff"}.get(kind):
        raise ValueError(f"{path}: bad index header")
    return index, kind


def _checksum_holds(entry: dict, data: bytes) -> bool:
    if "crc32c" in entry:
        return fastio.crc32c(data) == entry["crc32c"]
    if "crc32" in entry:
        return zlib.crc32(data) == entry["crc32"]
    return False


def _verify_bytes(path: str) -> dict:
    """Check every checksum of the file at ``path`` from its bytes alone, following docs/format.md
    (not lowdiff's readers). Returns the index; raises ValueError (or OSError) if anything is off."""
    with open(path, "rb") as f:
        data = f.read()
    index, kind = _parse(data, path)
    if kind == 1:
        sections = list(index["tensors"]) + [index["objects"]]
        for entry in sections:
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            if end > len(data) or not _checksum_holds(entry, data[start:end]):
                raise ValueError(f"{path}: the section at {start} fails its checksum")
        return index
    expected = index["first"]
    for step, offset, nbytes in index["records"]:
        magic, version, flags, rec_step, packed, raw, crc = RECORD_HEADER.unpack_from(data, offset)
        if magic != b"LDRC" or version != 1 or flags != 0 or rec_step != step or step != expected or \
                RECORD_HEADER.size + packed + raw != nbytes or offset + nbytes > len(data) or \
                zlib.crc32(data[offset + RECORD_HEADER.size:offset + nbytes]) != crc:
            raise ValueError(f"{path}: the record of step {step} at {offset} does not verify")
        expected += 1
    if expected != index["last"] + 1:
        raise ValueError(f"{path}: the records end at step {expected - 1}, the index says {index['last']}")
    return index


def file_verifies(path: str) -> bool:
    """The file is a complete lowdiff file whose every checksum holds and whose contents are what
    its name says (step, step range and session). A file of another session copied in under this
    name does not verify: its name lies about it."""
    name = os.path.basename(path)
    try:
        index = _verify_bytes(path)
        if m := FULL_NAME.match(name):
            return index["kind"] == "full" and index["step"] == int(m.group(1)) and index["session"] == m.group(2)
        if m := DIFF_NAME.match(name):
            return index["kind"] == "diff" and (index["first"], index["last"], index["session"]) == \
                (int(m.group(1)), int(m.group(2)), m.group(3))
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False  # does not read back as a lowdiff file
    return False


class Found(typing.NamedTuple):
    verifies: bool
    nbytes: int


def inventory(directory) -> dict:
    """{name: Found(verifies, nbytes)} of every checkpoint file (full-*.ldf, diff-*.ldd) in
    ``directory``."""
    return {name: Found(file_verifies(os.path.join(directory, name)), os.path.getsize(os.path.join(directory, name)))
            for name in checkpoint_names(directory)}


def retired_entries(directory) -> dict:
    """{name: nbytes} of the files the committed manifest lists as retired (dropped by a committed
    manifest, maybe not deleted yet). Only a manifest whose checksum holds counts."""
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as f:
            outer = json.loads(f.read())
        body = outer["manifest"]
        if zlib.crc32(json.dumps(body, indent=1, sort_keys=True).encode()) != outer["crc32"]:
            return {}
        return {entry["file"]: entry["nbytes"] for entry in body.get("retired") or []}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def assert_nothing_valid_deleted(directory, before: dict, retired: dict, where: str) -> None:
    """Every file that verified in ``before`` still exists, unless the manifest retired it (by name
    and size, docs/format.md "What may be deleted")."""
    now = set(os.listdir(directory))
    gone = sorted(name for name, found in before.items()
                  if found.verifies and name not in now and retired.get(name) != found.nbytes)
    assert not gone, (f"{where}: valid checkpoint files were deleted: {gone} (the manifest retired only "
                      f"{sorted(retired) or 'nothing'})")


# ------------------------------------------------------------------ in-process
@contextlib.contextmanager
def lowdiff_warnings():
    """Collects the messages of WARNING and above logged on the "lowdiff" logger."""
    messages: list = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("lowdiff")
    handler = Collect(logging.WARNING)
    old_level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def resume_like_a_restart(directory, *, full_every: int, batch_steps: int, optimizer="adamw",
                          compressor="topk") -> tuple[int, str, list]:
    """What a restarted demo trainer does before its first step: build, wrap, resume; then close
    without a step (writes nothing). Returns (step, digest of the restored state, lowdiff warnings)."""
    model, opt, sched, sampler = build(optimizer)
    torch.manual_seed(4242)  # the restored RNG must not depend on the RNG before resume
    with lowdiff_warnings() as messages:
        opt = lowdiff.wrap(opt, model, str(directory), compressor=compressor_from(compressor, 0.05),
                           full_every=full_every, batch_steps=batch_steps, scheduler=sched,
                           extra_state={"sampler": sampler})
        try:
            step = recovery.resume(str(directory), model, opt)
            digest = state_digest(model, opt, sched, sampler)
        finally:
            opt.close()
    return step, digest, messages


def verify(directory) -> tuple[int, list]:
    """``python -m lowdiff verify DIR``, in this process: (exit status, stdout lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["verify", str(directory)])
    return status, out.getvalue().splitlines()


# ------------------------------------------------------------------ damage
def flip_bit(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def full_tensor_ranges(path: str) -> list:
    """[(offset, end)] of the tensors of a full checkpoint (from its own index)."""
    return [(t["offset"], t["offset"] + t["nbytes"]) for t in _index(path)["tensors"] if t["nbytes"]]


def batch_records(path: str) -> list:
    """[(step, offset, nbytes)] of the records of a batch file (from its own index)."""
    return [tuple(r) for r in _index(path)["records"]]
