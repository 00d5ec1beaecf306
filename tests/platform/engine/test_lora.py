"""Multi-LoRA serving end to end against transformers + PEFT: mixed batches of adapters (and none) give
each adapter's own greedy tokens and logits; LRU eviction, the prefix cache, packages' [[lora]] entries,
quantized base layers, and the errors users can hit.

The base model is a small random-init checkpoint made here with transformers; the adapters are made with
PEFT (different ranks and targets, rsLoRA, an alpha pattern) with random A and B, since PEFT initializes
B to zero and an adapter that changes nothing would prove nothing.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ember_platform import LLM, SamplingParams  # noqa: E402
from ember_platform.engine.engine import LLMEngine  # noqa: E402
from ember_platform.engine.lora import LoRAAdapterError  # noqa: E402
from ember_platform.engine.lora_layer import LoRALinear  # noqa: E402
from ember_platform.engine.lora_manager import UnknownLoRAError  # noqa: E402
from ember_platform.engine.step_plan import StepPlan  # noqa: E402
from ember_plugins.quantization.int8 import Int8LinearMethod  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama" / "weights"
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LOGITS_ATOL = 1e-4  # float32 on CPU, logits of magnitude ~3, adapters moving them by ~2-3: measured ~3e-6
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, eos_token_id=None,
            bos_token_id=None, pad_token_id=None, initializer_range=0.1)
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters that differ in rank, targets and scaling rule.
ADAPTERS: dict[str, dict[str, Any]] = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
    "beta": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "gamma": dict(r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"], alpha_pattern={"up_proj": 8}),
}


@dataclass
class Setup:
    checkpoint: Path
    adapters: dict[str, Path]
    base: Any  # the transformers model
    references: dict[str | None, Any]  # adapter name (None = base) -> transformers (+ PEFT) model


def make_checkpoint(directory: Path, config: Any) -> Any:
    """A random-init transformers model saved as a Hugging Face checkpoint the engine can serve."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ids stay below this model's vocab in the tests
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return model


