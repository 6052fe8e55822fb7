"""The shared tier in an S3-compatible bucket (lowdiff.tiers.bucket), against a real moto server
process reached through a fault-injecting proxy (s3_helpers): draining, commit by manifest object,
retention, multipart uploads and their abort, errors surfaced at step()/close(), exact resume from
the bucket alone."""
from __future__ import annotations

import json
import re
import shutil
import zlib

import numpy as np
import pytest
from s3_helpers import listing, open_uploads

import lowdiff
from lowdiff.cli.demo import train
from lowdiff.tiers import KeepLast, ObjectStore
from lowdiff.tiers.objectstore import parse_s3_url

MANIFEST_RE = re.compile(r"MANIFEST-(\d{12})\.json$")


def committed(s3, prefix: str) -> dict:
    """The body of the bucket's only manifest object (there is exactly one after a clean close)."""
    keys = [k for k in listing(s3.client, s3.bucket, prefix) if MANIFEST_RE.search(k)]
    assert len(keys) == 1, keys
    outer = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read())
    return outer["bucket_manifest"]


def test_bad_urls_are_refused_at_wrap_time():
    for url, what in (("s3://a/run", "not a valid bucket"), ("s3://Bucket/run", "not a valid bucket"),
                      ("s3://bucket/a//b", "empty"), ("s3://bucket/../x", "'..'"),
                      ("gs://bucket/run", "only s3://")):
        with pytest.raises(ValueError, match=re.escape(what)):
            lowdiff.Tiers(url)
    assert lowdiff.Tiers("s3://bucket/run/").shared_dir == "s3://bucket/run"
    assert parse_s3_url("s3://bucket").prefix == ""
    with pytest.raises(ValueError, match="part_bytes"):
        ObjectStore(part_bytes=0)


