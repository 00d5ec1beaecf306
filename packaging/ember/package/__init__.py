"""Model packages: build (lock), verify, and scaffold from a Hugging Face checkpoint."""

from ember.package.build import build_package, lock_package
from ember.package.lock import LOCK_NAME, Lock, LockedFile, check_safe_path, hash_file
from ember.package.scaffold import init_package
from ember.package.verify import read_lock, verify_package

__all__ = [
    "LOCK_NAME",
    "Lock",
    "LockedFile",
    "build_package",
    "check_safe_path",
    "hash_file",
    "init_package",
    "lock_package",
    "read_lock",
    "verify_package",
]
