"""The generic checkpoint loader: Hugging Face safetensors (one file or sharded with an index) into a model.

The model is built on the meta device; loading allocates each parameter once, empty, on the
model's device when its first tensor arrives, and copies the memory-mapped checkpoint tensor into it,
so a checkpoint is read once and never held twice. How each checkpoint tensor lands in the model is
the model's business (`model.checkpoint_target(name)` and each parameter's `weight_loader`).

The file is mapped by `SafetensorsFile` rather than `safe_open` so that the pages of each tensor leave the
process (madvise DONTNEED) once it is copied: a mapping keeps every page it touched resident, which on a
bf16 checkpoint added the checkpoint's whole size to the peak memory of a load, and would have hidden what
quantizing on load saves.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember_platform.engine.host_memory import trim_heap
from ember_platform.engine.models.layers import default_weight_loader

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """What `load_weights` read: the files, how many tensors, how many bytes; seconds spent finalizing layers
    (their methods' `after_loading`: quantizing on load)."""

    files: tuple[Path, ...]
    num_tensors: int
    num_bytes: int
    finalize_s: float = 0.0


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_PAGE = mmap.PAGESIZE


class SafetensorsFile:
    """A read-only memory map of one safetensors file: `get(name)` is a zero-copy tensor over the mapping,
    `release(name)` drops its pages from this process (they are re-read from the file if touched again)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not a safetensors file ({e})") from None
            size = path.stat().st_size
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        header.pop("__metadata__", None)
        self.header: dict[str, dict] = header
        self.base = 8 + header_len

    def names(self) -> list[str]:
        """Tensor names in file order (reads go front to back)."""
        return sorted(self.header, key=lambda name: self.header[name]["data_offsets"][0])

    def _span(self, name: str) -> tuple[int, int]:
        start, end = self.header[name]["data_offsets"]
        return self.base + start, self.base + end

    def get(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor '{name}' has dtype {info['dtype']}, which this loader does not read")
        shape, (start, end) = info["shape"], self._span(name)
        count = end - start
        if end > (len(self._map) if self._map is not None else 0) and count:
            raise ValueError(f"{self.path}: truncated (tensor '{name}' ends at byte {end}, past the end of the file)")
        if count == 0 or self._map is None:
            return torch.empty(shape, dtype=dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        with warnings.catch_warnings():  # read-only on purpose: nothing writes through these views
            warnings.filterwarnings("ignore", message=".*not writable.*")
            if start % itemsize:  # a misaligned tensor: read it out rather than view it
                return torch.frombuffer(bytearray(self._map[start:end]), dtype=dtype).reshape(shape)
            return torch.frombuffer(self._map, dtype=dtype, count=count // itemsize, offset=start).reshape(shape)

    def release(self, name: str) -> None:
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):  # not a platform with madvise: pages stay
            return
        start, end = self._span(name)
        first = (start + _PAGE - 1) // _PAGE * _PAGE  # whole pages only: neighbours may share the edges
        if end - first >= _PAGE:
            self._map.madvise(mmap.MADV_DONTNEED, first, (end - first) // _PAGE * _PAGE)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a tensor still views it (a loader kept one): unmapped later
                self._map.close()


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those the index names, or the single file."""
    root = Path(checkpoint_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (expected a 'weight_map' object): {e}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not there: {', '.join(missing)}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (only safetensors checkpoints are supported; "
                                "convert .bin/.pt checkpoints with transformers' save_pretrained)")
    return files


def _materialized(param: nn.Parameter, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """`param` (on meta) as uninitialized storage on `device`: floating point in `dtype` unless its method fixed
    the dtype (`fixed_dtype`: int8 weights, float32 scales), others as they are; attributes (its `weight_loader`)
    carry over."""
    new_dtype = dtype if param.is_floating_point() and not getattr(param, "fixed_dtype", False) else param.dtype
    new = nn.Parameter(torch.empty(param.shape, dtype=new_dtype, device=device), requires_grad=False)
    new.__dict__.update(param.__dict__)
    return new


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter still on the meta device uninitialized storage on `device` (see `_materialized`).
    A parameter shared by two modules (tied embeddings) stays shared."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if id(param) not in done:
                done[id(param)] = _materialized(param, device, dtype)
            setattr(module, name, done[id(param)])


class _Slots:
    """Where each parameter lives (every module and attribute holding it: tied ones have two) and which module
    finalizes it, by the parameter's name: a parameter is materialized only when its first checkpoint tensor
    arrives, and a layer is finalized as soon as its last one is in, so that a quantizing method never holds
    more than one full-precision layer at a time."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        name_of = {id(p): name for name, p in self.params.items()}
        self.owners: dict[str, list[tuple[nn.Module, str]]] = defaultdict(list)
        self.finisher: dict[str, nn.Module] = {}  # parameter -> the module to finalize once it is complete
        for module in model.modules():
            for attr, param in module.named_parameters(recurse=False):
                self.owners[name_of[id(param)]].append((module, attr))
                if hasattr(module, "finish_loading"):
                    self.finisher[name_of[id(param)]] = module
        self.members: dict[int, list[str]] = defaultdict(list)  # id(module) -> the parameters it finalizes
        for name, module in self.finisher.items():
            self.members[id(module)].append(name)
        self.waiting = {key: set(names) for key, names in self.members.items()}  # ... not complete yet
        self.finalize_s = 0.0

    def materialize(self, name: str, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
        new = self.params[name] = _materialized(self.params[name], device, dtype)
        for module, attr in self.owners[name]:
            setattr(module, attr, new)
        return new

    def completed(self, name: str) -> None:
        """Parameter `name` is filled: finalize its module if that was the module's last one."""
        module = self.finisher.get(name)
        if module is None:
            return
        waiting = self.waiting[id(module)]
        waiting.discard(name)
        if not waiting:
            for member in self.members[id(module)]:  # hold no reference to what the method may free
                self.params.pop(member, None)
            t0 = time.perf_counter()
            module.finish_loading()
            if module.frees_memory():
                trim_heap()  # what the method freed (a full-precision copy) leaves the process now
            self.finalize_s += time.perf_counter() - t0


def load_weights(model: nn.Module, checkpoint_dir: str | Path, *, strict: bool = True,
                 finalize: bool = True) -> LoadedWeights:
    """Fill `model` (built on the meta device by `build_model`) from a safetensors checkpoint.

    The model provides `dtype`, `device` and `checkpoint_target(name) -> (param_name, shard_id) |
    None`; each parameter's optional `weight_loader(param, tensor, shard_id)` copies the tensor in.

    Every parameter must be filled completely; with `strict`, every checkpoint tensor must have a
    place in the model (the model may skip some on purpose, e.g. rotary buffers). A module with a
    `finish_loading()` (a `Linear`: its method's `after_loading`) is finalized as soon as its parameters are
    complete, or, with `finalize=False`, left for the caller (`linear_method.finish_loading`, after calibration).
    """
    files = checkpoint_files(checkpoint_dir)
    device, dtype = torch.device(model.device), model.dtype
    slots = _Slots(model)
    expected = {name: param.numel() for name, param in slots.params.items()}
    filled: dict[str, int] = defaultdict(int)
    num_tensors = num_bytes = 0
    for path in files:
        f = SafetensorsFile(path)
        try:
            for name in f.names():
                target = model.checkpoint_target(name)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in expected:
                    if strict:
                        raise ValueError(f"{path}: tensor '{name}' has no place in {type(model).__name__} "
                                         f"(it maps to '{param_name}'); is this checkpoint for another architecture?")
                    continue
                param = slots.params.get(param_name)
                if param is None:
                    raise ValueError(f"{path}: tensor '{name}' -> parameter '{param_name}': given again after its "
                                     "layer was complete")
                if param.is_meta:
                    param = slots.materialize(param_name, device, dtype)
                tensor = f.get(name)
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{path}: tensor '{name}' -> parameter '{param_name}': {e}") from None
                filled[param_name] += tensor.numel()
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
                del param, tensor
                f.release(name)
                if finalize and filled[param_name] >= expected[param_name]:
                    slots.completed(param_name)
        finally:
            f.close()
    incomplete = [name for name, count in expected.items() if filled[name] < count]
    if incomplete:
        shown = ", ".join(incomplete[:8]) + (f" and {len(incomplete) - 8} more" if len(incomplete) > 8 else "")
        raise ValueError(f"checkpoint {checkpoint_dir} does not provide (all of) these parameters: {shown}")
    return LoadedWeights(tuple(files), num_tensors, num_bytes, slots.finalize_s)