def test_drains_into_the_bucket_and_lists_every_object_with_size_and_crc(s3, tmp_path):
    tiers = lowdiff.Tiers(f"s3://{s3.bucket}/run", shared=KeepLast(2))
    train(str(tmp_path / "local"), 20, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    body = committed(s3, "run/")
    objects = listing(s3.client, s3.bucket, "run/")
    names = set(body["objects"])
    assert names == {e["file"] for e in body["manifest"]["manifest"]["fulls"] + body["manifest"]["manifest"]["batches"]}
    assert {k.removeprefix("run/") for k in objects} == names | {MANIFEST_RE.search(k).group(0) for k in objects
                                                                  if MANIFEST_RE.search(k)}
    fulls = sorted(e["step"] for e in body["manifest"]["manifest"]["fulls"])
    assert fulls == [15, 20]                                       # KeepLast(2) applied in the bucket
    for name, info in body["objects"].items():
        data = s3.client.get_object(Bucket=s3.bucket, Key=f"run/{name}")["Body"].read()
        assert len(data) == info["nbytes"]
        assert zlib.crc32(b"") == 0 and info["crc32c"] == lowdiff_crc(data)
    assert open_uploads(s3.client, s3.bucket) == []


def lowdiff_crc(data: bytes) -> int:
    import fastio

    return fastio.crc32c(data)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The uninterrupted run's state digest after every step (no lowdiff)."""
    return train(None, 30, full_every=5, batch_steps=2, log=lambda m: None)["digests"]


def test_resume_from_the_bucket_alone_is_exact(s3, tmp_path, reference):
    url = f"s3://{s3.bucket}/run"
    tiers = lowdiff.Tiers(url, shared=KeepLast(2))
    train(str(tmp_path / "node1"), 17, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    shutil.rmtree(tmp_path / "node1")                      # the node is gone; the bucket is not
    said: list = []
    out = train(str(tmp_path / "node2"), 30, full_every=5, batch_steps=2, tiers=tiers, log=said.append)
    assert out["start"] == 17 and "tier shared" in said
    assert out["digests"] == {step: reference[step] for step in range(17, 31)}
    # The new node continued the bucket's run: its commits replaced the old ones.
    body = committed(s3, "run/")
    assert sorted(e["step"] for e in body["manifest"]["manifest"]["fulls"]) == [22, 27]   # fulls every 5 steps from 17


def client_for(s3, prefix: str, **options):
    from lowdiff.tiers.objectstore import S3Client

    return S3Client(parse_s3_url(f"s3://{s3.bucket}/{prefix}"), ObjectStore(**options))


def test_a_multipart_upload_survives_slowdown_drops_and_a_stall(s3, tmp_path, rng):
    import fastio

    data = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    (tmp_path / "big").write_bytes(data)
    client = client_for(s3, "mp", part_bytes=64 << 10, max_concurrency=3, deadline_s=20, read_timeout_s=1)
    s3.proxy.stall_s = 1.5
    s3.proxy.fail("503", 2, "partNumber=2")
    s3.proxy.fail("drop", 1, "partNumber=4")
    s3.proxy.fail("stall", 1, "partNumber=5")
    s3.proxy.fail("500", 1, "uploadId=")          # the completion (or a part) once more
    assert client.upload_file(str(tmp_path / "big"), "big") == (len(data), fastio.crc32c(data))
    assert s3.client.get_object(Bucket=s3.bucket, Key="mp/big")["Body"].read() == data
    assert sum("partNumber=" in line for line in s3.proxy.seen) >= 5 + 4     # 5 parts, 4 failed once
    assert open_uploads(s3.client, s3.bucket) == []


def test_a_failed_multipart_upload_is_aborted(s3, tmp_path):
    from lowdiff.tiers.objectstore import ObjectStoreError

    (tmp_path / "big").write_bytes(bytes(200_000))
    client = client_for(s3, "mp", part_bytes=64 << 10, max_concurrency=2, deadline_s=0.5)
    s3.proxy.fail("503", 10_000, "partNumber=3")   # SlowDown for ever: the deadline expires
    with pytest.raises(ObjectStoreError, match="part 3 of big"):
        client.upload_file(str(tmp_path / "big"), "big")
    assert open_uploads(s3.client, s3.bucket) == []            # no parts left billed
    assert "mp/big" not in listing(s3.client, s3.bucket)
    assert any(line.startswith("DELETE") and "uploadId=" in line for line in s3.proxy.seen)


@pytest.mark.parametrize("problem", ["missing bucket", "wrong endpoint"])
def test_a_bucket_that_cannot_be_used_fails_at_the_first_step_and_the_local_tier_keeps_working(
        s3, tmp_path, monkeypatch, reference, problem):
    from lowdiff.tiers.objectstore import ObjectStoreError

    bucket = s3.bucket
    if problem == "missing bucket":
        bucket = "lowdiff-no-such-bucket"
    else:
        from s3_helpers import free_port
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")   # nothing listens
    tiers = lowdiff.Tiers(f"s3://{bucket}/run", object_store=ObjectStore(deadline_s=0.5))
    said: list = []
    with pytest.raises(ObjectStoreError) as raised:
        train(str(tmp_path / "local"), 6, full_every=5, batch_steps=2, tiers=tiers, log=said.append)
    text = str(raised.value) + " ".join(getattr(raised.value, "__notes__", []))
    assert ("does not exist" if problem == "missing bucket" else "cannot reach the endpoint") in text
    assert "keeps its checkpoints" in text and "lowdiff-test-secret" not in text
    # wrap() and resume went through (the local tier works); the error came at the first step().
    assert said[0] == "tier local" and not any(line.startswith("step ") for line in said)


def test_cli_reads_the_bucket_and_a_damaged_object_is_named_and_not_used(s3, tmp_path, reference, capsys):
    from lowdiff.cli.main import main

    url = f"s3://{s3.bucket}/run"
    tiers = lowdiff.Tiers(url, shared=KeepLast(2))
    train(str(tmp_path / "node1"), 12, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    assert main(["verify", url]) == 0
    assert main(["export", url, "--step", "12", "-o", str(tmp_path / "s12.pt")]) == 0
    assert (tmp_path / "s12.pt").stat().st_size > 0
    capsys.readouterr()
    body = committed(s3, "run/")
    newest = max(body["manifest"]["manifest"]["fulls"], key=lambda e: e["step"])
    data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=f"run/{newest['file']}")["Body"].read())
    data[len(data) // 2] ^= 0xFF                            # one flipped bit, same size
    s3.client.put_object(Bucket=s3.bucket, Key=f"run/{newest['file']}", Body=bytes(data))
    assert main(["verify", url]) == 1
    assert newest["file"] in capsys.readouterr().out
    shutil.rmtree(tmp_path / "node1")
    out = train(str(tmp_path / "node2"), 14, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    # The damaged full checkpoint is passed over: the older one and its chain reach step 12 exactly.
    assert out["start"].full_step < newest["step"] and out["start"] == 12
    assert out["digests"] == {step: reference[step] for step in range(12, 15)}


def test_the_deprecated_shared_dir_keyword_takes_an_s3_url_too(s3, tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    url = f"s3://{s3.bucket}/old"
    with pytest.warns(DeprecationWarning, match="shared_dir"):
        opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, str(tmp_path / "local"),
                           shared_dir=url)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.close()
    assert opt.config.tiers.shared_dir == url and not (tmp_path / "s3:").exists()
    assert any(k.startswith("old/MANIFEST-") for k in listing(s3.client, s3.bucket, "old/"))


def test_a_second_writer_is_refused_by_the_conditional_put(s3, tmp_path):
    from lowdiff.errors import CheckpointError
    from lowdiff.store.manifest import FullEntry
    from lowdiff.tiers.bucket import BucketStore

    (tmp_path / "f").write_bytes(b"x" * 100)
    first, second = (BucketStore(f"s3://{s3.bucket}/two", KeepLast(2), verify=False) for _ in range(2))
    first.open()
    second.open()
    for store, name in ((first, "full-000000000001-aaaaaaaa.ldf"), (second, "full-000000000002-bbbbbbbb.ldf")):
        entry = FullEntry(int(name[5:17]), name, 100, name[18:26])
        store.receive(str(tmp_path / "f"), entry, {})
        if store is first:
            store.commit_copied(entry)
        else:
            with pytest.raises(CheckpointError, match="another writer"):
                store.commit_copied(entry)
    # A put whose answer was lost and whose retry is refused is recognised as ours.
    s3.proxy.fail("lose", 1, "MANIFEST-000000000001")
    entry = FullEntry(3, "full-000000000003-aaaaaaaa.ldf", 100, "aaaaaaaa")
    first.receive(str(tmp_path / "f"), entry, {})
    first.commit_copied(entry)
    assert first.listed().files() == {"full-000000000001-aaaaaaaa.ldf", "full-000000000003-aaaaaaaa.ldf"}
    assert sum("MANIFEST-000000000001" in line and line.startswith("PUT") for line in s3.proxy.seen) == 2


def test_the_buckets_durable_step_is_what_a_resume_from_it_reaches(s3, tmp_path):
    """opt.shared_durable_step with a bucket as the shared tier (it raised AttributeError: the
    bucket store had no durable_step), and a resume from the bucket alone reaches it."""
    import torch

    import recovery

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    url = f"s3://{s3.bucket}/durable"
    model, opt = model_and_optimizer()
    opt = lowdiff.wrap(opt, model, tmp_path / "local", full_every=4, batch_steps=2, tiers=lowdiff.Tiers(url))
    for _ in range(10):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    assert opt.stats()["tiers"]["shared_durable_step"] == opt.shared_durable_step
    opt.close()
    assert opt.shared_durable_step == opt.durable_step == 10
    shutil.rmtree(tmp_path / "local")
    model, plain = model_and_optimizer()
    assert recovery.resume(str(tmp_path / "local"), model, plain, shared_dir=url) == 10


def test_resume_replays_while_the_chain_is_still_being_fetched(s3, tmp_path):
    """Resume from the bucket alone starts replaying before the chain's last batch object is
    fetched (issue #26: no download of everything first), and reaches the last step exactly. The
    proxy's request log is read at the replay's first optimizer step: no timing."""
    import torch

    import recovery

    seen_at_first_step: list = []
    watching: list = []

    class Watched(torch.optim.SGD):
        def step(self, closure=None):
            if watching and not seen_at_first_step:
                seen_at_first_step.append(list(s3.proxy.seen))
            return super().step(closure)

    def model_and(optimizer_class):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        return model, optimizer_class(model.parameters(), lr=0.05, momentum=0.9)

    url = f"s3://{s3.bucket}/stream"
    model, opt = model_and(Watched)
    opt = lowdiff.wrap(opt, model, tmp_path / "local", full_every=100, batch_steps=2, tiers=lowdiff.Tiers(url))
    torch.manual_seed(1)
    for _ in range(16):
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    shutil.rmtree(tmp_path / "local")

    body = committed(s3, "stream/")
    batches = sorted(body["manifest"]["manifest"]["batches"], key=lambda e: e["first"])
    assert len(batches) == 8 and len(body["manifest"]["manifest"]["fulls"]) == 1
    last = batches[-1]["file"]
    model, plain = model_and(Watched)
    s3.proxy.seen.clear()
    watching.append(True)
    assert recovery.resume(str(tmp_path / "local"), model, plain, shared_dir=url, workers=1) == 16
    gets = [line for line in seen_at_first_step[0] if line.startswith("GET") and "/stream/" in line]
    assert any(batches[0]["file"] in line for line in gets)
    assert not any(last in line for line in gets), gets          # replay began before the last fetch
    assert any(last in line and line.startswith("GET") for line in s3.proxy.seen)   # and it came later
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(plain.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), moments))


def test_what_resume_says_of_damaged_bucket_objects_names_their_s3_urls(s3, tmp_path, reference, caplog):
    """The newest full checkpoint and the batch after it are damaged in the bucket: resume falls
    back to the older full checkpoint and its chain ends before the damaged batch; every warning
    names the object's s3:// URL, none the temporary directory it was fetched into."""
    url = f"s3://{s3.bucket}/run"
    tiers = lowdiff.Tiers(url, shared=KeepLast(2))
    train(str(tmp_path / "node1"), 12, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    shutil.rmtree(tmp_path / "node1")
    manifest = committed(s3, "run/")["manifest"]["manifest"]
    newest = max(manifest["fulls"], key=lambda e: e["step"])
    after = next(e for e in manifest["batches"] if e["first"] == newest["step"] + 1)
    for name in (newest["file"], after["file"]):
        data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=f"run/{name}")["Body"].read())
        data[len(data) // 2] ^= 0xFF
        s3.client.put_object(Bucket=s3.bucket, Key=f"run/{name}", Body=bytes(data))
    caplog.set_level("INFO", logger="lowdiff")
    out = train(str(tmp_path / "node2"), newest["step"], full_every=5, batch_steps=2, tiers=tiers,
                log=lambda m: None)
    assert out["start"] == newest["step"] and out["start"].full_step < newest["step"]
    assert out["digests"] == {newest["step"]: reference[newest["step"]]}
    said = [r.getMessage() for r in caplog.records if r.name == "lowdiff"]
    warned = [r.getMessage() for r in caplog.records if r.name == "lowdiff" and r.levelname == "WARNING"]
    assert any(f"{url}/{newest['file']}" in m and "does not verify" in m for m in warned), warned
    assert any(f"{url}/{after['file']}" in m and f"ends at step {newest['step']}" in m for m in warned), warned
    assert not any("lowdiff-s3-" in m for m in said), said


def test_a_step_the_buckets_files_cannot_reach_is_refused_before_the_model_changes(s3, tmp_path):
    """resume(step=K) from the bucket alone fetches and checks the chain up to K before loading:
    with the batch holding step K damaged it is refused and the live objects are untouched; an
    earlier K the files reach is resumed."""
    import torch

    import recovery
    from lowdiff.errors import NoCheckpointError

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    url = f"s3://{s3.bucket}/steps"
    model, opt = model_and_optimizer()
    opt = lowdiff.wrap(opt, model, tmp_path / "local", full_every=4, batch_steps=2,
                       tiers=lowdiff.Tiers(url, shared=KeepLast(2)))
    for _ in range(10):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    shutil.rmtree(tmp_path / "local")
    manifest = committed(s3, "steps/")["manifest"]["manifest"]
    damaged = next(e for e in manifest["batches"] if e["first"] <= 10 <= e["last"])["file"]
    data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=f"steps/{damaged}")["Body"].read())
    data[-100] ^= 0xFF
    s3.client.put_object(Bucket=s3.bucket, Key=f"steps/{damaged}", Body=bytes(data))
    model, plain = model_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NoCheckpointError, match=re.escape(f"{url}/")):
        recovery.resume(str(tmp_path / "local"), model, plain, shared_dir=url, step=10)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not plain.state
    assert recovery.resume(str(tmp_path / "local"), model, plain, shared_dir=url, step=8) == 8


