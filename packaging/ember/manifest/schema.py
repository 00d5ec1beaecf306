"""The `ember.toml` schema: one pydantic model per manifest section.

Every key has a default except `[model] name` and `version`. Unknown keys are errors
(`extra="forbid"`); `ember.manifest.load` turns them into "did you mean" messages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

AUTO = "auto"
NONE = "none"

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_duration(value: Any) -> float:
    """Seconds from a number of seconds or a string such as "90s", "5m", "1.5h", "250ms"."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 300, \"30s\", \"5m\" or \"1h\"")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION_RE.match(str(value))
        if not match:
            raise ValueError(f"expected a duration such as 300, \"30s\", \"5m\" or \"1h\", got {value!r}")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # nan or inf (TOML has both, and "9" * 400 overflows): no usable duration
        raise ValueError(f"must be a finite number of seconds, got {value!r}")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


def _package_dir(info: ValidationInfo) -> Path | None:
    ctx = info.context or {}
    pkg = ctx.get("package_dir")
    return Path(pkg) if pkg is not None else None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelSection(Section):
    """[model]: what the package is."""

    name: str = Field(description="Package name: lowercase letters, digits, '.', '_' or '-'.")
    version: str = Field(description="Package version, e.g. \"1.0.0\". Versions are immutable in a registry.")
    weights: str = Field("weights", description="Directory (relative to the package) with the Hugging Face "
                         "checkpoint: config.json, *.safetensors, tokenizer files.")
    description: str = Field("", description="One line about the model, shown by the gateway's /models/NAME/info.")
    license: str | None = Field(None, description="The weights' license, e.g. \"apache-2.0\" (shown by "
                                "/models/NAME/info).")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid package name: use lowercase letters, digits, '.', '_' "
                             "and '-', starting with a letter or digit (at most 64 characters)")
        return v

    @field_validator("version")
    @classmethod
    def _check_version(cls, v: str) -> str:
        if not _VERSION_RE.match(v):
            raise ValueError(f"{v!r} is not a valid version: use letters, digits, '.', '+', '_' and '-', "
                             "e.g. \"1.0.0\"")
        return v

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, v: str, info: ValidationInfo) -> str:
        _check_relative(v)
        pkg = _package_dir(info)
        if pkg is not None and not _probe(pkg / v, Path.is_dir):
            raise ValueError(f"weights directory {v!r} does not exist in the package")
        return v


