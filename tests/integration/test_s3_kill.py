"""SIGKILL of a trainer draining into an S3 bucket (moto server behind the fault proxy), at random
points, 12 times in a row (30 with -m soak); each restart resumes exactly (the state digest of the uninterrupted
run), never before what the bucket had committed when the process died; a third of the restarts
lose their local tier (a replaced node) and resume from the bucket alone. Full checkpoints go up
in several parts (multipart), so kills land in uploads, commits and cleaning. At the end the
bucket holds one manifest, exactly the objects it names, and no unfinished multipart upload."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch
from fault_helpers import durable_step, read_digests
from s3_helpers import CREDENTIALS, Spawner, alive, listing, open_uploads

from lowdiff.cli.demo import train
from lowdiff.store.manifest import Manifest

TRIALS = 30
FULL_EVERY, BATCH_STEPS = 3, 2


def bucket_durable(s3, prefix: str) -> int:
    """The step the bucket's newest committed manifest makes durable (-1: none)."""
    names = sorted(k for k in listing(s3.client, s3.bucket, prefix) if "/MANIFEST-" in k)
    if not names:
        return -1
    body = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=names[-1])["Body"].read())["bucket_manifest"]
    return Manifest.from_json(json.dumps(body["manifest"]).encode(), names[-1]).durable_step()


def resumed_at(path: str) -> tuple[int, str | None]:
    with open(path) as f:
        for line in f:
            if line.startswith("resumed at step "):
                _, _, _, step, digest = line.split()
                return int(step), digest
    return 0, None


# 12 kills by default (4 of them on a replaced node), the 30 of the campaign with -m soak.
@pytest.mark.parametrize("trials", [12, pytest.param(TRIALS, marks=pytest.mark.soak)])
def test_sigkill_while_draining_into_a_bucket_resumes_exactly(s3, tmp_path, rng, trials):
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the demo processes: the digests depend on it
    try:
        reference = train(None, trials * 7 + 20, log=lambda m: None)["digests"]
    finally:
        torch.set_num_threads(before)
    local, url = tmp_path / "local", f"s3://{s3.bucket}/run"
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3.url}
    spawner = Spawner()
    try:
        floor, reached, in_bucket = -1, 0, []
        for trial in range(trials + 1):
            last = trial == trials
            digests, out = tmp_path / f"{trial}.digests", str(tmp_path / f"{trial}.out")
            argv = ["train", str(local), "--steps", str(reached + 3 if last else 100_000), "--full-every",
                    str(FULL_EVERY), "--batch-steps", str(BATCH_STEPS), "--shared-dir", url, "--shared-policy",
                    "last:2", "--s3-part-bytes", str(256 << 10), "--digests", str(digests)]
            pid = spawner.start(argv, out, env)
            # Kill a few steps past the resume point, at a random moment of the step after.
            extra = int(rng.integers(1, 5))
            begun = time.monotonic()
            while alive(pid) and not last and time.monotonic() - begun < 120:
                trained = read_digests(digests)
                if trained and max(trained) >= resumed_at(out)[0] + extra:
                    time.sleep(float(rng.uniform(0, 0.05)))
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.005)
            begun = time.monotonic()
            while alive(pid):
                if time.monotonic() - begun > 120:   # only against hangs; nothing is timed
                    os.kill(pid, signal.SIGKILL)
                    raise AssertionError(f"trial {trial}: the trainer hung")
                time.sleep(0.01)
            start, digest = resumed_at(out)
            with open(out) as f:
                text = f.read()
            assert "Traceback" not in text, text[-3000:]
            assert start >= floor, f"trial {trial}: resumed at {start}, {floor} was durable ({text[-2000:]})"
            assert start == 0 or digest == reference[start], f"trial {trial}: resumed at {start} inexactly"
            trained = read_digests(digests)
            assert all(reference[step] == d for step, d in trained.items()), f"trial {trial} diverged"
            reached = max(trained, default=start)
            drop = trial % 3 == 2 and not last
            in_bucket.append(bucket_durable(s3, "run/"))
            floor = in_bucket[-1] if drop else max(in_bucket[-1], durable_step(local))
            if drop:
                shutil.rmtree(local, ignore_errors=True)
        assert reached == int(argv[argv.index("--steps") + 1])      # the last run finished and closed
        # The kills found the bucket in many states (the drainer kept up well enough to commit).
        assert len(set(in_bucket)) >= trials // 3, in_bucket
    finally:
        spawner.close()
    objects = {k.removeprefix("run/") for k in listing(s3.client, s3.bucket, "run/")}
    manifests = [k for k in objects if k.startswith("MANIFEST-")]
    assert len(manifests) == 1
    body = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=f"run/{manifests[0]}")["Body"].read())
    assert objects - set(manifests) == set(body["bucket_manifest"]["objects"])
    assert open_uploads(s3.client, s3.bucket) == []