def make_adapter(base: Any, directory: Path, seed: int, **lora_config: Any) -> Any:
    """A PEFT adapter with random A and B, saved; returns the PEFT model (on a copy of `base`) as reference."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    references: dict[str | None, Any] = {None: base}
    paths = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        paths[name] = root / "adapters" / name
        references[name] = make_adapter(base, paths[name], seed, **config)
    return Setup(root / "base", paths, base, references)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def reference_tokens(model: Any, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                          dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_with_adapters(setup: Setup, **overrides: Any) -> LLMEngine:
    engine = LLMEngine(setup.checkpoint, **overrides)
    for name, path in setup.adapters.items():
        engine.add_lora(name, path)
    return engine


def run_staggered(engine: LLMEngine, work: list[tuple[list[int], str | None]]) -> tuple[dict[int, list[int]],
                                                                                           set[frozenset]]:
    """Add requests one or two per step while earlier ones decode; returns their tokens and, per step, the
    set of adapters that ran in it."""
    pending = list(enumerate(work))
    results: dict[int, list[int]] = {}
    mixes: set[frozenset] = set()
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), 1 + step % 2)):
            i, (prompt, lora) = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY, lora_name=lora)
        outputs = engine.step()
        mixes.add(frozenset(r.lora_name for r in engine.scheduler.running))
        for out in outputs:
            results.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        step += 1
    return results, mixes


def mixed_work(n: int = 9) -> list[tuple[list[int], str | None]]:
    names: list[str | None] = ["alpha", "beta", None]
    return [(p, names[i % 3]) for i, p in enumerate(prompts(n))]


@pytest.fixture(scope="module")
def expected(setup: Setup) -> dict[int, list[int]]:
    return {i: reference_tokens(setup.references[lora], p) for i, (p, lora) in enumerate(mixed_work())}


def test_adapters_change_the_output(setup: Setup, expected: dict[int, list[int]]) -> None:
    """Guards the other tests: each adapter's reference differs from the base model's."""
    prompt = prompts(1)[0]
    outputs = {name: reference_tokens(model, prompt) for name, model in setup.references.items()}
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(outputs)


@pytest.mark.parametrize("overrides", [
    {},
    {"max_num_batched_tokens": 16, "max_num_seqs": 8},  # prefills chunked across steps
    {"speculator": "ngram", "num_speculative_tokens": 3},  # adapters verify drafts too
], ids=["batch", "chunked-prefill", "ngram-speculation"])
def test_mixed_batch_matches_peft_per_adapter(setup: Setup, expected: dict[int, list[int]],
                                              overrides: dict[str, Any]) -> None:
    engine = engine_with_adapters(setup, max_loras=2, **overrides)
    results, mixes = run_staggered(engine, mixed_work())
    if "speculator" in overrides:
        assert engine.num_accepted_tokens > 0
    assert frozenset({"alpha", "beta", None}) in mixes  # both adapters and the base model in one step
    for i in expected:
        assert results[i] == expected[i], f"request {i} ({mixed_work()[i][1]})"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.loaded_loras == {"alpha", "beta"} and engine.lora.num_evictions == 0


def test_mixed_batch_logits_match_peft(setup: Setup) -> None:
    engine = engine_with_adapters(setup, max_loras=3)
    prompt = prompts(1, seed=3)[0]
    names = ["alpha", None, "gamma", "beta"]
    for i, name in enumerate(names):
        engine.add_request(str(i), prompt, GREEDY, lora_name=name)
    batch = engine.scheduler.schedule()
    assert len(batch) == len(names)
    result = engine.executor.execute(StepPlan.build(batch.requests, batch.num_tokens))
    for row, name in enumerate(names):
        with torch.no_grad():
            ref = setup.references[name](torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(result.logits[row], ref, rtol=0, atol=LOGITS_ATOL)
    for i in range(len(names)):
        engine.abort(str(i))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_one_slot_evicts_least_recently_used_and_stays_correct(setup: Setup, expected: dict[int, list[int]]) -> None:
    engine = engine_with_adapters(setup, max_loras=1)
    changes: list[frozenset[str]] = []
    engine.add_lora_listener(changes.append)
    results, mixes = run_staggered(engine, mixed_work())
    assert all(len(mix - {None}) <= 1 for mix in mixes)  # one slot: never two adapters in a step
    assert all(results[i] == expected[i] for i in expected)
    assert engine.lora.num_evictions >= 1 and engine.lora.num_loads == engine.lora.num_evictions + 1
    assert changes[0] == {"alpha"} and {"beta"} in changes and all(len(c) == 1 for c in changes)
    assert engine.loaded_loras == changes[-1]
    assert engine.lora.estimated_load_seconds("alpha") is not None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_is_never_shared_across_adapters(setup: Setup) -> None:
    llm = LLM(setup.checkpoint, kv_block_size=16, max_loras=2)
    for name, path in setup.adapters.items():
        llm.engine.add_lora(name, path)
    prompt = prompts(1, seed=5)[0] + list(range(40))  # at least three full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = {}
    for run, name in enumerate(["alpha", "beta", None, "alpha", None, "beta"]):
        out = llm.generate([prompt], params, lora_name=name)[0]
        assert out.token_ids == reference_tokens(setup.references[name], prompt, 8)
        cached[run] = out.usage.cached_tokens
    assert cached[0] == cached[1] == cached[2] == 0  # a new adapter reuses no other adapter's (or base) blocks
    assert cached[3] >= 32 and cached[4] >= 32 and cached[5] >= 32  # its own blocks, it does
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_unknown_adapter_names_it_and_the_available_ones(setup: Setup) -> None:
    engine = engine_with_adapters(setup)
    with pytest.raises(UnknownLoRAError, match=r"'delta'.*available: alpha, beta, gamma"):
        engine.add_request("x", [1, 2, 3], GREEDY, lora_name="delta")
    bare = LLMEngine(setup.checkpoint)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'alpha'; this model has no LoRA adapters"):
        bare.add_request("x", [1, 2, 3], GREEDY, lora_name="alpha")
    assert not engine.has_unfinished() and not bare.has_unfinished()


def test_package_lora_entries_are_served(setup: Setup, tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    shutil.copytree(setup.checkpoint, package / "weights")
    shutil.copytree(setup.adapters["beta"], package / "adapters" / "beta")
    (package / "ember.toml").write_text('[model]\nname = "lora-test"\nversion = "0.1.0"\nweights = "weights"\n\n'
                                        '[[lora]]\nname = "beta"\npath = "adapters/beta"\n')
    llm = LLM(package)
    assert llm.engine.lora_names == ["beta"] and llm.engine.loaded_loras == frozenset()  # loaded on first use
    work = mixed_work(2)
    outs = llm.generate([p for p, _ in work], GREEDY, lora_name=["beta", None])
    assert outs[0].token_ids == reference_tokens(setup.references["beta"], work[0][0])
    assert outs[1].token_ids == reference_tokens(setup.references[None], work[1][0])
    assert llm.engine.loaded_loras == {"beta"}


def test_add_and_remove_at_run_time(setup: Setup, tmp_path: Path) -> None:
    engine = LLMEngine(setup.checkpoint)
    changes: list[frozenset[str]] = []
    engine.add_lora_listener(changes.append)
    engine.add_lora("alpha", setup.adapters["alpha"])
    with pytest.raises(ValueError, match="already registered"):
        engine.add_lora("alpha", setup.adapters["beta"])
    engine.add_request("0", [5, 6, 7], GREEDY, lora_name="alpha")
    engine.step()
    assert engine.loaded_loras == {"alpha"}
    with pytest.raises(ValueError, match=r"in use by unfinished requests \(0\)"):
        engine.remove_lora("alpha")
    engine.abort("0")
    engine.remove_lora("alpha")
    assert engine.loaded_loras == frozenset() and changes == [{"alpha"}, frozenset()]
    with pytest.raises(UnknownLoRAError):
        engine.add_request("1", [5, 6, 7], GREEDY, lora_name="alpha")
    # Cached KV is keyed by the adapter's name: the name may come back with the same weights only.
    with pytest.raises(LoRAAdapterError, match=r"different weights.*new name"):
        engine.add_lora("alpha", setup.adapters["beta"])
    engine.add_lora("alpha", setup.adapters["alpha"])
    with pytest.raises(ValueError, match="not a valid adapter name"):
        engine.add_lora("Has:Colon", setup.adapters["beta"])


def test_unsupported_adapters_are_refused_naming_file_and_key(setup: Setup, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    engine = LLMEngine(setup.checkpoint)

    def variant(name: str, config_changes: dict[str, Any] | None = None,
                extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        path = tmp_path / name
        shutil.copytree(setup.adapters["beta"], path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **(config_changes or {})}))
        if extra_tensors:
            tensors = load_file(path / "adapter_model.safetensors")
            save_file({**tensors, **extra_tensors}, path / "adapter_model.safetensors")
        return path

    cases = [
        (variant("dora", {"use_dora": True}), r"adapter_config.json: 'use_dora' = true: DoRA"),
        (variant("save", {"modules_to_save": ["lm_head"]}), r"adapter_config.json: 'modules_to_save'"),
        (variant("bias", {"bias": "all"}), r"adapter_config.json: 'bias' = 'all'"),
        (variant("pissa", {"init_lora_weights": "pissa"}), r"'init_lora_weights' = 'pissa' also rewrites"),
        (variant("magnitude", extra_tensors={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}),
         r"adapter_model.safetensors: tensor '.*q_proj.lora_magnitude_vector': a DoRA magnitude vector"),
        (variant("lm-head", extra_tensors={"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64),
                                           "base_model.model.lm_head.lora_B.weight": torch.ones(512, 4)}),
         r"tensor 'base_model.model.lm_head.lora_A.weight' targets 'lm_head', which cannot carry a LoRA"),
        (variant("rank", {"r": 16}), r"has rank 4 but the config says r = 16"),
        (tmp_path / "missing", r"no adapter_config.json in"),
    ]
    for path, message in cases:
        with pytest.raises(LoRAAdapterError, match=message):
            engine.add_lora(path.name, path)
    with pytest.raises(LoRAAdapterError, match=r"rank 8 is above this engine's max_lora_rank \(4\)"):
        LLMEngine(setup.checkpoint, max_lora_rank=4).add_lora("alpha", setup.adapters["alpha"])
    # 4 slots x rank 8 x 2 layers x (3*64 + 128 + 64 + 64 + 2*64 + 256 + 128 + 64) x 4 bytes = 0.25 MiB
    with pytest.raises(LoRAAdapterError, match=r"4 slots at that rank need 0.2 MiB, over the LoRA memory budget"):
        LLMEngine(setup.checkpoint, lora_memory_gb=0.05 / 1024).add_lora("alpha", setup.adapters["alpha"])
    assert engine.lora_names == []


def test_lora_wraps_whatever_module_the_quantizer_left(setup: Setup) -> None:
    """With int8 base layers the adapter still applies: the result stays as close to the float32 adapter's
    logits as int8 keeps the base model to float32's (measured 0.08 and 0.10), far closer than the
    adapter's own effect (3.0): an adapter that int8 layers dropped would be off by that much."""
    prompt = prompts(1, seed=9)[0]

    def last_logits(engine: LLMEngine, lora: str | None) -> torch.Tensor:
        engine.add_request("r", prompt, GREEDY, lora_name=lora)
        batch = engine.scheduler.schedule()
        logits = engine.executor.execute(StepPlan.build(batch.requests, batch.num_tokens)).logits[0]
        engine.abort("r")
        return logits

    full, int8 = engine_with_adapters(setup), engine_with_adapters(setup, quantization="int8")
    base_error = (last_logits(int8, None) - last_logits(full, None)).abs().max()
    lora_error = (last_logits(int8, "alpha") - last_logits(full, "alpha")).abs().max()
    effect = (last_logits(full, "alpha") - last_logits(full, None)).abs().max()
    layer = int8.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base.method, Int8LinearMethod)  # the quantizer's
    assert lora_error < 3 * base_error + 1e-3 and effect > 5 * lora_error


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_other_families(family: str, tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases in the base) and Mixtral (attention-only adapters; experts are not linears)."""
    if family == "qwen2":
        config, targets = transformers.Qwen2Config(**TINY, tie_word_embeddings=True), ALL_PROJECTIONS
    else:
        config = transformers.MixtralConfig(**{**TINY, "intermediate_size": 64}, num_local_experts=4,
                                            num_experts_per_tok=2)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    base = make_checkpoint(tmp_path / "base", config)
    reference = make_adapter(base, tmp_path / "adapter", 7, r=4, lora_alpha=8, target_modules=targets)
    llm = LLM(tmp_path / "base")
    llm.engine.add_lora("tuned", tmp_path / "adapter")
    work = prompts(2, seed=11)
    outs = llm.generate(work, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        lora_name=["tuned", None])
    assert outs[0].token_ids == reference_tokens(reference, work[0], 16)
    assert outs[1].token_ids == reference_tokens(base, work[1], 16)


def test_waiting_for_a_slot_holds_later_adapter_requests_but_not_base_ones(setup: Setup) -> None:
    """One slot, held by a running 'alpha' request: a 'beta' request waits for it, and so does a later 'alpha'
    request (admitting it would keep the slot busy and starve 'beta'); a base-model request goes ahead."""
    engine = engine_with_adapters(setup, max_loras=1)
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], long, lora_name="alpha")
    engine.step()
    engine.add_request("b", [8, 9], long, lora_name="beta")
    engine.add_request("c", [10, 11], long, lora_name="alpha")
    engine.add_request("d", [12, 13], long)
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a", "d"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["b", "c"]
    first_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
        step += 1
    assert first_step["b"] < first_step["c"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_adapter_that_became_unreadable_fails_its_request_not_the_engine(setup: Setup, tmp_path: Path) -> None:
    shutil.copytree(setup.adapters["beta"], tmp_path / "beta")
    engine = LLMEngine(setup.checkpoint)
    engine.add_lora("beta", tmp_path / "beta")
    (tmp_path / "beta" / "adapter_model.safetensors").unlink()
    engine.add_request("lost", [5, 6, 7], GREEDY, lora_name="beta")
    engine.add_request("fine", [5, 6, 7], GREEDY)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"lost": "abort", "fine": "length"}
    assert engine.loaded_loras == frozenset() and engine.kv.num_free_blocks == engine.kv.num_blocks
