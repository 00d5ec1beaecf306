"""API keys at the gateway: the key store (`ember.keys`, shared with `ember keys ...`) and the admin key.

One key may be the admin key, required for `/admin/...`; `EMBER_ADMIN_KEY` supplies one without storing it.
"""

from __future__ import annotations

import hmac
import os

from ember.keys import KEY_PREFIX, KEYS_FILE, KeyRecord, KeyStore, hash_key

__all__ = ["ADMIN_KEY_ENV", "KEYS_FILE", "KEY_PREFIX", "Authenticator", "KeyRecord", "KeyStore"]

ADMIN_KEY_ENV = "EMBER_ADMIN_KEY"


class Authenticator:
    """Checks bearer tokens against the key store and the admin key from the environment."""

    def __init__(self, store: KeyStore, admin_key: str | None = None) -> None:
        self.store = store
        self._admin_hash = hash_key(admin_key) if admin_key else None

    @classmethod
    def from_env(cls, store: KeyStore) -> Authenticator:
        return cls(store, os.environ.get(ADMIN_KEY_ENV) or None)

    def authenticate(self, key: str) -> KeyRecord | None:
        record = self.store.verify(key)
        if self._admin_hash is not None and hmac.compare_digest(self._admin_hash, hash_key(key)):
            record = KeyRecord(ADMIN_KEY_ENV, self._admin_hash, 0.0, admin=True)
        return record
