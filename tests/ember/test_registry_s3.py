"""The S3 backend against a real (moto) server: multipart transfers, URLs, and one-line errors
for every way an endpoint can fail."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from ember.errors import RegistryError
from ember.package import hash_file, verify_package
from ember.registry import BlobCache, LocalRegistry, blob_key, open_registry, pull_package, push_package
from ember.registry.s3 import S3Registry

BIG = 6 << 20  # above the lowered threshold, and more than one 5 MiB part


def test_large_blobs_go_up_and_down_in_parts(s3_endpoint, s3_client, s3_bucket, make_package, tmp_path):
    src = make_package()
    (src / "data").mkdir()
    (src / "data" / "big.dat").write_bytes(os.urandom(BIG))
    registry = S3Registry(f"s3://{s3_bucket}/models", s3_endpoint, multipart_threshold=1 << 20,
                          multipart_chunksize=5 << 20)
    lock = push_package(src, registry).lock
    big = next(f for f in lock.files if f.path == "data/big.dat")
    head = s3_client.head_object(Bucket=s3_bucket, Key="models/" + blob_key(big.sha256))
    assert head["ETag"].strip('"').endswith("-2")  # S3 marks a multipart upload by its part count
    assert head["ContentLength"] == BIG

    pull_package("tiny", registry, tmp_path / "out", BlobCache(tmp_path / "cache"))
    assert verify_package(tmp_path / "out") == lock
    assert (tmp_path / "out" / "data" / "big.dat").read_bytes() == (src / "data" / "big.dat").read_bytes()


def test_small_blobs_go_up_in_one_request(s3_endpoint, s3_client, s3_bucket, make_package):
    lock = push_package(make_package(), S3Registry(f"s3://{s3_bucket}", s3_endpoint)).lock
    for digest in lock.blobs():
        assert "-" not in s3_client.head_object(Bucket=s3_bucket, Key=blob_key(digest))["ETag"]


@pytest.mark.parametrize(("url", "bucket", "prefix", "canonical"), [
    ("s3://b", "b", "", "s3://b"),
    ("s3://b/", "b", "", "s3://b"),
    ("s3://b/ember", "b", "ember/", "s3://b/ember"),
    ("s3://b//team/ember/", "b", "team/ember/", "s3://b/team/ember"),
])
def test_s3_urls(url, bucket, prefix, canonical):
    registry = open_registry(url, "http://127.0.0.1:9")
    assert isinstance(registry, S3Registry)
    assert (registry.bucket, registry.prefix, registry.url) == (bucket, prefix, canonical)


def test_endpoint_comes_from_the_environment(s3_endpoint, s3_bucket, make_package, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    registry = open_registry(f"s3://{s3_bucket}/x")
    assert registry.endpoint_url == s3_endpoint
    push_package(make_package(), registry)


def test_local_urls(tmp_path, monkeypatch):
    assert open_registry(str(tmp_path)).url == str(tmp_path)
    assert open_registry(f"file://{tmp_path}").url == str(tmp_path)
    monkeypatch.setenv("EMBER_REGISTRY", str(tmp_path / "env"))
    assert open_registry(None).url == str(tmp_path / "env")
    monkeypatch.delenv("EMBER_REGISTRY")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert open_registry(None).url == str(tmp_path / "home" / ".ember" / "registry")
    assert isinstance(open_registry(None), LocalRegistry)


@pytest.mark.parametrize(("url", "endpoint", "message"), [
    ("gs://bucket/x", None, "unsupported registry URL"),
    ("s3:///nobucket", None, "not an S3 registry URL"),
    ("/srv/registry", "http://127.0.0.1:9", "applies only to s3:// registries"),
    ("s3://bucket", "not a url", "bad endpoint URL"),
])
def test_bad_registry_urls(url, endpoint, message):
    with pytest.raises(RegistryError, match=message):
        open_registry(url, endpoint)


def test_endpoint_that_is_down_gives_one_line(dead_endpoint, make_package, tmp_path):
    endpoint = dead_endpoint
    registry = open_registry("s3://bucket/prefix", endpoint)
    started = time.monotonic()
    for attempt in (lambda: push_package(make_package(), registry),
                    lambda: pull_package("tiny", registry, tmp_path / "out", BlobCache(tmp_path / "c")),
                    lambda: registry.list_names()):
        with pytest.raises(RegistryError) as info:
            attempt()
        assert str(info.value) == f"s3://bucket/prefix: cannot reach endpoint {endpoint} (connection refused)"
        assert info.value.__cause__ is None and info.value.__suppress_context__
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out").exists()


def test_missing_bucket_says_so(s3_endpoint, make_package, tmp_path):
    registry = open_registry("s3://no-such-bucket/x", s3_endpoint)
    with pytest.raises(RegistryError, match=r"bucket 'no-such-bucket' does not exist"):
        push_package(make_package(), registry)
    with pytest.raises(RegistryError, match=r"bucket 'no-such-bucket' does not exist"):
        registry.list_names()
    blob = tmp_path / "blob"
    blob.write_bytes(b"x")  # boto3's transfer manager wraps this one in S3UploadFailedError
    with pytest.raises(RegistryError, match=r"bucket 'no-such-bucket' does not exist"):
        registry.put_blob(hash_file(blob)[1], blob)
    with pytest.raises(RegistryError, match=r"bucket 'no-such-bucket' does not exist"):
        pull_package("tiny:0.1.0", registry, tmp_path / "out", BlobCache(tmp_path / "c"))


def test_missing_credentials_say_so(s3_endpoint, s3_bucket, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with pytest.raises(RegistryError, match="no AWS credentials found"):
        open_registry(f"s3://{s3_bucket}", s3_endpoint).list_names()


def test_access_denied_says_so(iam_s3, make_package, monkeypatch, tmp_path):
    endpoint, user = iam_s3
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    registry = open_registry("s3://locked/ember", endpoint)
    with pytest.raises(RegistryError, match=r"^s3://locked/ember: access denied reading packages/tiny/0\.1\.0\.json "):
        push_package(make_package(), registry)
    with pytest.raises(RegistryError, match=r"access denied listing packages/"):
        registry.list_names()
    with pytest.raises(RegistryError, match=r"access denied reading packages/tiny/0\.1\.0\.json"):
        pull_package("tiny:0.1.0", registry, tmp_path / "out", BlobCache(tmp_path / "c"))


def test_unknown_credentials_say_so(iam_s3):
    endpoint, _ = iam_s3
    with pytest.raises(RegistryError, match=r"the endpoint rejected the credentials \(InvalidAccessKeyId\)"):
        open_registry("s3://locked", endpoint).list_names()


def test_a_fresh_prefix_is_an_empty_registry(s3_endpoint, s3_bucket):
    registry = open_registry(f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_endpoint)
    assert registry.list_names() == [] and registry.list_versions("tiny") == []
    assert registry.read_index("tiny", "0.1.0") is None and registry.blob_size("0" * 64) is None


def test_prefixes_keep_registries_apart(s3_endpoint, s3_client, s3_bucket, make_package):
    push_package(make_package(), open_registry(f"s3://{s3_bucket}/a", s3_endpoint))
    assert open_registry(f"s3://{s3_bucket}/b", s3_endpoint).list_names() == []
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert all(key.startswith("a/") for key in keys)


def test_path_style_requests_for_custom_endpoints(tmp_path: Path):
    registry = S3Registry("s3://bucket", "http://127.0.0.1:9")
    assert registry._client.meta.config.s3["addressing_style"] == "path"
