"""Model code against transformers: prefill logits and greedy generation, on tiny random checkpoints.

Each family's checkpoint is made here with transformers (random init, save_pretrained), loaded
through `build_model` + `load_weights`, and driven like the engine drives it: a paged KV cache
with shuffled block ids, a batched prefill with a chunked second request, then decode steps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ember.plugins import PluginHost  # noqa: E402
from ember_platform.engine.attention import AttentionMetadata, kv_cache_block_shape  # noqa: E402
from ember_platform.engine.kernel_ops import KernelOps  # noqa: E402
from ember_platform.engine.models import build_model, load_model, load_weights  # noqa: E402
from ember_platform.engine.models.loader import checkpoint_files  # noqa: E402
from ember_plugins.attention.torch_paged import TorchPagedAttention  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 48
NEW_TOKENS = 64
LOGITS_ATOL = 1e-4  # float32 on CPU, logits of magnitude ~3; measured differences are ~2e-6
BF16_LOGITS_ATOL = 8e-2  # a few bfloat16 steps at magnitude ~3 (one step is 1/64 there); measured ~4e-2

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=256, eos_token_id=None,
            bos_token_id=None, pad_token_id=None, initializer_range=0.1)


def _configs() -> dict[str, Callable[[], Any]]:
    t = transformers
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {
        "llama_gqa_untied": lambda: t.LlamaConfig(**TINY, tie_word_embeddings=False),
        "qwen2_bias_tied": lambda: t.Qwen2Config(**TINY, tie_word_embeddings=True),
        "mistral_sliding_window": lambda: t.MistralConfig(**TINY, sliding_window=12),
        "llama3_rope_scaling": lambda: t.LlamaConfig(**TINY, rope_parameters=llama3_rope),
        "llama_linear_rope": lambda: t.LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                             "rope_theta": 10_000.0}),
        "mixtral_moe": lambda: t.MixtralConfig(**{**TINY, "intermediate_size": 64}, num_local_experts=4,
                                               num_experts_per_tok=2),
    }


CONFIGS = _configs()


@functools.cache
def engine_ops() -> KernelOps:
    """The kernel-op table an engine builds from the installed plugins (the native CPU kernels where they build)."""
    return KernelOps.from_plugins(PluginHost())


@dataclass
class Family:
    name: str
    checkpoint: Path
    reference: Any  # the transformers model
    model: Any  # ours


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.generation_config.eos_token_id = None
    checkpoint = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(checkpoint)
    model = load_model(checkpoint, TorchPagedAttention, dtype=torch.float32, ops=engine_ops())
    return Family(request.param, checkpoint, reference, model)


def new_kv_caches(model: Any, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    args = model.args
    shape = (NUM_BLOCKS, *kv_cache_block_shape(BLOCK_SIZE, args.num_kv_heads, args.head_dim))
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(args.num_layers)]


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in (20, 7)]


def test_prefill_logits_match_transformers(family: Family) -> None:
    ids = prompts()[0]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[9, 3, 17, 0, 30]], BLOCK_SIZE)
    with torch.inference_mode():
        hidden = family.model(ids, torch.arange(len(ids)), meta, new_kv_caches(family.model))
        logits = family.model.compute_logits(hidden)
        expected = family.reference(ids[None]).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGITS_ATOL)


def test_bfloat16_prefill_logits_close_to_transformers(family: Family) -> None:
    ids = prompts()[0]
    model = load_model(family.checkpoint, TorchPagedAttention, dtype=torch.bfloat16, ops=engine_ops())
    reference = copy.deepcopy(family.reference).to(torch.bfloat16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[9, 3, 17, 0, 30]], BLOCK_SIZE)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), meta, new_kv_caches(model, torch.bfloat16))
        assert hidden.dtype == torch.bfloat16
        logits = model.compute_logits(hidden)
        expected = reference(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, rtol=0, atol=BF16_LOGITS_ATOL)


def generate_paged(model: Any, prompt_ids: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding the way the engine schedules it.

    Step 1 prefills request 0 whole and the first 4 tokens of request 1; step 2 mixes request 0's
    first decode token with the rest of request 1's prompt; then every step decodes one token per
    unfinished request. Blocks are handed out from a shuffled pool, interleaved between requests.
    """
    pool = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(pool)
    tables: list[list[int]] = [[] for _ in prompt_ids]
    tokens = [p.tolist() for p in prompt_ids]
    num_done = [0 for _ in prompt_ids]  # tokens already in the KV cache
    outputs: list[list[int]] = [[] for _ in prompt_ids]
    kv_caches = new_kv_caches(model)
    chunks = {1: 4}  # request 1's first step takes only 4 prompt tokens
    with torch.inference_mode():
        while any(len(out) < max_new_tokens for out in outputs):
            reqs, query_lens, ids, positions = [], [], [], []
            for i, toks in enumerate(tokens):
                if len(outputs[i]) >= max_new_tokens:
                    continue
                q_len = chunks.pop(i, None) or len(toks) - num_done[i]
                while len(tables[i]) * BLOCK_SIZE < num_done[i] + q_len:
                    tables[i].append(pool.pop())
                reqs.append(i)
                query_lens.append(q_len)
                ids.extend(toks[num_done[i]:num_done[i] + q_len])
                positions.extend(range(num_done[i], num_done[i] + q_len))
            seq_lens = [num_done[i] + q for i, q in zip(reqs, query_lens, strict=True)]
            meta = AttentionMetadata.build(query_lens, seq_lens, [tables[i] for i in reqs], BLOCK_SIZE)
            hidden = model(torch.tensor(ids), torch.tensor(positions), meta, kv_caches)
            last_rows = (meta.query_start_loc[1:] - 1).tolist()
            next_tokens = model.compute_logits(hidden[last_rows]).argmax(-1).tolist()
            for i, q_len, seq_len, token in zip(reqs, query_lens, seq_lens, next_tokens, strict=True):
                num_done[i] += q_len
                if seq_len == len(tokens[i]):  # the whole prompt (and every output) is in: sample
                    tokens[i].append(token)
                    outputs[i].append(token)
    return outputs


