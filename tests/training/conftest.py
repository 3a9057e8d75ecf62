"""Fixtures of the training tests: the S3 servers of the sharded tests (moto and SeaweedFS)."""

from __future__ import annotations

from tests.sharded.conftest import moto_endpoint, s3_server, seaweedfs_endpoint

__all__ = ["moto_endpoint", "s3_server", "seaweedfs_endpoint"]  # session fixtures shared with the sharded tests