class RuntimeSection(Section):
    """[runtime]: how the engine runs the model."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Compute dtype; \"auto\" takes the checkpoint's torch_dtype (bfloat16 if absent).")
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + output in tokens; default: the model's max_position_embeddings.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences decoded in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one engine step (decode tokens + chunked prefill).")
    kv_block_size: int = Field(16, description="Tokens per KV-cache block: a power of two from 1 to 256.")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto", description="How the KV cache stores keys and values: \"auto\" in the compute dtype, \"int8\" or "
        "\"fp8\" (e4m3) quantized with a float32 scale per token and KV head (about half the memory of bfloat16, "
        "so twice the blocks; the attention backend must support it: 'torch' does, others say which they take).")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="Memory for the KV cache in GiB; default: a fraction of free device memory.")
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of free GPU memory the KV cache may use when kv_cache_memory_gb "
        "is not set (on a CPU, which shares host RAM, the KV cache takes min(4 GiB, a quarter of RAM) instead).")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of prompt prefixes seen before.")
    accelerator: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device to run on; \"auto\" uses a GPU when one is present.")
    seed: int = Field(0, description="Seed for requests that give none.")

    @field_validator("kv_block_size")
    @classmethod
    def _check_block(cls, v: int) -> int:
        if not (_is_power_of_two(v) and v <= 256):
            raise ValueError(f"must be a power of two from 1 to 256, got {v}")
        return v

    @model_validator(mode="after")
    def _check_budget(self) -> RuntimeSection:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes one "
                             "token per step")
        return self


COMPOSE = "+"  # how a composition of quantization methods is named once read: "smooth+int8"


class QuantizationSection(Section):
    """[quantization]: a quantizer plugin by name, several composed in order, "auto", or "none"."""

    method: str = Field(NONE, description="A quantization plugin's name, \"auto\" (hardware-aware plugins "
                        "decide), \"none\", or a list of names composed in order (e.g. [\"smooth\", \"int8\"]: the "
                        "last stores the weights, the ones before it transform them), kept as \"smooth+int8\".")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the quantizer; with several "
                                    "methods, one table per method name ([quantization.options.int8]).")

    @field_validator("method", mode="before")
    @classmethod
    def _compose(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        names = [str(name) for name in v]
        if not names:
            raise ValueError(f"an empty list of methods; for full precision write \"{NONE}\"")
        if any(name in (AUTO, NONE) or COMPOSE in name for name in names):
            raise ValueError(f"a list of methods names plugins, not \"{AUTO}\", \"{NONE}\" or names with '{COMPOSE}'")
        if len(set(names)) != len(names):
            raise ValueError(f"a method is listed twice: {names}")
        return COMPOSE.join(names)


class SpeculatorSection(Section):
    """[speculator]: speculative decoding."""

    method: str = Field(NONE, description="A speculator plugin's name (e.g. \"ngram\"), \"auto\" or \"none\".")
    num_speculative_tokens: int = Field(4, description="Tokens proposed per step, 1 to 16.")
    max_batch_size: int | None = Field(None, ge=1, description="A ceiling: no drafts while more sequences than this "
                                       "run. Unset (the default): no ceiling; the measured cost of drafting at the "
                                       "current batch size decides (adaptive), and drafts stop where they do not pay.")
    adaptive: bool = Field(True, description="Choose each step's draft length (0 to num_speculative_tokens) from "
                           "measured acceptance and the measured cost of a target pass at the current batch size, so "
                           "that speculation never slows decoding down; false: always num_speculative_tokens.")
    model: str | None = Field(None, description="Directory (relative to the package) of a draft model, "
                              "Medusa heads or EAGLE head, for speculators that need one.")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the speculator.")

    @field_validator("num_speculative_tokens")
    @classmethod
    def _check_k(cls, v: int) -> int:
        if not 1 <= v <= 16:
            raise ValueError(f"must be from 1 to 16, got {v}")
        return v

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        _check_relative(v)
        pkg = _package_dir(info)
        if pkg is not None and not _probe(pkg / v, Path.exists):
            raise ValueError(f"speculator model {v!r} does not exist in the package")
        return v


class ParallelismSection(Section):
    """[parallelism]: how one replica spreads over devices."""

    strategy: str = Field(AUTO, description="A parallel-strategy plugin's name, \"auto\" or \"none\".")
    tensor_parallel: int = Field(1, description="Devices each layer is split over: a power of two.")
    expert_parallel: int = Field(1, description="Devices the experts of an MoE model are spread over: a "
                                 "power of two.")

    @field_validator("tensor_parallel", "expert_parallel")
    @classmethod
    def _check_pow2(cls, v: int) -> int:
        if not (_is_power_of_two(v) and v <= 64):
            raise ValueError(f"must be a power of two from 1 to 64, got {v}")
        return v


class KernelsSection(Section):
    """[kernels]: which attention backend runs the paged attention."""

    attention: str = Field(AUTO, description="An attention-backend plugin's name (e.g. \"torch\") or \"auto\".")
    options: dict[str, Any] = Field(default_factory=dict, description="Options for the attention backend, "
                                    "passed to it as keyword arguments; a key the backend does not declare that it "
                                    "reads is refused (the torch backend reads max_batched_query_len, "
                                    "chunk_elements, native).")


class ScalingSection(Section):
    """[scaling]: replicas and the autoscaler."""

    min_replicas: int = Field(1, ge=0, description="0 lets the deployment scale to zero when idle.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the autoscaler may run.")
    target_concurrency: int = Field(32, ge=1, description="In-flight requests per replica the autoscaler "
                                    "aims for.")
    scale_down_delay: float = Field(900.0, description="Idle time before a replica is removed: seconds or "
                                    "a string such as \"15m\".")
    prewarm: bool = Field(False, description="Start a replica at deploy time even when min_replicas = 0.")

    @field_validator("scale_down_delay", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @model_validator(mode="after")
    def _check_range(self) -> ScalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas "
                             f"({self.max_replicas})")
        return self


class LoraEntry(Section):
    """[[lora]]: one LoRA adapter in PEFT layout (adapter_config.json + adapter_model.safetensors)."""

    name: str = Field(description="The adapter's name; requests pick it with \"model\": \"PACKAGE:NAME\".")
    path: str = Field(description="Directory (relative to the package) holding the adapter.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid adapter name: use lowercase letters, digits, '.', '_' "
                             "and '-'")
        return v

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str, info: ValidationInfo) -> str:
        _check_relative(v)
        pkg = _package_dir(info)
        if pkg is not None:
            adapter = pkg / v
            if not _probe(adapter, Path.is_dir):
                raise ValueError(f"adapter directory {v!r} does not exist in the package")
            if not _probe(adapter / "adapter_config.json", Path.is_file):
                raise ValueError(f"adapter directory {v!r} has no adapter_config.json (PEFT layout expected)")
        return v


class ServingSection(Section):
    """[serving]: request handling (disaggregated prefill/decode is reserved: not supported yet)."""

    disaggregated: bool = Field(False, description="Not supported yet (true is refused): run prefill and decode "
                                "on separate replicas joined by the KV block transfer.")
    prefill_replicas: int = Field(1, ge=1, description="Not supported yet (other than 1 is refused): prefill "
                                  "replicas when disaggregated.")
    decode_replicas: int = Field(1, ge=1, description="Not supported yet (other than 1 is refused): decode "
                                 "replicas when disaggregated.")
    request_timeout: float = Field(600.0, description="Longest a request may run: seconds or \"10m\".")
    max_queue: int = Field(256, ge=0, description="Requests that may wait in the gateway for a running place "
                           "(beyond max_num_seqs per ready replica, or for a replica to start) before 429s.")
    queue_timeout: float | None = Field(None, description="Longest a request may wait in that queue before a 503 "
                                        "with Retry-After: seconds or \"30s\" (default: request_timeout).")
    max_concurrency_per_key: int | None = Field(None, ge=1, description="Requests one API key may have running or "
                                                "waiting on this model at once, beyond which it gets 429s "
                                                "(default: half of what the model admits).")

    @field_validator("request_timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("queue_timeout", mode="before")
    @classmethod
    def _optional_duration(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)


class ChatSection(Section):
    """[chat]: how the chat API reads this model's output."""

    tool_parser: str = Field(AUTO, description="The tool-call parser plugin that reads the model's tool calls "
                             "(\"hermes\", \"llama3_json\", \"mistral\", ...), \"auto\" (the one parser whose "
                             "format the chat template writes, if exactly one does) or \"none\" (requests with "
                             "tools are refused).")


class Manifest(Section):
    """A whole `ember.toml`."""

    model: ModelSection
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    speculator: SpeculatorSection = Field(default_factory=SpeculatorSection)
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    lora: list[LoraEntry] = Field(default_factory=list)
    serving: ServingSection = Field(default_factory=ServingSection)
    chat: ChatSection = Field(default_factory=ChatSection)

    @model_validator(mode="after")
    def _check_unique_adapters(self) -> Manifest:
        seen: set[str] = set()
        for entry in self.lora:
            if entry.name in seen:
                raise ValueError(f"two [[lora]] entries are named {entry.name!r}")
            seen.add(entry.name)
        return self

    @property
    def reference(self) -> str:
        return f"{self.model.name}:{self.model.version}"


def _probe(path: Path, test: Callable[[Path], bool]) -> bool:
    """`test(path)`, with the errors pathlib lets through (a name too long, a directory it may not read) as a
    ValueError, so the manifest's error names the key instead of the loader failing."""
    try:
        return test(path)
    except OSError as e:
        raise ValueError(f"cannot check {path.name[:40]!r}: {e.strerror or e}") from None


def _check_relative(path: str) -> None:
    p = Path(path)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{path!r} must be a path inside the package (relative, without '..')")