def test_greedy_generation_matches_transformers(family: Family) -> None:
    ours = generate_paged(family.model, prompts(), NEW_TOKENS)
    for prompt, generated in zip(prompts(), ours, strict=True):
        expected = family.reference.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                             do_sample=False, pad_token_id=0)
        assert generated == expected[0, len(prompt):].tolist()


def test_torch_paths_without_native_kernels_match_transformers_too(family: Family) -> None:
    # Without a kernel plugin (no C compiler, EMBER_NATIVE_KERNELS=0) RMSNorm, rotary, SiLU-and-mul, the
    # small-batch linear and the KV write run as the table's torch references: the same checks must hold there.
    ops = KernelOps.reference()
    assert set(ops.describe().values()) == {"torch"}
    model = load_model(family.checkpoint, TorchPagedAttention, dtype=torch.float32, ops=ops)
    assert model.ops is ops and all(backend.ops is ops for backend in {layer.self_attn.attn
                                                                       for layer in model.model.layers})
    torch_family = dataclasses.replace(family, model=model)
    test_prefill_logits_match_transformers(torch_family)
    test_greedy_generation_matches_transformers(torch_family)


def test_built_on_meta_until_loaded(tmp_path: Path) -> None:
    config = CONFIGS["qwen2_bias_tied"]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = build_model(tmp_path, TorchPagedAttention, dtype=torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())
    load_weights(model, tmp_path)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama_gqa_untied"]())
    reference.save_pretrained(tmp_path / "single")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(checkpoint_files(tmp_path / "sharded")) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = load_model(tmp_path / "single", TorchPagedAttention)
    sharded = load_model(tmp_path / "sharded", TorchPagedAttention)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_unsupported_architecture_is_named_with_the_supported_ones() -> None:
    config = {**TINY, "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        build_model(config, TorchPagedAttention)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"):
        assert name in str(info.value)


def test_unsupported_rope_type_is_refused() -> None:
    config = {**TINY, "architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ValueError, match=r"rope_type 'yarn'.*llama3"):
        build_model(config, TorchPagedAttention)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama_gqa_untied"]()).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(tmp_path, TorchPagedAttention)


def test_legacy_rope_scaling_spelling_reads_like_rope_parameters() -> None:
    # transformers 4.x configs: rope_theta at the top level, rope_scaling with "type".
    config = {**TINY, "architectures": ["LlamaForCausalLM"], "rope_theta": 500_000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    model = build_model(config, TorchPagedAttention)
    assert model.args.rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0}


def test_linear_layers_are_visible_to_quantizers(family: Family) -> None:
    from ember_platform.engine.linear_method import linear_modules

    names = {name.rsplit(".", 1)[-1] for name, _ in linear_modules(family.model)}
    expected = {"qkv_proj", "o_proj", "lm_head"} | ({"gate"} if "mixtral" in family.name
                                                     else {"gate_up_proj", "down_proj"})
    assert names == expected
