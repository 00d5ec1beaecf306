"""Package registries (a local directory or S3): content-addressed blobs plus one lock per version."""

from ember.registry.base import Registry, blob_key, index_key, short_digest
from ember.registry.cache import BlobCache
from ember.registry.checkout import Checkout, checkout
from ember.registry.connect import open_registry
from ember.registry.local import LocalRegistry
from ember.registry.reference import parse_reference, sort_versions
from ember.registry.transfer import (
    PackageInfo,
    PullResult,
    PushResult,
    VersionConflict,
    dev_version,
    list_packages,
    pull_package,
    push_package,
    resolve,
)

__all__ = [
    "BlobCache",
    "Checkout",
    "LocalRegistry",
    "PackageInfo",
    "PullResult",
    "PushResult",
    "Registry",
    "VersionConflict",
    "blob_key",
    "checkout",
    "dev_version",
    "index_key",
    "list_packages",
    "open_registry",
    "parse_reference",
    "pull_package",
    "push_package",
    "resolve",
    "short_digest",
    "sort_versions",
]
