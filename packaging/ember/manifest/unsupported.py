"""Settings the manifest accepts but nothing in Ember consumes yet: refused ("not supported yet: ..."), never
silently ignored.

Each entry is one setting and what it lacks. When the feature lands, the change that makes it work deletes its
entry here (and its case in tests/ember/test_unsupported.py). `refuse_unsupported` runs on every manifest that is
parsed (`ember build`, `ember verify`, a replica's or `LLM`'s load, overrides included, a deploy);
`refuse_unconsumed_selection` on what the selection hooks chose, where a plugin's answer can ask for the same
things.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.errors import ManifestError, PluginError
from ember.manifest.schema import NONE, Manifest

if TYPE_CHECKING:
    from ember.selection import SelectionReport


@dataclass(frozen=True, slots=True)
class Unsupported:
    """One setting nothing reads yet: its dotted key, whether a manifest asks for it, and what is missing."""

    key: str
    asked: Callable[[Manifest], bool]
    missing: str


_DISAGGREGATION = "no launcher starts prefill and decode replicas and nothing moves KV blocks between them"
_ONE_DEVICE = ("parallel strategy 'none' runs the model on one device; set [parallelism] strategy to an installed "
               "parallel-strategy plugin")

UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("serving.disaggregated", lambda m: m.serving.disaggregated,
                f"disaggregated prefill/decode ({_DISAGGREGATION}); remove the key"),
    Unsupported("serving.prefill_replicas", lambda m: m.serving.prefill_replicas != 1,
                f"prefill replicas ({_DISAGGREGATION}); remove the key"),
    Unsupported("serving.decode_replicas", lambda m: m.serving.decode_replicas != 1,
                f"decode replicas ({_DISAGGREGATION}); remove the key"),
    Unsupported("parallelism.tensor_parallel",
                lambda m: m.parallelism.strategy == NONE and m.parallelism.tensor_parallel > 1, _ONE_DEVICE),
    Unsupported("parallelism.expert_parallel",
                lambda m: m.parallelism.strategy == NONE and m.parallelism.expert_parallel > 1, _ONE_DEVICE),
)


def refuse_unsupported(manifest: Manifest, source: str) -> None:
    """ManifestError naming `source` and every key of `manifest` that asks for something Ember cannot do yet."""
    problems = [f"{u.key}: not supported yet: {u.missing}" for u in UNSUPPORTED if u.asked(manifest)]
    if len(problems) == 1:
        raise ManifestError(f"{source}: {problems[0]}")
    if problems:
        raise ManifestError(f"{source}: {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))


def refuse_unconsumed_selection(report: SelectionReport, manifest: Manifest) -> None:
    """PluginError when a selection asks for what nothing reads: several devices with parallel strategy 'none'."""
    p = manifest.parallelism
    if report.kind == "parallelism" and report.name == NONE and (p.tensor_parallel > 1 or p.expert_parallel > 1):
        raise PluginError(f"{report.decided_by} chose parallel strategy 'none' for tensor_parallel = "
                          f"{p.tensor_parallel}, expert_parallel = {p.expert_parallel}: not supported yet: "
                          f"{_ONE_DEVICE}")
