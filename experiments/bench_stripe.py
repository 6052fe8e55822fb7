"""Question: does a full checkpoint striped over N separately throttled drives
(``lowdiff.Options(stripe_dirs=...)``) write and read at the sum of the drives' bandwidths?

Set-up (root needed; torn down at the end): 4 loop devices, each an ext4 filesystem on a sparse
image (under /dev/shm when it is a tmpfs, else /var/tmp), each throttled by the kernel's block-layer
throttle to --mbps MB/s each way (cgroup v2 ``io.max``, else cgroup v1 ``blkio.throttle.*``, one rule
per device, in one cgroup the measuring process joins). Without root, loop devices or a throttle, it
says so and measures plain directories (then the numbers say nothing about drives).

Measured in one process, in the cgroup, all in the same run (median of --repeat rounds, each round
measuring every configuration in turn):

  device k alone   the limit of drive k: --size bytes (one aligned buffer) written through
                   fastio.Writer to drive k and committed (fdatasync, rename, directory fsync), then
                   read back with fastio.Reader (O_DIRECT)
  N = 1, 2, 4      a full checkpoint of --size payload bytes (lowdiff.format.fullckpt.Snapshot, as
                   the trainer's full writer takes it): N = 1 in one directory (today's file), N > 1
                   striped over drives 0..N-1 (lowdiff.store.stripes.StripeDevices: a stripe per
                   drive, laid out in 1 MiB units round robin, written at once, one fastio engine
                   each, then the checkpoint file); write
                   = persist until committed, read = load_full with every tensor's CRC-32C checked
  raw read         the same checkpoint's payload read again with every 32 MiB chunk submitted at once
                   into memory faulted in beforehand, no checksum, no copy (the drives' ceiling for
                   the layout: load_full below it is CPU work of ours — page faults, CRC-32C —
                   competing with the loop devices' kernel threads, at it is the drives')
  cpu              CPU seconds the measuring process used per GB during load_full (all its threads)

Printed per N: aggregate write and read bandwidth, the sum of the N drives' limits measured
alone in this run, the ratio (target >= 0.9), and the ratio to N = 1. A CSV and a PNG
(experiments/plotting.py) are written next to --out.

Usage: sudo python experiments/bench_stripe.py --size 256MiB --mbps 150 --repeat 3
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockthrottle import LoopDevice, Throttle, default_image_dir  # noqa: E402  (experiments/blockthrottle.py)

TARGET = 0.9
DEVICES = 4
UNITS = {"MIB": 1 << 20, "GIB": 1 << 30, "KIB": 1 << 10, "": 1}


def parse_size(text: str) -> int:
    digits = text.rstrip("BKMGIbkmgi")
    return int(float(digits) * UNITS[text[len(digits):].upper()])


class Drives:
    """N throttled loop devices (or plain directories when that cannot be set up): ``roots`` are
    directories on them, ``preexec`` joins the cgroup, ``close`` tears it all down
    (experiments/blockthrottle.py)."""

    def __init__(self, count: int, mbps: float, image_mb: int, workdir: Path, image_dir: str):
        self.notes: list[str] = []
        self.devices: list[LoopDevice] = []
        self._throttle: Throttle | None = None
        self.throttle = "none"
        self.kind = "plain directories on the local disk: NOT separate drives"
        self.roots = [workdir / f"plain{k}" for k in range(count)]
        if os.geteuid() != 0:
            self.notes.append("not root: no loop device or throttle")
            for r in self.roots:
                r.mkdir(parents=True)
            return
        try:
            for k in range(count):
                self.devices.append(LoopDevice.create(image_mb << 20, workdir / f"drive{k}", image_dir,
                                                      f"lowdiff-stripe{k}-"))
        except (OSError, subprocess.CalledProcessError) as exc:
            self.notes.append(f"loop device setup failed ({exc}): plain directories")
            self._teardown()
            for r in self.roots:
                r.mkdir(parents=True, exist_ok=True)
            return
        self.roots = [d.mount / "ckpt" for d in self.devices if d.mount is not None]
        for r in self.roots:
            r.mkdir()
        loops = ", ".join(str(d.loop) for d in self.devices)
        self.kind = f"{count} ext4 loop devices {loops} (images under {image_dir})"
        try:
            self._throttle = Throttle([d.number for d in self.devices], int(mbps * 1e6),
                                      f"lowdiff-stripe-{os.getpid()}")
            self.throttle = self._throttle.describe
            self.notes += self._throttle.notes
        except OSError as exc:
            self.notes.append(f"no throttle could be set ({exc}): the loop devices run at full speed")

    def preexec(self):
        return None if self._throttle is None else self._throttle.preexec()

    def close(self) -> None:
        if self._throttle is not None:
            self._throttle.close()
            self._throttle = None
        self._teardown()

    def _teardown(self) -> None:
        for device in self.devices:
            device.close()
        self.devices = []


# ------------------------------------------------------------------ the measuring child
def measure(roots: list[str], size: int, repeat: int) -> dict:
    import torch

    import fastio
    from lowdiff.format.fullckpt import Snapshot, load_full, read_full_index
    from lowdiff.format.payloadread import LOAD_CHUNK_BYTES, StripedPayload
    from lowdiff.format.schema import PAYLOAD_OFFSET, TrainedWith
    from lowdiff.store.stripes import StripeDevices

    torch.set_num_threads(1)
    buffer = fastio.aligned_buffer(size, populate=True)
    view = buffer.view(0, size)
    buffer.tensor(size).view(torch.int32)[:] = torch.arange(size // 4, dtype=torch.int32)
    # The checkpoint's state: four tensors of a quarter each (parameters and optimizer moments).
    tensors = [torch.randn(size // 16) for _ in range(4)]
    state = {"model": {f"w{i}": t for i, t in enumerate(tensors[:2])},
             "optimizer": {"state": {0: {"exp_avg": tensors[2], "exp_avg_sq": tensors[3]}}, "param_groups": []},
             "scheduler": None, "extra": {}, "rng": {}, "residuals": {}, "grad_scaler": None}
    snapshot = Snapshot()
    snapshot.stage(0, state, TrainedWith((), {}, "bench", "bench"))
    snapshot.copy(on_training_thread=True)
    payload = snapshot.payload_bytes
    out: dict = {"payload_bytes": payload, "device_write": {}, "device_read": {}, "write": {}, "read": {},
                 "raw_read": {}, "read_cpu_s_per_gb": {}, "load": [os.getloadavg()[0]]}
    raw = fastio.aligned_buffer(payload, populate=True)   # (faulted in once: the raw read measures the drives)
    for round_ in range(repeat):
        for k, root in enumerate(roots):
            path = os.path.join(root, "device-probe.bin")
            started = time.perf_counter()
            with fastio.Writer(path, size_hint=size) as writer:
                writer.write(view)
            out["device_write"].setdefault(k, []).append(size / (time.perf_counter() - started))
            target = fastio.aligned_buffer(size)
            started = time.perf_counter()
            with fastio.Reader(path) as reader:
                reader.read_into(0, target.view(0, size))
            out["device_read"].setdefault(k, []).append(size / (time.perf_counter() - started))
            os.unlink(path)
            del target
        for n in (1, 2, 4):
            if n > len(roots):
                continue
            home = os.path.join(roots[0], f"n{n}-r{round_}")
            os.makedirs(home)
            devices = StripeDevices(home, tuple(os.path.join(r, f"n{n}-r{round_}") for r in roots[1:n])) \
                if n > 1 else None
            for d in devices.stripe_dirs if devices else ():
                os.makedirs(d)
            path = os.path.join(home, "full-000000000000-00000000.ldf")
            stripe = (lambda p, devices=devices: devices.write(0, "00000000", p)) if devices else None
            started = time.perf_counter()
            snapshot.persist(path, "00000000", stripe=stripe)
            out["write"].setdefault(n, []).append(payload / (time.perf_counter() - started))
            started, cpu = time.perf_counter(), time.process_time()
            load_full(path)
            out["read"].setdefault(n, []).append(payload / (time.perf_counter() - started))
            out["read_cpu_s_per_gb"].setdefault(n, []).append((time.process_time() - cpu) / (payload / 1e9))
            index = read_full_index(path)
            reader = StripedPayload(path, index.stripes, index.stripe_bytes) if index.stripes else fastio.Reader(path)
            started = time.perf_counter()
            waits = [reader.submit_read_into(PAYLOAD_OFFSET + at, raw.view(at, min(at + LOAD_CHUNK_BYTES, payload)))
                     for at in range(0, payload, LOAD_CHUNK_BYTES)]
            for wait in waits:
                wait()
            out["raw_read"].setdefault(n, []).append(payload / (time.perf_counter() - started))
            reader.close()
            if devices:
                devices.close()
            for d in [home, *(devices.stripe_dirs if devices else ())]:
                shutil.rmtree(d)
    out["load"].append(os.getloadavg()[0])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256MiB", help="checkpoint payload (and per-drive probe) size")
    parser.add_argument("--mbps", type=float, default=150.0, help="throttle of each drive, MB/s each way")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "experiments", "results", "bench_stripe.csv"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    if args.child:
        roots = json.loads(args.child)
        print(json.dumps(measure(roots, size, args.repeat)))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="lowdiff-bench-stripe-"))
    image_mb = max(512, 3 * size // (1 << 20) + 256)
    drives = Drives(DEVICES, args.mbps, image_mb, workdir, default_image_dir())
    try:
        print(f"drives:   {drives.kind}")
        print(f"throttle: {drives.throttle}")
        for note in drives.notes:
            print(f"note:     {note}")
        env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--size", args.size, "--repeat",
                               str(args.repeat), "--child", json.dumps([str(r) for r in drives.roots])],
                              capture_output=True, text=True, env=env, preexec_fn=drives.preexec())
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        drives.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return report(result, args)


def report(result: dict, args) -> int:
    med = {kind: {int(k): statistics.median(v) for k, v in result[kind].items()}
           for kind in ("device_write", "device_read", "write", "read", "raw_read", "read_cpu_s_per_gb")}
    print(f"payload {result['payload_bytes'] / 2**20:.0f} MiB, median of {args.repeat} rounds; MB/s = 1e6 B/s; "
          f"1-minute load average {result['load'][0]:.1f} at the start, {result['load'][1]:.1f} at the end")
    print("drive limits alone (MB/s): " + ", ".join(
        f"drive {k} write {med['device_write'][k] / 1e6:.0f} read {med['device_read'][k] / 1e6:.0f}"
        for k in sorted(med["device_write"])))
    header = f"{'N':>2} {'write MB/s':>11} {'sum limits':>11} {'x sum':>6} {'x N=1':>6} " \
             f"{'read MB/s':>10} {'sum limits':>11} {'x sum':>6} {'x N=1':>6} {'raw read':>9} {'x sum':>6} " \
             f"{'cpu s/GB':>8}  target"
    print(header)
    rows = []
    for n in sorted(med["write"]):
        sums = {op: sum(med[f"device_{op}"][k] for k in range(n)) for op in ("write", "read")}
        row = {"n_devices": n, "size_bytes": result["payload_bytes"], "mbps_limit": args.mbps}
        for op in ("write", "read"):
            row[f"{op}_bytes_per_s"] = med[op][n]
            row[f"{op}_sum_limits_bytes_per_s"] = sums[op]
            row[f"{op}_x_sum"] = med[op][n] / sums[op]
            row[f"{op}_x_one"] = med[op][n] / med[op][1]
        row["raw_read_bytes_per_s"] = med["raw_read"][n]
        row["raw_read_x_sum"] = med["raw_read"][n] / sums["read"]
        row["read_cpu_s_per_gb"] = med["read_cpu_s_per_gb"][n]
        met = "met" if min(row["write_x_sum"], row["read_x_sum"]) >= TARGET else "MISSED"
        print(f"{n:>2} {row['write_bytes_per_s'] / 1e6:>11.0f} {sums['write'] / 1e6:>11.0f} "
              f"{row['write_x_sum']:>6.2f} {row['write_x_one']:>6.2f} {row['read_bytes_per_s'] / 1e6:>10.0f} "
              f"{sums['read'] / 1e6:>11.0f} {row['read_x_sum']:>6.2f} {row['read_x_one']:>6.2f} "
              f"{row['raw_read_bytes_per_s'] / 1e6:>9.0f} {row['raw_read_x_sum']:>6.2f} "
              f"{row['read_cpu_s_per_gb']:>8.2f}  {met} (>= {TARGET})")
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {out}")
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
