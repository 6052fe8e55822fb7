"""Fixtures of the integration tests: an S3-compatible server process and a bucket behind a fault
proxy (s3_helpers), for the object-store tier's tests."""
from s3_helpers import s3, s3_server  # noqa: F401 (fixtures)
