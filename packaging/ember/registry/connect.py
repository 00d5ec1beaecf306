"""`open_registry`: a registry URL (or the configured default) to a Registry."""

from __future__ import annotations

import os
import re

from ember.errors import RegistryError
from ember.registry.base import Registry
from ember.registry.local import LocalRegistry

DEFAULT_REGISTRY = "~/.ember/registry"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def open_registry(url: str | None = None, endpoint_url: str | None = None) -> Registry:
    """`s3://bucket/prefix` or a directory path (`file://` optional).

    Without a URL: `$EMBER_REGISTRY`, else ~/.ember/registry. The S3 endpoint is `endpoint_url`,
    else `$AWS_ENDPOINT_URL`, else AWS; credentials are found the usual boto3 way.
    """
    url = url or os.environ.get("EMBER_REGISTRY") or DEFAULT_REGISTRY
    if url.startswith("s3://"):
        from ember.registry.s3 import S3Registry  # boto3 takes a while to import; local needs none

        return S3Registry(url, endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None)
    if endpoint_url:
        raise RegistryError(f"{url}: --endpoint-url applies only to s3:// registries")
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    elif _SCHEME.match(url):
        raise RegistryError(f"{url}: unsupported registry URL; use a directory path or s3://BUCKET/PREFIX")
    return LocalRegistry(url)