def test_a_bucket_that_stops_answering_during_resume_fails_it_and_keeps_its_commits(s3, tmp_path):
    """A batch object that cannot be fetched because the store stops answering (connections
    dropped past the deadline) is not passed over like a damaged one: resume raises, naming it,
    and the bucket keeps every object of its commit (an older state resumed on would have made the
    next commits drop them)."""
    from lowdiff.tiers.objectstore import ObjectStoreError

    url = f"s3://{s3.bucket}/run"
    tiers = lowdiff.Tiers(url, shared=KeepLast(2), object_store=ObjectStore(deadline_s=1))
    train(str(tmp_path / "node1"), 12, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    shutil.rmtree(tmp_path / "node1")
    before = listing(s3.client, s3.bucket, "run/")
    manifest = committed(s3, "run/")["manifest"]["manifest"]
    newest = max(manifest["fulls"], key=lambda e: e["step"])
    after = next(e for e in manifest["batches"] if e["first"] == newest["step"] + 1)["file"]
    s3.proxy.fail("drop", 10_000, f"/run/{after}")
    with pytest.raises(ObjectStoreError, match=re.escape(f"reading {after} from {url} failed: cannot reach")):
        train(str(tmp_path / "node2"), 14, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    assert listing(s3.client, s3.bucket, "run/") == before


def test_the_cli_names_bucket_objects_by_url_not_by_the_directory_they_were_fetched_into(s3, tmp_path, capsys):
    import sys

    from lowdiff.cli.main import main

    url = f"s3://{s3.bucket}/run"
    train(str(tmp_path / "node1"), 12, full_every=5, batch_steps=2, tiers=lowdiff.Tiers(url, shared=KeepLast(2)),
          log=lambda m: None)
    manifest = committed(s3, "run/")["manifest"]["manifest"]
    damaged = next(e for e in manifest["batches"] if e["last"] == 12)["file"]
    data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=f"run/{damaged}")["Body"].read())
    data[100] ^= 0xFF
    s3.client.put_object(Bucket=s3.bucket, Key=f"run/{damaged}", Body=bytes(data))
    stdout = sys.stdout
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert f"directory      {url}\n" in out and "lowdiff-s3-" not in out
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"corrupt  {damaged}: {url}/{damaged}: is " in out and "1 do not" in out and "lowdiff-s3-" not in out
    assert main(["export", url, "--step", "12", "-o", str(tmp_path / "s12.pt")]) == 2
    err = capsys.readouterr().err
    assert f"error: {url}: step 12 is not retained" in err, err
    assert sys.stdout is stdout


