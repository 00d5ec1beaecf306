"""ember.toml `[serving]`: the admission settings (queue_timeout, max_concurrency_per_key) and their checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import ManifestError
from ember.manifest import load_manifest

BASE = '[model]\nname = "tiny"\nversion = "0.1.0"\n[serving]\n'


def _load(pkg: Path, body: str) -> object:
    (pkg / "ember.toml").write_text(BASE + body)
    return load_manifest(pkg)


def test_admission_settings_default_to_the_request_timeout_and_half_of_what_the_model_admits(
        make_package) -> None:
    serving = _load(make_package(), "").serving  # type: ignore[attr-defined]
    assert serving.queue_timeout is None and serving.max_concurrency_per_key is None


def test_queue_timeout_is_a_duration_and_the_per_key_limit_a_positive_count(make_package) -> None:
    pkg = make_package()
    serving = _load(pkg, 'queue_timeout = "30s"\nmax_concurrency_per_key = 8\n').serving  # type: ignore[attr-defined]
    assert serving.queue_timeout == 30.0 and serving.max_concurrency_per_key == 8
    for body, key in (("max_concurrency_per_key = 0\n", "serving.max_concurrency_per_key"),
                      ('queue_timeout = "soon"\n', "serving.queue_timeout"),
                      ("max_concurency_per_key = 8\n", "max_concurency_per_key")):
        with pytest.raises(ManifestError) as info:
            _load(pkg, body)
        assert key in str(info.value)
