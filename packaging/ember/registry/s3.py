"""A registry in an S3 bucket (AWS, MinIO, R2: any endpoint_url), through boto3.

Every botocore failure is turned into a one-line RegistryError here, so callers and the CLI never
show a boto3 traceback for an endpoint that is down, a bucket that does not exist, or a denial.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from ember.errors import PackageError, RegistryError
from ember.registry.base import OnBytes, Registry, blob_key, index_key
from ember.registry.local import missing_blob, size_mismatch

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNKSIZE = 16 << 20  # S3 needs parts of at least 5 MiB (except the last)
PARALLEL_BLOBS = 8
PARTS_PER_BLOB = 4

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_DENIED = frozenset({"403", "AccessDenied", "Forbidden", "AllAccessDisabled", "AccountProblem"})
_BAD_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                              "InvalidToken", "TokenRefreshRequired"})


class S3Registry(Registry):
    parallelism = PARALLEL_BLOBS

    def __init__(self, url: str, endpoint_url: str | None = None, *,
                 multipart_threshold: int = MULTIPART_THRESHOLD,
                 multipart_chunksize: int = MULTIPART_CHUNKSIZE) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise RegistryError(f"{url!r} is not an S3 registry URL: expected s3://BUCKET[/PREFIX]")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=PARALLEL_BLOBS * PARTS_PER_BLOB,
            # MinIO and most self-hosted stores only answer path-style requests.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        except ValueError as e:  # botocore rejects a malformed endpoint URL this way
            raise RegistryError(f"{self.url}: bad endpoint URL {endpoint_url!r}: {e}") from None
        except BotoCoreError as e:
            raise RegistryError(f"{self.url}: {e}") from None
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                        multipart_chunksize=multipart_chunksize,
                                        max_concurrency=PARTS_PER_BLOB)

    @property
    def endpoint_url(self) -> str:
        return str(self._client.meta.endpoint_url)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def blob_size(self, hexdigest: str) -> int | None:
        key = blob_key(hexdigest)
        with self._errors("checking", key):
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                # A HEAD has no body, so a missing bucket also reads as 404 here; the upload that
                # follows reports it properly as NoSuchBucket.
                if _code(e) in _NOT_FOUND:
                    return None
                raise
        return int(head["ContentLength"])

    def put_blob(self, hexdigest: str, source: Path, on_bytes: OnBytes | None = None) -> None:
        key = blob_key(hexdigest)
        with self._errors("uploading", key):
            self._client.upload_file(str(source), self.bucket, self._key(key),
                                     Config=self._transfer, Callback=on_bytes)

    def get_blob(self, hexdigest: str, size: int, dest: Path, on_bytes: OnBytes | None = None) -> None:
        key = blob_key(hexdigest)
        stored = self.blob_size(hexdigest)
        if stored is None:
            raise RegistryError(missing_blob(self.where(key)))
        if stored != size:
            # Checked before downloading, so a tampered registry cannot fill the disk.
            raise PackageError(size_mismatch(self.where(key), stored, size))
        with self._errors("downloading", key):
            self._client.download_file(self.bucket, self._key(key), str(dest),
                                       Config=self._transfer, Callback=on_bytes)

    def read_index(self, name: str, version: str) -> bytes | None:
        key = index_key(name, version)
        with self._errors("reading", key):
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if _code(e) in _NOT_FOUND:
                    return None
                raise
            return bytes(response["Body"].read())

    def write_index(self, name: str, version: str, data: bytes) -> None:
        key = index_key(name, version)
        with self._errors("writing", key):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                    ContentType="application/json")

    def list_names(self) -> list[str]:
        base = self._key("packages/")
        names = [p["Prefix"][len(base):].rstrip("/")
                 for page in self._list(base, delimiter="/") for p in page.get("CommonPrefixes", [])]
        return sorted(names)

    def list_versions(self, name: str) -> list[str]:
        base = self._key(f"packages/{name}/")
        return [obj["Key"][len(base):].removesuffix(".json")
                for page in self._list(base, delimiter="/") for obj in page.get("Contents", [])
                if obj["Key"].endswith(".json")]

    def _list(self, prefix: str, delimiter: str) -> list[Any]:
        with self._errors("listing", prefix.removeprefix(self.prefix)):
            paginator = self._client.get_paginator("list_objects_v2")
            return list(paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter=delimiter))

    @contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except (RegistryError, PackageError):
            raise
        except Exception as e:
            cause = _botocore_cause(e)
            if cause is None:
                raise
            raise RegistryError(self._describe(cause, action, key)) from None

    def _describe(self, error: Exception, action: str, key: str) -> str:
        if isinstance(error, EndpointConnectionError):
            reason = str(error.kwargs.get("error", ""))
            why = "connection refused" if "refused" in reason.lower() else (reason or "no answer")
            return f"{self.url}: cannot reach endpoint {self.endpoint_url} ({why})"
        if isinstance(error, ConnectTimeoutError | ReadTimeoutError):
            return f"{self.url}: endpoint {self.endpoint_url} timed out"
        if isinstance(error, NoCredentialsError | PartialCredentialsError):
            return (f"{self.url}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
        if isinstance(error, ClientError):
            code = _code(error)
            if code == "NoSuchBucket":
                return f"{self.url}: bucket {self.bucket!r} does not exist (at {self.endpoint_url})"
            if code in _DENIED:
                return f"{self.url}: access denied {action} {key} (check the credentials and bucket policy)"
            if code in _BAD_CREDENTIALS:
                return f"{self.url}: the endpoint rejected the credentials ({code})"
            message = error.response.get("Error", {}).get("Message", "")
            return f"{self.url}: {action} {key} failed: {code}{': ' + message if message else ''}"
        return f"{self.url}: {action} {key} failed: {error}"


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _botocore_cause(error: BaseException) -> Exception | None:
    """The botocore error behind `error`: boto3's transfer manager re-raises ClientErrors as
    S3UploadFailedError with the original only in the exception chain."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, BotoCoreError | ClientError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
