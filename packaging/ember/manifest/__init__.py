"""The `ember.toml` manifest: schema and loading."""

from ember.manifest.load import MANIFEST_NAME, load_manifest, parse_manifest
from ember.manifest.schema import (
    AUTO,
    NONE,
    ChatSection,
    KernelsSection,
    LoraEntry,
    Manifest,
    ModelSection,
    ParallelismSection,
    QuantizationSection,
    RuntimeSection,
    ScalingSection,
    ServingSection,
    SpeculatorSection,
    parse_duration,
)

__all__ = [
    "AUTO",
    "MANIFEST_NAME",
    "NONE",
    "ChatSection",
    "KernelsSection",
    "LoraEntry",
    "Manifest",
    "ModelSection",
    "ParallelismSection",
    "QuantizationSection",
    "RuntimeSection",
    "ScalingSection",
    "ServingSection",
    "SpeculatorSection",
    "load_manifest",
    "parse_duration",
    "parse_manifest",
]
