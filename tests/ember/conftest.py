"""Fixtures for tests/ember: an isolated environment, and real S3 endpoints (moto servers, tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_sandbox: None) -> None:
    """Nothing a test does touches ~/.ember, ~/.aws or a real AWS account."""
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "ember-cache"))
    monkeypatch.setenv("EMBER_REGISTRY", str(tmp_path / "ember-registry"))


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory, start_moto: Callable[..., Any]) -> Iterator[str]:
    server = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def iam_s3(tmp_path_factory: pytest.TempPathFactory,
           start_moto: Callable[..., Any]) -> Iterator[tuple[str, dict[str, str]]]:
    """A second server that checks IAM: after the setup below, the dummy credentials are unknown
    to it, and those of a user with no policy are denied everything. Yields (endpoint, that user)."""
    setup_calls = 3  # create_bucket, create_user, create_access_key
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    server = start_moto(log, {"INITIAL_NO_AUTH_ACTION_COUNT": str(setup_calls)})
    url = server.url
    try:
        auth = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing"}
        import boto3

        boto3.client("s3", **auth).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **auth)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield url, {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_endpoint: str):  # -> botocore S3 client
    """Test-side access to the server, with explicit credentials: made once, it cannot see the
    per-test environment."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture
def s3_bucket(s3_client) -> str:
    """A fresh, empty bucket for this test."""
    name = f"ember-test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


class LocalStore:
    """Raw access to a local registry's files, to inspect or tamper with them as an attacker would."""

    def __init__(self, root: Path) -> None:
        from ember.registry import LocalRegistry

        self.root = root
        self.registry = LocalRegistry(root)

    def list_keys(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # blobs are read-only; replacing needs only the directory
        path.write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()


class S3Store:
    """The same for a prefix of a bucket on the moto server."""

    def __init__(self, client, endpoint: str, bucket: str, prefix: str = "ember/") -> None:
        from ember.registry.s3 import S3Registry

        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.registry = S3Registry(f"s3://{bucket}/{prefix}", endpoint)

    def list_keys(self) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        return sorted(obj["Key"][len(self.prefix):] for page in pages for obj in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> LocalStore | S3Store:
    """A registry of each backend, with raw access to what it stores."""
    if request.param == "local":
        return LocalStore(tmp_path / "registry")
    return S3Store(request.getfixturevalue("s3_client"), request.getfixturevalue("s3_endpoint"),
                   request.getfixturevalue("s3_bucket"))
