"""The Llama family: Llama (2, 3, 3.1 rope scaling), Mistral (sliding window) and Qwen2 (qkv bias).

One decoder with fused qkv and gate_up projections; the families differ only in how their config
is read (biases, sliding windows, rope defaults), which each class states in `parse_args`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ember_platform.engine.attention import (
    AttentionBackend,
    AttentionBackendFactory,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCache,
)
from ember_platform.engine.models.layers import Embedding, Linear, PackedLinear, RMSNorm
from ember_platform.engine.models.rope import RotaryEmbedding, rope_parameters
from ember_platform.engine.models.structure import AttentionBlock, ModelStructure, NormFeed

if TYPE_CHECKING:
    from ember_platform.engine.kernel_ops import KernelOps


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The shape of a decoder, read from a Hugging Face config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Mapping[str, Any]
    sliding_windows: tuple[int | None, ...]  # one per layer
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")


def _config_value(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """config[key], or `default` when the key is missing or null (HF configs write nulls for defaults)."""
    value = config.get(key)
    return default if value is None else value


def common_args(config: Mapping[str, Any], default_rope_theta: float) -> dict[str, Any]:
    """The `ModelArgs` fields every family reads the same way."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act '{act}' is not supported (only 'silu')")
    num_heads = config["num_attention_heads"]
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=_config_value(config, "num_key_value_heads", num_heads),
        head_dim=_config_value(config, "head_dim", config["hidden_size"] // num_heads),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope=rope_parameters(config, default_rope_theta),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def layer_windows(config: Mapping[str, Any], default_sliding: list[bool]) -> tuple[int | None, ...]:
    """Per layer: the sliding window, or None. `layer_types`, when the config has it, decides."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    sliding = [t == "sliding_attention" for t in layer_types] if layer_types else default_sliding
    return tuple(window if is_sliding and window else None for is_sliding in sliding)


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = PackedLinear(args.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=args.qkv_bias,
                                     ops=ops)
        self.o_proj = Linear(q_size, args.hidden_size, bias=args.o_bias, ops=ops)
        self.attn = backend  # not a module: backends hold no weights

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        # x: [T, D]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        # In place where the kernel can: q and k stay slices of the fused qkv output, no copies.
        q = self.ops.rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, H, hd]
        k = self.ops.rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = PackedLinear(args.hidden_size, {"gate": args.intermediate_size,
                                                            "up": args.intermediate_size}, bias=args.mlp_bias, ops=ops)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, mlp: nn.Module, ops: KernelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(args, backend, ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: each layer returns (output, residual stream).
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, backends: list[AttentionBackend], mlps: list[nn.Module],
                 ops: KernelOps) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, b, m, ops) for b, m in zip(backends, mlps, strict=True))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], aux_hidden: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, D]
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)  # [T, hd] each, shared by every layer
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if aux_hidden is not None and i in aux_hidden:  # the residual stream entering layer i, for a speculator
                aux_hidden[i] = h.clone() if residual is None else h + residual  # fused norms add in place
            h, residual = layer(h, residual, cos, sin, meta, kv_cache)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU, tied or untied embeddings."""

    default_rope_theta: ClassVar[float] = 10_000.0
    # checkpoint module name -> (this model's module name, shard id): the loader's only mapping.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Hashable]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # Layers that can carry a LoRA adapter. PEFT's per-projection A/B (q_proj, ...) map onto their output
    # slices through `checkpoint_target`, exactly as the base checkpoint's tensors do.
    lora_module_names: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def __init__(self, config: Mapping[str, Any], attn_backend: AttentionBackendFactory,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, ops: KernelOps) -> None:
        super().__init__()
        self.config = dict(config)
        self.args = args = self.parse_args(config)
        self.dtype, self.device = dtype, torch.device(device)
        self.ops = ops  # the kernel-op table every layer (and the attention backends) calls
        by_window: dict[int | None, AttentionBackend] = {}
        for window in args.sliding_windows:  # one backend per distinct attention configuration
            if window not in by_window:
                layer = AttentionLayerSpec(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5,
                                           window, dtype)
                by_window[window] = attn_backend(layer=layer, ops=ops)
        backends = [by_window[w] for w in args.sliding_windows]
        self.attention_backends = backends  # per layer: the worker allocates each layer's cache from its spec
        self.model = DecoderModel(args, backends, [self.make_mlp(args, i) for i in range(args.num_layers)], ops)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, ops=ops)
        if args.tie_word_embeddings:  # one parameter, loaded once (from the embedding's tensor)
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def parse_args(cls, config: Mapping[str, Any]) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        return ModelArgs(**common_args(config, cls.default_rope_theta), qkv_bias=bias, o_bias=bias,
                         mlp_bias=bool(config.get("mlp_bias", False)),
                         sliding_windows=(None,) * config["num_hidden_layers"])

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return LlamaMLP(args, self.ops)

    def structure(self) -> ModelStructure:
        """The wiring weight-transforming techniques (rotations, smoothing) fold transforms along."""
        a, feeds, writers, attention = self.args, [], [], []
        for i in range(a.num_layers):
            layer = f"model.layers.{i}"
            feeds.append(NormFeed(f"{layer}.input_layernorm", (f"{layer}.self_attn.qkv_proj",)))
            feeds.append(NormFeed(f"{layer}.post_attention_layernorm", self.mlp_inputs(layer)))
            writers += [f"{layer}.self_attn.o_proj", *self.mlp_outputs(layer)]
            attention.append(AttentionBlock(f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn.o_proj", a.num_heads,
                                            a.num_kv_heads, a.head_dim))
        feeds.append(NormFeed("model.norm", ("lm_head",)))
        return ModelStructure("model.embed_tokens", "lm_head", a.tie_word_embeddings, tuple(feeds), tuple(writers),
                              tuple(attention), a.hidden_size)

    def mlp_inputs(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.mlp.gate_up_proj",)

    def mlp_outputs(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.mlp.down_proj",)

    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        """Where a checkpoint tensor goes: (parameter name, shard id or None), or None to skip it."""
        if "rotary_emb." in name or (self.args.tie_word_embeddings and name == "lm_head.weight"):
            return None  # recomputed buffers, and tied copies some checkpoints store anyway
        for ckpt_module, (param_module, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_module}." in name:
                return name.replace(f".{ckpt_module}.", f".{param_module}."), shard_id
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], aux_hidden: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, D]; kv_caches: one (k, v) pair per layer.

        `aux_hidden`: layer index -> filled with the hidden state entering that layer ([T, D]; 0 is the
        embeddings), i.e. transformers' `hidden_states[i]`, for speculators that read intermediate layers."""
        return self.model(input_ids, positions, meta, kv_caches, aux_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> float32 logits [N, V]."""
        return self.lm_head(hidden).float()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases, with an optional sliding window on every layer."""

    @classmethod
    def parse_args(cls, config: Mapping[str, Any]) -> ModelArgs:
        windows = layer_windows(config, [True] * config["num_hidden_layers"])
        return ModelArgs(**common_args(config, cls.default_rope_theta), sliding_windows=windows)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases; sliding windows only when `use_sliding_window`."""

    @classmethod
    def parse_args(cls, config: Mapping[str, Any]) -> ModelArgs:
        num_layers = config["num_hidden_layers"]
        use_sliding = bool(config.get("use_sliding_window", False))
        max_window_layers = config.get("max_window_layers", num_layers)
        windows = (layer_windows(config, [i >= max_window_layers for i in range(num_layers)]) if use_sliding
                   else (None,) * num_layers)
        return ModelArgs(**common_args(config, cls.default_rope_theta), qkv_bias=True, sliding_windows=windows)