def test_a_damaged_bucket_commit_fails_the_drain_not_wrap(s3, tmp_path):
    """The bucket's newest manifest object damaged: wrap and resume (from the local tier) go
    through, and the error, naming the manifest's URL, comes at the first step, as a write error
    does (under torch.distributed every rank then still reaches wrap's collective)."""
    from lowdiff.errors import CorruptCheckpointError

    url = f"s3://{s3.bucket}/run"
    tiers = lowdiff.Tiers(url, shared=KeepLast(2))
    train(str(tmp_path / "node1"), 6, full_every=5, batch_steps=2, tiers=tiers, log=lambda m: None)
    key = next(k for k in listing(s3.client, s3.bucket, "run/") if MANIFEST_RE.search(k))
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"{not json")
    said: list = []
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"s3://{s3.bucket}/{key}")) as raised:
        train(str(tmp_path / "node1"), 8, full_every=5, batch_steps=2, tiers=tiers, log=said.append)
    assert said[0] == "tier local" and "keeps its checkpoints" in " ".join(raised.value.__notes__)


def test_retries_of_the_drainer_leave_the_training_random_state_alone(s3):
    """The retries' jitter (S3Client.retrying) runs in the drainer's thread while training runs:
    drawn from Python's global ``random`` it moved the state a step boundary captures, so a run
    that resumed from the bucket and trained on differed from the uninterrupted one in its per-rank
    RNG whenever a request had been retried (seen in test_s3_partitioned under load)."""
    import random

    from lowdiff.tiers.objectstore import S3Client

    client = S3Client(parse_s3_url(f"s3://{s3.bucket}/rng"), ObjectStore(deadline_s=30.0))
    random.seed(1234)
    state = random.getstate()
    s3.proxy.fail("503", 3, match="/rng/object")
    client.put("object", b"x")                               # three SlowDown answers, then done
    assert client.get("object") == b"x"
    assert sum("/rng/object" in line for line in s3.proxy.seen) >= 4
    assert random.getstate() == state
