"""The checks of the quantization techniques' option values, in one place that needs no torch: the quantizers call
them when they are built, and `ember` calls them (registered as each technique's `check`) wherever it checks a
manifest (`ember explain`, `ember build`, an engine's start), so that a bad value is refused the same way, with
the same message naming the key, on a laptop without torch as on a replica.

Each `check_*(options, prefix)` takes a technique's own options table and the key it sits under
(`quantization.options`, or `quantization.options.<method>` in a composition), returns the values with their
defaults filled in, and raises `OptionValueError` (a `ValueError`) naming the first bad `prefix.key`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ember.errors import OptionValueError

PREFIX = "quantization.options"
INT4_GROUP_SIZES = (32, 64, 128)
INT4_DEFAULT_GROUP = 128
INT4_KERNELS = ("auto", "native", "int4pack", "triton", "dequant")
INT8_KERNELS = ("auto", "native", "fbgemm", "int8pack")
FP8_KERNELS = ("auto", "native", "torch")
FP8_ACTIVATIONS = ("none", "fp8")


def checked(check: Callable[[Mapping[str, Any], str], Any], options: Mapping[str, Any], prefix: str = PREFIX) -> Any:
    """`check(options, prefix)` as a quantizer runs it when it is built: a bad value is the engine's
    QuantizationError (a ValueError too), with the message ember gives for it."""
    try:
        return check(options, prefix)
    except OptionValueError as e:
        from ember_platform.api import QuantizationError  # here only: ember itself runs `check` without the platform

        raise QuantizationError(str(e)) from None


def _skip(options: Mapping[str, Any], prefix: str) -> tuple[str, ...]:
    skip = options.get("skip", ["lm_head"])
    if not isinstance(skip, list | tuple) or not all(isinstance(s, str) for s in skip):
        raise OptionValueError(f"{prefix}.skip = {skip!r}: a list of layer names, e.g. [\"lm_head\"]")
    return tuple(skip)


def _one_of(options: Mapping[str, Any], prefix: str, key: str, default: Any, allowed: tuple[Any, ...],
            technique: str) -> Any:
    value = options.get(key, default)
    if type(value) is not type(default) or value not in allowed:  # 128.0 or True for 1 would slip through `in`
        shown = ", ".join(repr(a) for a in allowed)
        raise OptionValueError(f"{prefix}.{key} = {value!r}: {technique} takes one of {shown}")
    return value


def _dense_threshold(options: Mapping[str, Any], prefix: str) -> int | None:
    threshold = options.get("dense_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)):
        raise OptionValueError(f"{prefix}.dense_threshold = {threshold!r}: a whole number of rows")
    return threshold


def check_int4(options: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """int4: group_size (32, 64, 128), symmetric (bool), kernel, skip."""
    return {"group_size": _one_of(options, prefix, "group_size", INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, "int4"),
            "symmetric": _one_of(options, prefix, "symmetric", True, (True, False), "int4"),
            "kernel": _one_of(options, prefix, "kernel", "auto", INT4_KERNELS, "int4"),
            "skip": _skip(options, prefix)}


def check_int8(options: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """int8: kernel, dense_threshold (an int; negative: never), skip."""
    kernel = options.get("kernel", "auto")
    if kernel not in INT8_KERNELS:
        raise OptionValueError(f"{prefix}.kernel: kernel {kernel!r} is not one of {', '.join(INT8_KERNELS)}")
    return {"kernel": kernel, "dense_threshold": _dense_threshold(options, prefix), "skip": _skip(options, prefix)}


def check_fp8(options: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """fp8: kernel, dense_threshold, activations ("none": weight-only, "fp8": W8A8), skip."""
    kernel, activations = options.get("kernel", "auto"), options.get("activations", "none")
    if kernel not in FP8_KERNELS:
        raise OptionValueError(f"{prefix}.kernel = {kernel!r}: fp8 kernels are {', '.join(FP8_KERNELS)}")
    if activations not in FP8_ACTIVATIONS:
        raise OptionValueError(f"{prefix}.activations = {activations!r}: fp8 takes {', '.join(FP8_ACTIVATIONS)} "
                               "(\"none\": weight-only, \"fp8\": W8A8)")
    return {"kernel": kernel, "dense_threshold": _dense_threshold(options, prefix), "activations": activations,
            "skip": _skip(options, prefix)}


ROTATION_SITES = ("calibrated", "all")


def check_rotation(options: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """rotation: seed (int >= 0), online (bool), kv_rotation (false only), candidates (int >= 1: seeds tried,
    the one whose int4-rounded model is closest to full precision on calibration text kept), search_group_size
    (the int4 groups that choice rounds in), sites ("calibrated", the default, or "all")."""
    seed, online, kv = (options.get(k, d) for k, d in (("seed", 0), ("online", True), ("kv_rotation", False)))
    candidates = options.get("candidates", 1)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise OptionValueError(f"{prefix}.seed = {seed!r}: a non-negative integer")
    if not isinstance(online, bool):
        raise OptionValueError(f"{prefix}.online = {online!r}: true or false")
    if kv is not False:
        raise OptionValueError(f"{prefix}.kv_rotation = {kv!r}: not supported yet (rotating q and k per head after "
                               "RoPE is not implemented); remove it or set false")
    if not isinstance(candidates, int) or isinstance(candidates, bool) or not 1 <= candidates <= 64:
        raise OptionValueError(f"{prefix}.candidates = {candidates!r}: how many seeds to try, 1 to 64")
    group = _one_of(options, prefix, "search_group_size", INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, "rotation")
    # "calibrated" by default: QuaRot's every-site rotation ("all") can make a model without outlier channels
    # quantize worse than no rotation (held-out perplexity on the example model, bench/eval_quantization.py).
    sites = options.get("sites", "calibrated")
    if sites not in ROTATION_SITES:
        raise OptionValueError(f"{prefix}.sites = {sites!r}: \"calibrated\" (each rotation kept where it makes the "
                               "weights quantize better on calibration text, the default) or \"all\" (every rotation "
                               "QuaRot folds)")
    return {"seed": seed, "online": online, "kv_rotation": kv, "candidates": candidates, "search_group_size": group,
            "sites": sites}


# mixed's default: a layer's loss change is a mean over tokens whose spread is far larger than the 1e-4 nats plans
# differ by (mixed.py); 2048 tokens chose worse plans on the example model.
MIXED_CALIBRATION_TOKENS = 16384


def check_mixed(options: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """mixed: average_bits (>= what int4 in groups of group_size stores), group_size, symmetric, skip,
    calibration_tokens (the calibration text's tokens the plan is measured on, >= 512)."""
    bits = options.get("average_bits", 5.0)
    tokens = options.get("calibration_tokens", MIXED_CALIBRATION_TOKENS)
    if type(tokens) is not int or tokens < 512:
        raise OptionValueError(f"{prefix}.calibration_tokens = {tokens!r}: a whole number of tokens, at least 512")
    group_size = options.get("group_size", INT4_DEFAULT_GROUP)
    symmetric = options.get("symmetric", True)
    if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
        raise OptionValueError(f"{prefix}.average_bits = {bits!r}: a positive number of bits")
    if type(group_size) is not int or group_size not in INT4_GROUP_SIZES:
        raise OptionValueError(f"{prefix}.group_size = {group_size!r}: one of "
                               f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    if not isinstance(symmetric, bool):
        raise OptionValueError(f"{prefix}.symmetric = {symmetric!r}: true or false")
    skip = _skip(options, prefix)
    least = 4 + 40 / group_size
    if bits < least:
        raise OptionValueError(f"{prefix}.average_bits = {bits!r}: below {least}, what int4 in groups of "
                               f"{group_size} stores, the smallest this plan can give")
    return {"average_bits": bits, "group_size": group_size, "symmetric": symmetric, "skip": skip,
            "calibration_tokens": tokens}


GPTQ_OPTIONS = ("bits", "group_size", "sym", "act_order", "damp", "num_samples", "seq_len", "skip", "kernel")


@dataclass(frozen=True, slots=True)
class GPTQSettings:
    """gptq's checked options (`from_options`)."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = True
    damp: float = 0.01
    num_samples: int = 128
    seq_len: int = 256
    skip: tuple[str, ...] = ("lm_head",)
    kernel: str = "auto"

    @classmethod
    def from_options(cls, options: Mapping[str, Any], prefix: str = PREFIX) -> GPTQSettings:
        """Checked settings; an OptionValueError names the first bad `<prefix>.<key>`."""
        def where(key: str) -> str:
            return f"{prefix}.{key}"

        unknown = sorted(set(options) - set(GPTQ_OPTIONS))
        if unknown:
            raise OptionValueError(f"{where(unknown[0])}: not an option of quantization 'gptq' (options: "
                                   f"{', '.join(GPTQ_OPTIONS)})")
        values = dict(options)
        defaults = cls()

        def integer(key: str) -> int:
            value = values.get(key, getattr(defaults, key))
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionValueError(f"{where(key)} = {value!r}: expected an integer")
            return value

        def boolean(key: str) -> bool:
            value = values.get(key, getattr(defaults, key))
            if not isinstance(value, bool):
                raise OptionValueError(f"{where(key)} = {value!r}: expected true or false")
            return value

        bits, group_size = integer("bits"), integer("group_size")
        sym, act_order = boolean("sym"), boolean("act_order")
        num_samples, seq_len = integer("num_samples"), integer("seq_len")
        damp = values.get("damp", defaults.damp)
        skip = values.get("skip", defaults.skip)
        if bits not in (4, 8):
            raise OptionValueError(f"{where('bits')} = {bits}: gptq stores 4-bit or 8-bit weights")
        if group_size == 0 or group_size < -1:
            raise OptionValueError(f"{where('group_size')} = {group_size}: a positive number of input columns "
                                   "per scale, or -1 for one scale per output channel")
        if bits == 8 and group_size != -1:
            raise OptionValueError(f"{where('group_size')} = {group_size}: 8-bit gptq weights are stored in the "
                                   "int8 layers, which hold one scale per output channel: use group_size = -1")
        if bits == 8 and not sym:
            raise OptionValueError(f"{where('sym')} = false: 8-bit gptq weights are stored in the int8 layers, "
                                   "which are symmetric")
        if isinstance(damp, bool) or not isinstance(damp, int | float) or not 0 < damp <= 1:
            raise OptionValueError(f"{where('damp')} = {damp!r}: a fraction of the mean Hessian diagonal, "
                                   "0 < damp <= 1 (GPTQ's default 0.01)")
        if num_samples < 1:
            raise OptionValueError(f"{where('num_samples')} = {num_samples}: at least 1 sequence")
        if seq_len < 2:
            raise OptionValueError(f"{where('seq_len')} = {seq_len}: at least 2 tokens per sequence")
        if isinstance(skip, str) or not isinstance(skip, list | tuple) or not all(isinstance(s, str) for s in skip):
            raise OptionValueError(f"{where('skip')} = {skip!r}: a list of layer names, e.g. [\"lm_head\"]")
        kernel = values.get("kernel", defaults.kernel)
        allowed = (*INT4_KERNELS, "reference") if bits == 4 else INT8_KERNELS  # reference: a GPTQ checkpoint's
        if kernel not in allowed:
            raise OptionValueError(f"{where('kernel')} = {kernel!r}: int{bits} kernels are {', '.join(allowed)}")
        return cls(bits, group_size, sym, act_order, float(damp), num_samples, seq_len, tuple(skip), kernel)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.act_order else ""
        return f"gptq {self.bits}-bit {'sym' if self.sym else 'asym'}, {group}{order}"


def check_gptq(options: Mapping[str, Any], prefix: str = PREFIX) -> GPTQSettings:
    return GPTQSettings.from_options(options, prefix)
