"""Clear errors of an object-store shared tier: access denied by the bucket's IAM policy (a moto
server process that enforces IAM after its setup), and boto3 not installed (a real subprocess in
which ``import boto3`` fails). The missing bucket and the wrong endpoint are in test_s3_tier."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from s3_helpers import CREDENTIALS, moto_server

import lowdiff
from lowdiff.cli.demo import train
from lowdiff.tiers import ObjectStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_allowed(endpoint: str, actions: list) -> dict:
    """Create the bucket ``denied`` and an IAM user allowed only ``actions`` on it; its keys.
    (4 requests: the server enforces IAM from the 5th on.)"""
    import boto3

    root = {"endpoint_url": endpoint, "aws_access_key_id": "root", "aws_secret_access_key": "root-secret",
            "region_name": "us-east-1"}
    boto3.client("s3", **root).create_bucket(Bucket="denied")
    iam = boto3.client("iam", **root)
    iam.create_user(UserName="trainer")
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    # (A policy needs an action: a user allowed nothing gets one that has nothing to do with S3.)
    statement = {"Effect": "Allow", "Action": actions or ["sts:GetCallerIdentity"], "Resource": "*"}
    iam.put_user_policy(UserName="trainer", PolicyName="only",
                        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [statement]}))
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


@pytest.mark.parametrize("allowed", [[], ["s3:ListBucket", "s3:ListBucketMultipartUploads", "s3:GetObject"]],
                         ids=["nothing", "read-only"])
def test_access_denied_is_said_at_the_next_step_and_the_local_tier_keeps_working(tmp_path, monkeypatch, allowed):
    """Denied listing (nothing allowed): the error comes at the first step(); denied writes
    (read-only): wrap opens the bucket, the first upload is refused, the error comes at a later
    step() or close(), and the local tier holds its checkpoints. Either way it says access was
    denied and names the bucket URL, not the secret key."""
    from lowdiff.tiers.objectstore import ObjectStoreError

    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="4") as endpoint:
        keys = _user_allowed(endpoint, allowed)
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        # The bucket's root: moto's IAM check computes the signature of a query holding "/" (a
        # listing's Prefix=run/) wrongly and answers SignatureDoesNotMatch.
        tiers = lowdiff.Tiers("s3://denied", object_store=ObjectStore(deadline_s=2))
        said: list = []
        with pytest.raises(ObjectStoreError) as raised:
            train(str(tmp_path / "local"), 8, full_every=4, batch_steps=2, tiers=tiers, log=said.append)
    text = str(raised.value) + " ".join(getattr(raised.value, "__notes__", []))
    assert "access denied" in text and "s3://denied" in text, text
    assert keys["AWS_SECRET_ACCESS_KEY"] not in text
    if not allowed:
        assert "keeps its checkpoints" in text and not any(line.startswith("step ") for line in said)
    else:
        assert "writing full-" in text or "writing diff-" in text, text
        manifest = json.loads((tmp_path / "local" / "MANIFEST.json").read_text())["manifest"]
        assert manifest["fulls"], "the local tier committed its checkpoints"


def _run_without_boto3(code: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter in which ``import boto3`` raises ImportError."""
    prologue = "import sys\nsys.modules['boto3'] = None\n"
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_boto3_wrap_resume_and_the_cli_say_what_to_install(tmp_path):
    done = _run_without_boto3("""
        import torch, lowdiff, recovery
        from lowdiff.cli.main import main
        model = torch.nn.Linear(2, 2)
        for what, call in (
                ("wrap", lambda: lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, "local",
                                              tiers=lowdiff.Tiers("s3://bucket/run"))),
                ("resume", lambda: recovery.resume("other", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   shared_dir="s3://bucket/run"))):
            try:
                call()
                print(what, "no error")
            except ImportError as exc:
                print(what, "ImportError:", exc)
        print("cli", main(["verify", "s3://bucket/run"]))
    """, tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    for what in ("wrap", "resume"):
        line = next(line for line in lines if line.startswith(what + " "))
        assert "ImportError" in line and "pip install 'lowdiff[s3]'" in line, line
    assert "cli 2" in lines or "cli 1" in lines, lines
    assert "pip install 'lowdiff[s3]'" in done.stderr, done.stderr
    assert not (tmp_path / "s3:").exists()
