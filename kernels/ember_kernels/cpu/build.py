"""Compile `*.c` kernels into one shared library, once per (source, flags, CPU), and load it."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "quantized_linear.c", "dense_linear.c", "fused_ops.c", "int4_linear.c",
           "eagle3_draft.c", "draft_llama.c", "amx_gemm.c", "hadamard.c")
HEADERS = ("simd.h", "draft_ops.h")  # included by the sources: part of the cache key
# -march=native: the library is built on the machine that runs it (the cache key includes the CPU).
# No -ffast-math: it would let the compiler drop the -inf handling the softmax relies on.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_error: str | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("EMBER_KERNEL_CACHE") or Path.home() / ".cache" / "ember" / "kernels"
    return Path(root)


def _build(compiler: str) -> Path:
    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    digest = hashlib.sha256()
    for part in (compiler, *FLAGS, _cpu_signature(), *(s.read_text() for s in sources),
                 *((here / h).read_text() for h in HEADERS)):
        digest.update(part.encode() + b"\0")
    target = _cache_dir() / digest.hexdigest()[:24] / "libember_cpu.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: another process building the same library at the same
    # time either sees nothing or a complete file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (the reason is in `native_library_error()`)."""
    global _library, _error, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get("EMBER_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
            _error = "disabled by EMBER_NATIVE_KERNELS"
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            _error = "no C compiler (cc, gcc or clang) on PATH"
        else:
            try:
                _library = ctypes.CDLL(str(_build(compiler)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = f"building the native CPU kernels failed: {e}"
        if _error:
            log.warning("native CPU kernels unavailable (%s); using the torch paths", _error)
        return _library


def native_library_error() -> str | None:
    native_library()
    return _error


_functions: dict[str, object] = {}


def native_function(name: str, argtypes: list[type], restype: type = ctypes.c_int) -> object | None:
    """The compiled kernel `name` with its ctypes signature set (once), or None without the library."""
    fn = _functions.get(name)
    if fn is None:
        lib = native_library()
        if lib is None:
            return None
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
        _functions[name] = fn
    return fn
