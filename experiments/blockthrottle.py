"""Throttled block devices for the experiments that need slow or separate drives (bench_stripe.py,
bench_stripe_batches.py, storage_tiers.py): ext4 filesystems on loop devices over sparse images,
and one cgroup whose kernel block-layer throttle (cgroup v2 ``io.max``, else cgroup v1
``blkio.throttle.*_bps_device``: the same blk-throttle) limits each of those devices, each way, for
the processes that join it. The rules name only the loop devices, so the local disk is not
throttled. Root is needed; callers fall back (and say so) when this raises.

Imported by the experiment scripts only (``sys.path`` holds experiments/ when they run).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def default_image_dir() -> str:
    """/dev/shm when it is a tmpfs (an image's pages then cost RAM only as they are written), else /var/tmp."""
    try:
        with open("/proc/mounts") as mounts:
            if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts):
                return "/dev/shm"
    except OSError:
        pass
    return "/var/tmp"


@dataclasses.dataclass
class LoopDevice:
    """An ext4 filesystem on a loop device (O_DIRECT into its sparse image) mounted at ``mount``."""

    image: Path
    loop: str | None = None
    mount: Path | None = None

    @classmethod
    def create(cls, image_bytes: int, mount: Path, image_dir: str, prefix: str) -> LoopDevice:
        """Make, format and mount one; on failure what was made is undone and the error raised
        (OSError or subprocess.CalledProcessError)."""
        device = cls(Path(tempfile.mkstemp(prefix=prefix, suffix=".img", dir=image_dir)[1]))
        try:
            os.truncate(device.image, image_bytes)
            device.loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(device.image)],
                                         check=True, capture_output=True, text=True).stdout.strip()
            subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device.loop],
                           check=True, capture_output=True)
            mount.mkdir()
            device.mount = mount
            subprocess.run(["mount", "-o", "noatime", device.loop, str(mount)], check=True, capture_output=True)
        except BaseException:
            device.close()
            raise
        return device

    @property
    def number(self) -> str:
        """The device's "major:minor", as the throttle rules name it."""
        assert self.loop is not None
        rdev = os.stat(self.loop).st_rdev
        return f"{os.major(rdev)}:{os.minor(rdev)}"

    def close(self) -> None:
        """Unmount, detach and delete the image. Idempotent."""
        if self.mount is not None and os.path.ismount(self.mount):
            subprocess.run(["umount", str(self.mount)], check=False)
        if self.loop is not None:
            subprocess.run(["losetup", "-d", self.loop], check=False)
            self.loop = None
        self.image.unlink(missing_ok=True)


class Throttle:
    """One cgroup limiting each of ``devices`` ("major:minor") to ``bps`` bytes/s each way for the
    processes that join it (``preexec``). ``describe``: the rule, in words; ``notes``: what the
    reader of the results should know. Raises OSError when no block throttle is available."""

    def __init__(self, devices: list[str], bps: int, name: str):
        self.notes: list[str] = []
        self.cgroup: Path | None = None
        each = f"{bps / 1e6:.0f} MB/s each way on each of {', '.join(devices)}"
        for v2_root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            controllers = v2_root / "cgroup.controllers"
            if controllers.exists() and "io" in controllers.read_text().split():
                (v2_root / "cgroup.subtree_control").write_text("+io")
                self.cgroup = v2_root / name
                self.cgroup.mkdir()
                for device in devices:
                    (self.cgroup / "io.max").write_text(f"{device} rbps={bps} wbps={bps}")
                self.describe = f"cgroup v2 io.max rbps=wbps={bps} ({each})"
                return
        v1 = Path("/sys/fs/cgroup/blkio")
        if not (v1 / "blkio.throttle.write_bps_device").exists():
            raise OSError("neither cgroup v2 io.max nor cgroup v1 blkio throttling is available")
        self.notes.append("cgroup v2 has no io controller here (io.max unavailable): cgroup v1 blkio "
                          "throttling is used, the same kernel blk-throttle")
        self.cgroup = v1 / name
        self.cgroup.mkdir()
        for device in devices:
            (self.cgroup / "blkio.throttle.write_bps_device").write_text(f"{device} {bps}")
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{device} {bps}")
        self.describe = f"cgroup v1 blkio.throttle read/write_bps_device {bps} ({each})"

    def preexec(self):
        """For subprocess.Popen(preexec_fn=...): join the cgroup before exec."""
        if self.cgroup is None:
            return None
        procs = str(self.cgroup / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def close(self) -> None:
        """Remove the cgroup (its processes have ended). Idempotent."""
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError as exc:
                print(f"warning: could not remove cgroup {self.cgroup}: {exc}", file=sys.stderr)
            self.cgroup = None
