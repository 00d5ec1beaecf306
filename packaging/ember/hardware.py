"""What this machine can run on, detected once and handed to selection hooks.

Detection avoids importing torch (the base install has none): GPUs are read from
`nvidia-smi`, CPU features from /proc/cpuinfo.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field

# CPU flags that decide which kernels and quantization schemes are worth using.
_INTERESTING_CPU_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "neon", "asimd", "sve", "bf16", "i8mm",
)


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator device."""

    kind: str  # "cuda"
    name: str  # e.g. "NVIDIA H200"
    memory_bytes: int
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Hardware:
    """The machine a package will run on. `device_kind` is what the engine will use."""

    device_kind: str  # "cpu" or "cuda"
    device_name: str
    memory_bytes: int  # of the chosen device (host RAM for "cpu")
    compute_capability: tuple[int, int] | None
    cpu_features: frozenset[str]
    cpu_count: int
    host_memory_bytes: int
    accelerators: tuple[Accelerator, ...] = field(default=())

    @property
    def is_cuda(self) -> bool:
        return self.device_kind == "cuda"

    def has_compute_capability(self, major: int, minor: int = 0) -> bool:
        """True on a CUDA device of at least sm_{major}{minor} (e.g. (9, 0) for Hopper FP8)."""
        return self.compute_capability is not None and self.compute_capability >= (major, minor)

    def describe(self) -> str:
        gib = self.memory_bytes / 2**30
        cc = f", sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""
        return f"{self.device_kind}: {self.device_name} ({gib:.1f} GiB{cc})"

    @classmethod
    def cpu(cls, features: frozenset[str] = frozenset(), memory_bytes: int = 16 * 2**30) -> Hardware:
        """A CPU-only description, for tests and for forcing `accelerator = "cpu"`."""
        return cls("cpu", "cpu", memory_bytes, None, features, os.cpu_count() or 1, memory_bytes)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cpu_name_and_features() -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    return name, frozenset(flag for flag in _INTERESTING_CPU_FLAGS if flag in flags)


def _cuda_devices() -> tuple[Accelerator, ...]:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        name, mib, cap = parts
        try:
            major, minor = (int(x) for x in cap.split("."))
            devices.append(Accelerator("cuda", name, int(float(mib)) * 2**20, (major, minor)))
        except ValueError:
            devices.append(Accelerator("cuda", name, 0, None))
    return tuple(devices)


@functools.cache
def detect_hardware(accelerator: str = "auto") -> Hardware:
    """Describe this machine. `accelerator` is the manifest's choice: "auto", "cpu" or "cuda"."""
    cpu_name, features = _cpu_name_and_features()
    host = _host_memory_bytes()
    gpus = _cuda_devices() if accelerator != "cpu" else ()
    if gpus:
        first = gpus[0]
        return Hardware("cuda", first.name, first.memory_bytes, first.compute_capability,
                        features, os.cpu_count() or 1, host, gpus)
    return Hardware("cpu", cpu_name, host, None, features, os.cpu_count() or 1, host, ())
