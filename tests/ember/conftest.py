"""Fixtures for tests/ember: an isolated environment, and a real S3 endpoint (a moto server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never ask an instance-metadata service for credentials: that waits for a timeout.
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing a test does touches ~/.ember, ~/.aws or a real AWS account."""
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "ember-cache"))
    monkeypatch.setenv("EMBER_REGISTRY", str(tmp_path / "ember-registry"))
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server(log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """A moto S3 server in its own process on a free loopback port; yields its endpoint URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto server did not start on {url}: {log.read_text()[-2000:]}")
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as url:
        yield url


@pytest.fixture(scope="session")
def iam_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """A second server that checks IAM: after the setup below, the dummy credentials are unknown
    to it, and those of a user with no policy are denied everything. Yields (endpoint, that user)."""
    setup_calls = 3  # create_bucket, create_user, create_access_key
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    with moto_server(log, {"INITIAL_NO_AUTH_ACTION_COUNT": str(setup_calls)}) as url:
        auth = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing"}
        import boto3

        boto3.client("s3", **auth).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **auth)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield url, {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


@pytest.fixture
def dead_endpoint() -> str:
    """An endpoint URL on a loopback port that nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


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
