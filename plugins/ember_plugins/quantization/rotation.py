"""`rotation`: random Hadamard rotations folded into the full-precision weights (QuaRot), so that the method
after it (int4, int8, gptq, mixed) quantizes weights and activations without outlier channels.

The model's function is unchanged (in exact arithmetic; float32 logits within ~1e-5): with Q orthogonal,

* the residual stream is rotated: each RMSNorm's scale g is folded into the linears that read it (W diag(g)),
  the norm's weight becomes 1 (RMSNorm commutes with Q: ||h Q|| = ||h||), and then
  - the embeddings and every linear that reads the stream (q/k/v, gate/up, lm_head) get E Q, W Q;
  - every linear that writes into the stream (o_proj, down_proj) gets Q^T W (and its bias b Q);
* each head's values are rotated by a head_dim Hadamard, v_proj's rows per head H^T W_v and o_proj's columns per
  head W_o H (attention mixes tokens, never channels, so this needs nothing online);
* the MLP's intermediate activations (after SiLU(gate) * up, not a linear map) are rotated online: down_proj's
  weight gets W R and its input x R, applied in down_proj's forward by `OnlineRotationMethod`.

Which of them are folded is `sites`. The default, `"calibrated"`, keeps each rotation only where it makes the
weights quantize better on calibration text (`calibrate`, so the default needs calibration text): on the example
model (no outlier channels in the residual stream; RMSNorm scales folded into the weights hurt their int4 groups)
that leaves only the online rotation of down_proj, whose inputs have kurtosis 50-170, and it is what beats plain
round-to-nearest int4 there (held-out perplexity, bench/eval_quantization.py: g128 52.2795 vs 52.3085, g64
52.2984 vs 52.3057). `"all"` folds every one, QuaRot as published (g128 52.4195, g64 52.3666 there: worse than no
rotation), for models whose residual stream has the outlier channels QuaRot was made for.

See `hadamard.py` for the matrices (sizes with an odd factor included). Limits, refused rather than ignored:
tied embeddings (the LM head would need E diag(g) Q while the embeddings need E Q), a sharded model (the folds
need whole matrices), a checkpoint already quantized, any position but the first in the chain (every method
after it must see the rotated full-precision weights, and calibration must run on the rotated model), and the
rotation of q/k inside attention (`kv_rotation`, not implemented), and LoRA adapters (`lora_refusal`: their A/B
matrices are in the unrotated basis; every adapter is refused at start or in `add_lora`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_platform.api import (
    AttentionBlock,
    CalibrationContext,
    Linear,
    LinearMethod,
    LinearSpec,
    ModelStructure,
    QuantizationContext,
    QuantizationError,
    Quantizer,
    linear_modules,
)
from ember_plugins.quantization.hadamard import RandomHadamard
from ember_plugins.quantization.int4 import quantize_rtn
from ember_plugins.quantization.options import check_rotation
from ember_plugins.quantization.options import checked as checked_options

log = logging.getLogger("ember.rotation")
SEARCH_TOKENS = 4096  # calibration tokens each candidate rotation is scored on (`candidates` > 1) ...
SEARCH_SEQUENCE = 256  # ... in sequences of this many
STATS = {"folded_norms": 0, "rotated_linears": 0, "online_rotations": 0}  # what the last transform did


class OnlineRotationMethod(LinearMethod):
    """The input of a layer rotated online (x R), its weight rotated the same way (W R) by the rotation's
    `transform_model`; `inner` (the methods after rotation) stores and applies the rotated weight."""

    def __init__(self, inner: LinearMethod, technique: RotationQuantizer, n: int, prefix: str = "") -> None:
        self.inner, self.technique, self.n, self.prefix = inner, technique, n, prefix
        self.full_precision_until_loaded = inner.full_precision_until_loaded

    @property
    def rotation(self) -> RandomHadamard | None:
        """R of the seed in use (chosen at calibration when `candidates` > 1, after this method was made); None
        where `sites = "calibrated"` left this layer unrotated (its input basis kept)."""
        if not self.technique.online_active(self.prefix):
            return None
        return self.technique._online_rotation(self.n)

    def create_weights(self, layer: Linear) -> None:
        self.inner.create_weights(layer)

    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Hashable | None) -> None:
        self.inner.load_weight(layer, name, param, loaded, shard_id)

    def after_loading(self, layer: Linear) -> None:
        # Before finalizing, the layer's forward is a plain F.linear on its weight, which this method does not see:
        # the rotation's forward pre-hook rotated the input then (so calibration captured x R). From here on
        # `apply` does it.
        handle = layer.__dict__.pop("_rotation_hook", None)
        if handle is not None:
            handle.remove()
        self.inner.after_loading(layer)

    def calibration_input(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """What the stored (rotated) weight multiplies, given what a forward pre-hook on the layer saw before it
        was finalized (a calibrating method's Hessian, gptq's): x R already, since the rotation's own pre-hook is
        the first to run (registered with prepend=True) and hands the rotated input on to every later hook."""
        if "_rotation_hook" not in layer.__dict__:
            if self.rotation is None:
                return x  # left unrotated
            raise QuantizationError(f"rotation: the online rotation of a {layer.in_features}-input layer was asked "
                                    "for a calibration input after the layer was finalized")
        return x

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rotation = self.rotation
        if rotation is None:
            return self.inner.apply(layer, x, bias)
        STATS["online_rotations"] += 1
        return self.inner.apply(layer, rotation.rotate_activations(x), bias)

    def portable_tensors(self, layer: Linear) -> Mapping[str, torch.Tensor] | None:
        return self.inner.portable_tensors(layer)

    def describe(self, layer: Linear) -> str:
        rotation = self.rotation
        if rotation is None:
            return f"no online Hadamard (sites chosen on calibration) + {self.inner.describe(layer)}"
        return f"online Hadamard ({rotation.m}x{rotation.p}) + {self.inner.describe(layer)}"


def _rotate_input_before_finalized(rotation: RandomHadamard) -> Any:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if getattr(module, "finalized", True):
            return None
        return (rotation.rotate_activations(args[0]), *args[1:])
    return hook


class RotationQuantizer(Quantizer):
    """Options (checked by options.check_rotation): `seed` (int, default 0: the random signs and odd-size
    factors); `online` (bool, default true: the online rotation of down_proj's input; false keeps down_proj's
    input basis); `kv_rotation` (false only: rotating q/k per head after RoPE is not implemented); `candidates`
    (default 1: that seed; n > 1: seeds seed..seed+n-1 are tried on calibration text and the one whose int4-rounded
    model is closest to full precision is kept, see `calibrate`; the choice is the technique's saved state);
    `search_group_size` (32, 64 or 128, default 128: the int4 groups that choice rounds in); `sites`
    ("calibrated", default: each rotation kept only where it makes the weights quantize better on calibration
    text, see `calibrate`; "all": every rotation QuaRot folds)."""

    transforms_model = True
    lora_refusal = ("not supported yet: the rotation rewrites the weights in a rotated basis (norms folded, W Q, "
                    "Q^T W, an online Hadamard before down_proj), and an adapter's A and B matrices were trained on "
                    "the original one; serve adapters without rotation (e.g. method = \"int4\")")

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.seed = 0
        self.online = True
        self.candidates, self.search_group_size = 1, 128
        self.sites = "calibrated"  # options.check_rotation's default; set from the options in `prepare`
        # What `sites = "calibrated"` kept (all of them otherwise): the residual stream's rotation (with the norm
        # folds), the value heads' rotation of each attention block (by its qkv layer), each online rotation.
        self.residual = True
        self.value_blocks: frozenset[str] | None = None  # None: every block
        self.online_kept: frozenset[str] | None = None  # None: every layer in online_layers
        self.site_errors: dict[str, Any] = {}
        self.search_kl: dict[str, float] = {}  # seed -> calibration KL of its int4-rounded model
        self._restored = False
        self._model: nn.Module | None = None
        self.structure: ModelStructure | None = None
        self.online_layers: frozenset[str] = frozenset()
        self._online: dict[int, RandomHadamard] = {}

    def _option(self, context: QuantizationContext, key: str) -> str:
        table = (f"quantization.options.{context.chain[context.position]}" if len(context.chain) > 1
                 else "quantization.options")
        return f"{table}.{key}"

    def prepare(self, context: QuantizationContext) -> None:
        super().prepare(context)  # refuses a pre-quantized checkpoint
        # What ember checks a manifest with too (options.py), under the key this table has in the composition.
        checked = checked_options(check_rotation, self.options, self._option(context, "").removesuffix("."))
        seed, online = checked["seed"], checked["online"]
        if context.position != 0:
            raise QuantizationError(
                f"[quantization] method: '{context.chain[context.position]}' comes after "
                f"{', '.join(repr(n) for n in context.chain[:context.position])}; a rotation rewrites the whole "
                "model's full-precision weights, so it must come first (e.g. [\"rotation\", \"int8\"])")
        s = context.structure
        if s.tied_embeddings:
            raise QuantizationError("quantization 'rotation': not supported yet for tied embeddings (the LM head "
                                    "would need E diag(g) Q and the embeddings E Q, one shared tensor)")
        self.seed, self.online, self.structure = seed, online, s
        self.candidates, self.search_group_size = checked["candidates"], checked["search_group_size"]
        self.sites = checked["sites"]
        # The seed, or which rotations to keep, is then chosen on calibration text.
        self.needs_calibration = self.candidates > 1 or self.sites == "calibrated"
        attention_outputs = {a.output for a in s.attention}
        self.online_layers = frozenset(w for w in s.residual_writers if w not in attention_outputs) if online \
            else frozenset()

    def online_active(self, prefix: str) -> bool:
        return self.online_kept is None or prefix in self.online_kept

    def _online_rotation(self, n: int) -> RandomHadamard:
        if n not in self._online:
            self._online[n] = RandomHadamard(n, self.seed)
        return self._online[n]

    def linear_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        if not inner.full_precision_until_loaded:
            raise QuantizationError(f"quantization 'rotation' rewrites full-precision weights, and {spec.prefix} "
                                    f"loads stored ones ({type(inner).__name__}): rotation comes before a method "
                                    "that quantizes on load, and cannot rotate a pre-quantized checkpoint")
        if spec.prefix in self.online_layers:  # (`sites = "calibrated"` may leave it unrotated: decided later)
            return OnlineRotationMethod(inner, self, spec.in_features, spec.prefix)
        return inner  # its weight is rotated by transform_model, nothing changes at run time

    def restored_method(self, spec: LinearSpec, inner: LinearMethod) -> LinearMethod:
        """A cache entry holds the rotated weights (and norms, embeddings): only the online rotation remains, of the
        seed the entry was made with (`restore_state`)."""
        if self.needs_calibration and not self._restored:
            raise QuantizationError("quantization 'rotation' with candidates > 1 or sites = \"calibrated\": these "
                                    "quantized weights were saved without the seed and rotations chosen for them, so "
                                    "their online rotations are unknown")
        if spec.prefix in self.online_layers and self.online_active(spec.prefix):
            return OnlineRotationMethod(inner, self, spec.in_features, spec.prefix)
        return inner

    def state(self) -> Mapping[str, Any]:
        """The seed in use (chosen among `candidates`, with each one's calibration KL), saved with the weights."""
        return {"seed": self.seed, "candidates": self.candidates, "search_group_size": self.search_group_size,
                "search_kl": dict(self.search_kl), "sites": self.sites, "residual": self.residual,
                "value_blocks": None if self.value_blocks is None else sorted(self.value_blocks),
                "online_layers": sorted(n for n in self.online_layers if self.online_active(n)),
                "site_errors": dict(self.site_errors)}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        seed = state.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise QuantizationError(f"quantization 'rotation': the saved state has no seed ({seed!r})")
        residual, values = state.get("residual", True), state.get("value_blocks")
        online = state.get("online_layers", sorted(self.online_layers))
        if not isinstance(residual, bool) or not (values is None or isinstance(values, list)) \
                or not isinstance(online, list) or not set(online) <= self.online_layers:
            raise QuantizationError("quantization 'rotation': the saved state's residual / value_blocks / "
                                    f"online_layers do not fit this model ({residual!r}, {values!r}, {online!r})")
        self._use_seed(seed)
        self.residual = residual
        self.value_blocks = None if values is None else frozenset(values)
        self.online_kept = frozenset(online)
        self._restored = True

    def _use_seed(self, seed: int) -> None:
        self.seed = seed
        self._online.clear()  # the online rotations are the seed's

    # --- the fold ---------------------------------------------------------------------------------------------

    def transform_model(self, model: nn.Module) -> None:
        if self.needs_calibration:
            self._model = model  # folded in `calibrate`, once the seed (and the sites) are chosen
            return
        self._fold(model)

    def calibrate(self, calibration: CalibrationContext) -> None:
        """Choose what to fold on calibration text, then fold it. Holds a copy of the full-precision parameters
        while choosing.

        1. The seed among `candidates` (seed, seed + 1, ...), and with `sites = "calibrated"` whether to rotate the
           residual stream at all: fold each, round every linear but the LM head to int4 (round to nearest,
           symmetric, groups of `search_group_size`), and keep the one whose logits on the calibration text are
           closest to full precision (mean KL per token). SpinQuant's observation that random rotations differ in
           how well the rotated model quantizes, by a search instead of training; and a rotation only helps where
           there are outlier channels to spread, while folding the norms into the weights can hurt their groups.
        2. With `sites = "calibrated"`, the local rotations, each of which changes one or two layers only: each
           online rotation (a down_proj's input) and each block's value-head rotation (v_proj's rows, o_proj's
           inputs) is kept where it lowers the layers' int4 reconstruction error on the calibration inputs,
           ||X W^T - X Q(W)^T||^2 / ||X W^T||^2 (summed over v and o for a block), in the basis step 1 chose."""
        model = self._model
        assert model is not None, "transform_model() first"
        ids = calibration.tokenizer.encode(calibration.text, add_special_tokens=False)[:SEARCH_TOKENS]
        sequences = [ids[i:i + SEARCH_SEQUENCE] for i in range(0, len(ids), SEARCH_SEQUENCE)]
        sequences = [seq for seq in sequences if len(seq) > 1]
        if not sequences:
            raise QuantizationError(f"quantization 'rotation': the calibration text ({calibration.source}) has no "
                                    "tokens to choose the rotation on")
        saved = {name: p.detach().clone() for name, p in model.named_parameters()}
        params = dict(model.named_parameters())

        def restore() -> None:
            self._unhook(model)
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].data.copy_(value)

        configs = [(seed, residual) for residual in ((True, False) if self.sites == "calibrated" else (True,))
                   for seed in range(self.seed, self.seed + self.candidates)]
        local: dict[tuple[int, bool], tuple[frozenset[str], frozenset[str], dict[str, Any]]] = {}

        def fold(seed: int, residual: bool) -> None:
            """Fold this seed and residual choice; with `sites = "calibrated"` its local rotations first chosen
            (step 2, in this basis) and kept for it."""
            self._use_seed(seed)
            self.residual = residual
            if self.sites == "calibrated":
                if (seed, residual) not in local:
                    self.online_kept = self.value_blocks = None
                    self._fold(model)
                    local[(seed, residual)] = self._choose_local_sites(model, calibration, sequences)
                    restore()
                self.online_kept, self.value_blocks, self.site_errors = local[(seed, residual)]
            self._fold(model)

        self.search_kl = {}
        if len(configs) > 1:
            def log_probs() -> list[torch.Tensor]:
                with torch.inference_mode():
                    return [torch.log_softmax(model.compute_logits(calibration.run(seq)).float(), dim=-1)
                            for seq in sequences]

            reference = log_probs()
            tokens = sum(len(r) for r in reference)
            for seed, residual in configs:
                fold(seed, residual)
                with torch.no_grad():
                    for name, layer in linear_modules(model):
                        if name.split(".")[-1] != "lm_head":
                            w = layer.weight.data
                            w.copy_(quantize_rtn(w, self.search_group_size, True).dequantize(w.dtype))
                kl = sum(float(F.kl_div(got, ref, log_target=True, reduction="sum"))
                         for got, ref in zip(log_probs(), reference, strict=True)) / tokens
                self.search_kl[self._config_label(seed, residual)] = round(kl, 8)
                restore()
        best = min(configs, key=lambda c: (self.search_kl.get(self._config_label(*c), 0.0), configs.index(c)))
        log.info("rotation: seed %d, residual rotation %s (calibration KL of the int4-rounded models: %s)", best[0],
                 best[1], self.search_kl)
        fold(*best)
        saved.clear()
        self._model = None

    def _config_label(self, seed: int, residual: bool) -> str:
        # The seed alone where the residual stream is always rotated (what `search_kl` always held).
        return str(seed) if self.sites != "calibrated" else f"{seed}{'' if residual else ' no residual'}"

    def _choose_local_sites(self, model: nn.Module, calibration: CalibrationContext,
                            sequences: list[list[int]]) -> tuple[frozenset[str], frozenset[str], dict[str, Any]]:
        """Step 2 of `calibrate` on the model folded with every local rotation: the online layers and the value
        blocks (by qkv layer) to rotate, and each site's errors rotated and not."""
        assert self.structure is not None
        blocks = list(self.structure.attention)
        wanted = set(self.online_layers) | {b.qkv for b in blocks} | {b.output for b in blocks}
        inputs: dict[str, list[torch.Tensor]] = {name: [] for name in wanted}
        handles = []
        for name in wanted:
            def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], _name: str = name) -> None:
                inputs[_name].append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
            # After the rotation's own pre-hook: these are the inputs the rotated weights multiply.
            handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
        try:
            for seq in sequences:
                calibration.run(seq)
        finally:
            for handle in handles:
                handle.remove()
        x = {name: torch.cat(rows) for name, rows in inputs.items()}
        group = self.search_group_size

        def error(w: torch.Tensor, xs: torch.Tensor) -> float:
            q = quantize_rtn(w.float(), group, True).dequantize(torch.float64)
            return float((xs @ (w - q).T).pow(2).sum() / (xs @ w.T).pow(2).sum().clamp(min=1e-30))

        errors: dict[str, Any] = {}
        kept_online = set()
        for name in sorted(self.online_layers):
            w = model.get_submodule(name).weight.data.double()  # W R, multiplying x R
            r = self._online_rotation(w.shape[1]).matrix()
            rotated, plain = error(w, x[name]), error(w @ r.T, x[name] @ r.T)
            errors[name] = {"rotated": round(rotated, 8), "unrotated": round(plain, 8)}
            if rotated < plain:
                kept_online.add(name)
        kept_values = set()
        for block in blocks:
            qkv, out = model.get_submodule(block.qkv), model.get_submodule(block.output)
            hd, kv_heads, heads = block.head_dim, block.num_kv_heads, block.num_heads
            h = RandomHadamard(hd, self.seed).matrix()
            start, size = qkv.shard_offsets["v"], qkv.shard_sizes["v"]
            wv = qkv.weight.data[start:start + size].double()  # per head H^T W_v
            wv_plain = (h @ wv.reshape(kv_heads, hd, -1)).reshape(size, -1)
            wo = out.weight.data.double()  # per head W_o H, multiplying (x H) per head
            wo_plain = (wo.reshape(wo.shape[0], heads, hd) @ h.T).reshape(wo.shape[0], -1)
            xo = x[block.output]
            xo_plain = (xo.reshape(xo.shape[0], heads, hd) @ h.T).reshape(xo.shape[0], -1)
            rotated = error(wv, x[block.qkv]) + error(wo, xo)
            plain = error(wv_plain, x[block.qkv]) + error(wo_plain, xo_plain)
            errors[f"{block.qkv} v / {block.output}"] = {"rotated": round(rotated, 8), "unrotated": round(plain, 8)}
            if rotated < plain:
                kept_values.add(block.qkv)
        log.debug("rotation (seed %d, residual %s): online rotations kept for %s, value rotations for %s", self.seed,
                  self.residual, sorted(kept_online), sorted(kept_values))
        return frozenset(kept_online), frozenset(kept_values), errors

    @staticmethod
    def _unhook(model: nn.Module) -> None:
        for _, layer in linear_modules(model):
            handle = layer.__dict__.pop("_rotation_hook", None)
            if handle is not None:
                handle.remove()

    def _fold(self, model: nn.Module) -> None:
        assert self.structure is not None, "prepare() first"
        s = self.structure
        q = RandomHadamard(s.hidden_size, self.seed).matrix()  # float64 [D, D]
        STATS.update(folded_norms=0, rotated_linears=0, online_rotations=0)

        def linear(name: str) -> Linear:
            module = model.get_submodule(name)
            weight = getattr(module, "weight", None)
            if not isinstance(module, Linear) or weight is None or not weight.is_floating_point() \
                    or weight.is_meta or module.finalized:
                raise QuantizationError(f"quantization 'rotation': {name} is not a full-precision linear layer "
                                        "still being loaded (not supported yet: expert stacks, pre-quantized layers)")
            return module

        def set_weight(layer: Linear, w: torch.Tensor) -> None:
            layer.weight.data.copy_(w.to(layer.weight.dtype))
            STATS["rotated_linears"] += 1

        with torch.no_grad():
            rotated: dict[str, torch.Tensor] = {}  # name -> float64 weight being rewritten
            if self.residual:
                self._fold_residual(model, q, rotated, linear)
            for block in s.attention:
                if self.value_blocks is None or block.qkv in self.value_blocks:
                    self._rotate_values(block, linear(block.qkv), linear(block.output), rotated)
            for name in self.online_layers:
                if not self.online_active(name):
                    continue
                layer = linear(name)
                rotation = self._online_rotation(layer.in_features)
                rotated[name] = rotation.rotate(rotated.get(name, layer.weight.data.double()))  # W R
                # First among the layer's pre-hooks, so that whatever hooks in later (calibration's capture, gptq's
                # Hessian) sees the input the rotated weight multiplies.
                layer._rotation_hook = layer.register_forward_pre_hook(_rotate_input_before_finalized(rotation),
                                                                       prepend=True)
            for name, w in rotated.items():
                set_weight(model.get_submodule(name), w)

    def _fold_residual(self, model: nn.Module, q: torch.Tensor, rotated: dict[str, torch.Tensor],
                       linear: Any) -> None:
        """The residual stream's rotation: norms folded into their readers, E Q, W Q, Q^T W (and b Q)."""
        assert self.structure is not None
        s = self.structure
        embed = model.get_submodule(s.embeddings).weight
        self._check(embed.shape[-1], s.hidden_size, s.embeddings)
        embed.data.copy_((embed.data.double() @ q).to(embed.dtype))
        for feed in s.norm_feeds:
            norm = model.get_submodule(feed.norm)
            g = norm.weight.data.double()
            for name in feed.linears:
                layer = linear(name)
                self._check(layer.in_features, s.hidden_size, name)
                rotated[name] = (layer.weight.data.double() * g) @ q  # W diag(g) Q
            norm.weight.data.fill_(1.0)
            STATS["folded_norms"] += 1
        for name in s.residual_writers:
            layer = linear(name)
            self._check(layer.out_features, s.hidden_size, name)
            rotated[name] = q.T @ rotated.get(name, layer.weight.data.double())
            if layer.bias is not None:
                layer.bias.data.copy_((layer.bias.data.double() @ q).to(layer.bias.dtype))

    def _rotate_values(self, block: AttentionBlock, qkv: Linear, output: Linear,
                       rotated: dict[str, torch.Tensor]) -> None:
        """v_proj's rows per head H^T W_v (bias b_v H), o_proj's columns per head W_o H."""
        hd, kv_heads, heads = block.head_dim, block.num_kv_heads, block.num_heads
        if "v" not in qkv.shard_offsets or qkv.shard_sizes["v"] != kv_heads * hd or output.in_features != heads * hd:
            raise QuantizationError(f"quantization 'rotation': {block.qkv} does not hold {kv_heads} value heads of "
                                    f"{hd} (not supported yet: a sharded model)")
        h = RandomHadamard(hd, self.seed).matrix()
        w = rotated.get(block.qkv, qkv.weight.data.double())
        start, size = qkv.shard_offsets["v"], qkv.shard_sizes["v"]
        w[start:start + size] = (h.T @ w[start:start + size].reshape(kv_heads, hd, -1)).reshape(size, -1)
        rotated[block.qkv] = w
        if qkv.bias is not None:
            bv = qkv.bias.data[start:start + size].double().reshape(kv_heads, hd)
            qkv.bias.data[start:start + size] = (bv @ h).reshape(size).to(qkv.bias.dtype)
        wo = rotated.get(block.output, output.weight.data.double())
        rotated[block.output] = (wo.reshape(wo.shape[0], heads, hd) @ h).reshape(wo.shape[0], -1)

    @staticmethod
    def _check(size: int, expected: int, name: str) -> None:
        if size != expected:
            raise QuantizationError(f"quantization 'rotation': {name} has {size} channels on the residual stream, "
                                    f"not the model's {expected} (not supported yet: a sharded model)")
