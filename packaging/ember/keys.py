"""API keys for `ember serve`: `ember-sk-...` secrets stored only as sha256 hashes (with a name and a creation time)
in keys.json under the serve home.

Here in `ember`, not in the platform, because `ember keys create|revoke|list` runs on machines without the
platform installed; the gateway reads the same file (ember_platform/gateway/auth.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.errors import EmberError

KEY_PREFIX = "ember-sk-"
ADMIN_KEY_NAME = "admin"
KEYS_FILE = "keys.json"
DEFAULT_HOME = "~/.ember"


def serve_home() -> Path:
    """Where `ember serve` keeps its state (API keys, pulled packages, replica logs): `$EMBER_HOME/serve`, else
    ~/.ember/serve (not created here)."""
    return Path(os.environ.get("EMBER_HOME") or DEFAULT_HOME).expanduser() / "serve"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeyRecord:
    name: str
    sha256: str
    created: float
    admin: bool = False


class KeyStore:
    """keys.json, re-read whenever it changes on disk, so `ember keys create|revoke` applies to a running gateway."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._records: list[KeyRecord] = []
        self._stamp: tuple[int, int] | None = None

    @classmethod
    def default(cls) -> KeyStore:
        return cls(serve_home() / KEYS_FILE)

    def records(self) -> list[KeyRecord]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._records, self._stamp = [], None
            return []
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._records, self._stamp = self._load(), stamp
        return list(self._records)

    def _load(self) -> list[KeyRecord]:
        try:
            data = json.loads(self.path.read_text())
            return [KeyRecord(str(k["name"]), str(k["sha256"]), float(k["created"]), bool(k.get("admin", False)))
                    for k in data["keys"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EmberError(f"{self.path}: unreadable key file ({e}); fix it or move it away to start over") \
                from None

    def _save(self, records: list[KeyRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": [asdict(r) for r in records]}, f, indent=2)
            f.write("\n")
        os.replace(tmp, self.path)

    def create(self, name: str | None = None, *, admin: bool = False) -> str:
        """A new key: returned once, stored only as its hash."""
        records = self.records()
        names = {r.name for r in records}
        if name is None:
            name = next(f"key-{i}" for i in range(1, len(records) + 2) if f"key-{i}" not in names)
        elif name in names:
            raise EmberError(f"a key named {name!r} exists already in {self.path}; revoke it first or choose "
                             "another --name")
        key = new_key()
        self._save([*records, KeyRecord(name, hash_key(key), time.time(), admin)])
        return key

    def revoke(self, key_or_name: str) -> list[KeyRecord]:
        """Remove the key with this value or this name; returns what was removed."""
        records = self.records()
        digest = hash_key(key_or_name)
        gone = [r for r in records if r.name == key_or_name or hmac.compare_digest(r.sha256, digest)]
        if not gone:
            raise EmberError(f"no key named {key_or_name!r} (and no key with that value) in {self.path}")
        self._save([r for r in records if r not in gone])
        return gone

    def verify(self, key: str) -> KeyRecord | None:
        """The record of `key`, or None. Every stored hash is compared, in constant time, whatever matches."""
        digest = hash_key(key)
        found = None
        for record in self.records():
            if hmac.compare_digest(record.sha256, digest):
                found = record
        return found

    def ensure_admin_key(self) -> str | None:
        """Create the admin key unless one is stored; returns the new key (to print once), else None."""
        if any(r.admin for r in self.records()):
            return None
        name = ADMIN_KEY_NAME if all(r.name != ADMIN_KEY_NAME for r in self.records()) else None
        return self.create(name, admin=True)
