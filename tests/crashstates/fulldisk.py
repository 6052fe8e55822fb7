"""A full disk on a file system that takes O_DIRECT (issue #33, coverage), not a test module: ext4
made on a small image file, attached to a loop device and mounted (root only; ``loop_ext4`` says why
when it cannot be done). The checkpoint directory (``tier="local"``) or the shared tier of storage
tiers (``tier="shared"``) lives there, with only ``free_kib`` left; training runs until lowdiff
reports ENOSPC. Then: the error names a file and is sticky (every later step, flush and close
raise it), nothing durable is lost (resume of what the disk holds reaches the step reported
durable before the error, byte for byte the uninterrupted run's).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

from lowdiff_helpers import build, wrap  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402
from lowdiff.cli.demo import forward_backward, state_digest  # noqa: E402

IMAGE_MIB = 8
MAX_STEPS = 200


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


@contextlib.contextmanager
def loop_ext4(work: str):
    """Yield the mount point of a fresh ext4 on a loop device (raises OSError saying why not)."""
    if os.geteuid() != 0:
        raise OSError("a loop device and mount need root")
    image, mount = os.path.join(work, "ext4.img"), os.path.join(work, "mnt")
    with open(image, "wb") as f:
        f.truncate(IMAGE_MIB << 20)
    done = _run("mkfs.ext4", "-q", "-F", "-m", "0", image)   # no blocks reserved for root (the tests run as root)
    if done.returncode:
        raise OSError(f"mkfs.ext4 failed: {done.stderr.strip() or 'not installed?'}")
    done = _run("losetup", "-f", "--show", image)
    if done.returncode:
        raise OSError(f"no loop device: {done.stderr.strip()}")
    device = done.stdout.strip()
    try:
        os.makedirs(mount)
        done = _run("mount", device, mount)
        if done.returncode:
            raise OSError(f"mount {device} failed: {done.stderr.strip()}")
        try:
            yield mount
        finally:
            if _run("umount", mount).returncode:
                _run("umount", "-l", mount)
    finally:
        _run("losetup", "-d", device)


def fill(mount: str, free_kib: int) -> None:
    """Leave about ``free_kib`` KiB free on ``mount``: fill it to ENOSPC, then give that much back."""
    path = os.path.join(mount, "filler")
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\xff" * (256 << 10))
    for chunk in (64 << 10, 4096):   # the last partial writes
        with open(path, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\xff" * chunk)
    os.truncate(path, max(0, os.path.getsize(path) - free_kib * 1024))
    os.sync()


def _sticky(call, what: str) -> str | None:
    try:
        call()
    except OSError as exc:
        return None if exc.errno == errno.ENOSPC else f"{what} raised errno {exc.errno}: {exc}"
    return f"{what} succeeded after ENOSPC (the error is not sticky)"


def run_full_disk(work: str, tier: str, free_kib: int, reference: dict) -> list:
    """Problems found (empty: none)."""
    problems: list = []
    where = f"ext4 loop device, {tier} tier on it, {free_kib} KiB free"
    with loop_ext4(work) as mount:
        fill(mount, free_kib)
        if tier == "local":
            directory, shared = os.path.join(mount, "ckpt"), None
        else:
            directory, shared = os.path.join(work, "local"), os.path.join(mount, "shared")
        options = {"full_every": 4, "batch_steps": 2, "retention": lowdiff.KeepLast(2)}
        if shared:
            options["tiers"] = lowdiff.Tiers(shared, max_lag_steps=4)
        model, opt, sched, sampler = build()
        opt = wrap(directory, model, opt, sched, sampler, **options)
        error, steps, durable = None, 0, -1
        try:
            recovery.resume(directory, model, opt)
            while error is None and steps < MAX_STEPS:
                forward_backward(model, sampler)
                try:
                    opt.step()
                    steps += 1
                    if steps % 3 == 0:
                        opt.flush()
                except OSError as exc:
                    error = exc
                opt.zero_grad()
                if error is None:
                    durable = opt.durable_step
            if error is None:
                problems.append(f"{where}: {steps} steps never ran out of space")
            elif error.errno != errno.ENOSPC:
                problems.append(f"{where}: the error is not ENOSPC: {error!r}")
            elif mount not in str(error):
                problems.append(f"{where}: the error names no file on the full disk: {error}")
            if error is not None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(mount, "filler"))   # space is back: only a sticky error fails now
                for what, call in (("step()", opt.step), ("flush()", opt.flush), ("close()", opt.close)):
                    problem = _sticky(call, f"{where}: {what}")
                    if problem:
                        problems.append(problem)
        finally:
            with contextlib.suppress(OSError):
                opt.close()
        copies = {}
        for name, path in (("ckpt", directory), ("shared", shared)):
            if path and os.path.isdir(path):
                copies[name] = shutil.copytree(path, os.path.join(work, f"copy-{name}"))
    model, opt, sched, sampler = build()
    torch.manual_seed(4321)
    np.random.seed(4321)
    try:
        if tier == "local":
            step = recovery.resume(copies["ckpt"], model, opt, scheduler=sched, extra_state={"sampler": sampler})
        else:
            step = recovery.resume(copies["ckpt"], model, opt, scheduler=sched, extra_state={"sampler": sampler},
                                   shared_dir=copies["shared"])
    except Exception as exc:
        return problems + [f"{where}: resume after the full disk raised {exc!r}"]
    if step < durable:
        problems.append(f"{where}: durable_step said {durable}, resume reached {int(step)}")
    elif state_digest(model, opt, sched, sampler) != reference[int(step)]:
        problems.append(f"{where}: the state resumed at step {int(step)} differs from the uninterrupted run's")
    return problems
