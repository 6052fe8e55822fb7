"""The shared tier in an S3-compatible bucket (lowdiff.tiers.bucket), against a real moto server
process reached through a fault-injecting proxy (s3_helpers): draining, commit by manifest object,
retention, multipart uploads and their abort, errors surfaced at step()/close(), exact resume from
the bucket alone."""
from __future__ import annotations

import json
import re
import shutil
import zlib

import pytest
from s3_helpers import listing, open_uploads, s3, s3_server  # noqa: F401 (fixtures)

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
