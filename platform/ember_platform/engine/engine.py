"""LLMEngine: one replica's engine — load a package, then `add_request` / `step` / `abort`.

Each `step()` schedules a batch, runs the model once over it, samples (verifying speculative
drafts where there are any), appends tokens, checks stop conditions, detokenizes, and returns
one `RequestOutput` per request that made progress. `LLM` (batch scripts) and `AsyncEngine`
(serving) are thin loops around it. Requests may name a LoRA adapter (the package's `[[lora]]`
entries, or `add_lora` at run time); requests for different adapters share one batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.plugins import PluginHost
from ember.selection import SelectionReport
from ember_platform.engine.config import ModelSource, read_hf_config, resolve_source
from ember_platform.engine.host_memory import release_pages
from ember_platform.engine.kernel_ops import KernelOps
from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.lora import check_adapter_name
from ember_platform.engine.lora_layer import lora_layouts
from ember_platform.engine.lora_manager import LoRAManager, UnknownLoRAError
from ember_platform.engine.model_runner import ForwardResult, ModelRunner, allocate_kv_caches, kv_bytes_per_block
from ember_platform.engine.models import build_model
from ember_platform.engine.models.loader import load_weights, materialize
from ember_platform.engine.outputs import RequestOutput, Usage
from ember_platform.engine.quantized_cache import QuantizedWeightCache
from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.sampler import Sampler, SamplingBatch, TokenLogprobs, make_generator
from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.engine.scheduler import Scheduler
from ember_platform.engine.speculation import Speculator, SpeculatorContext, verify_greedy, verify_rejection
from ember_platform.engine.text.detokenizer import IncrementalDetokenizer
from ember_platform.engine.text.stop import StopStringMatcher
from ember_platform.engine.text.tokenizer import Tokenizer
from ember_platform.kvtiers.identity import model_identity
from ember_platform.kvtiers.store import KVTierStore

log = logging.getLogger("ember.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREFILL_RATE_MIN_TOKENS = 64  # steps with fewer tokens are decode-bound: they say little about recomputing a prefix
CPU_KV_CACHE_DEFAULT_GB = 4.0  # like vLLM's CPU backend: a fixed budget, since host RAM is shared
NATIVE_BF16_CPU_FEATURES = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# LoRA serving knobs (engine keywords; no manifest field yet): device slots, the largest rank accepted,
# adapters kept in host memory, and an optional device-memory budget for the slots in GiB.
# A forward pass fails for the whole batch; so many in a row mean the model itself is broken, not one request.
MAX_CONSECUTIVE_FORWARD_FAILURES = 3
LORA_OPTIONS = {"max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": None, "lora_memory_gb": None}


class EngineBrokenError(RuntimeError):
    """The engine cannot run its model any more (forward passes keep failing): the replica must be replaced."""


@dataclass(slots=True)
class _RequestState:
    """Output-side state of one request: detokenizer, stop strings, its random generator."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher | None
    generator: torch.Generator | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLMEngine:
    """Loads a package (or a Hugging Face checkpoint dir) and generates for many requests at once."""

    def __init__(self, path: str | Path, **overrides: Any) -> None:
        t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        lora_options = {k: default if (v := overrides.pop(k, None)) is None else v
                        for k, default in LORA_OPTIONS.items()}
        source, engine_only = resolve_source(path, overrides)
        self.source: ModelSource = source
        self.manifest = manifest = source.manifest
        self.plugins = PluginHost.for_package(source.root) if source.is_package else PluginHost()
        self.plugins.check_manifest(manifest, source=str(source.root / "ember.toml"))
        self.hardware = self.plugins.hardware(manifest)
        self.selections: dict[str, SelectionReport] = self.plugins.select_all(manifest, self.hardware)
        self.device = torch.device("cuda" if self.hardware.is_cuda else "cpu")
        self.hf_config = read_hf_config(source.weights_dir)
        self.dtype = resolve_dtype(manifest.runtime.dtype, self.hf_config, self.device,
                                   native_bf16=bool(self.hardware.cpu_features & NATIVE_BF16_CPU_FEATURES))

        attention = self._technique("attention")
        # The kernel-op table (ember_kernel_ops): resolved once here, given to every layer and attention backend.
        self.kernel_ops = KernelOps.from_plugins(self.plugins)
        self.model = build_model(self.hf_config, attention, self.dtype, self.device, ops=self.kernel_ops)
        # Read before quantizing: a quantizer's modules need not say how their outputs are packed.
        layouts = lora_layouts(self.model, getattr(self.model, "lora_module_names", ()))
        self._checkpoint_target = self.model.checkpoint_target
        quant = self.selections["quantization"]
        self.quantized_from_cache = False
        if quant.name == "none":
            load_weights(self.model, source.weights_dir)
            self.timings["load"] = time.perf_counter() - t0
        else:
            self.model = self._load_quantized(quant, source, t0)
        self.model.eval()
        self.plugins.model_loaded(manifest, self.model, self.hardware)
        budget = lora_options["lora_memory_gb"]
        self.lora = LoRAManager(self.model, layouts, self._lora_target, max_loras=lora_options["max_loras"],
                                max_lora_rank=lora_options["max_lora_rank"],
                                max_cpu_loras=lora_options["max_cpu_loras"],
                                memory_budget_bytes=None if budget is None else budget * 2**30,
                                device=self.device, dtype=self.dtype)
        for entry in manifest.lora if source.is_package else ():
            self.lora.register(entry.name, source.root / entry.path)

        self.tokenizer = Tokenizer.from_dir(source.weights_dir)
        self.vocab_size = int(self.hf_config["vocab_size"])
        rt = manifest.runtime
        self.max_model_len = rt.max_model_len or int(self.hf_config.get("max_position_embeddings", 2048))
        self.block_size = rt.kv_block_size
        num_blocks = engine_only.get("num_kv_blocks") or self._num_kv_blocks()
        num_layers, kv_heads, head_dim = kv_cache_shape(self.hf_config)
        self._kv_cache_spec = (num_layers, num_blocks, self.block_size, kv_heads, head_dim, self.dtype, self.device)
        caches = allocate_kv_caches(*self._kv_cache_spec)
        self.sleeping = False
        # KV tiers below the device (kvtiers/): None unless the `kv_tiers` engine option turns a tier on.
        self.kv_tiers = KVTierStore.for_engine(
            engine_only.get("kv_tiers"), block_size=self.block_size, kv_caches=caches, device=self.device,
            model_id=lambda: model_identity(source.weights_dir, source.root if source.is_package else None,
                                            quantization=quant.name, quantization_options=quant.options))
        self.kv = KVCacheManager(num_blocks, self.block_size, rt.enable_prefix_caching, tiers=self.kv_tiers)
        self.scheduler = Scheduler(self.kv, max_num_seqs=rt.max_num_seqs,
                                   max_num_batched_tokens=max(rt.max_num_batched_tokens, rt.max_num_seqs),
                                   max_model_len=self.max_model_len, lora=self.lora)
        self.runner = ModelRunner(self.model, caches, self.block_size, self.device, lora=self.lora)
        self.sampler = Sampler(seed=rt.seed)
        self.speculator = self._make_speculator()
        self._states: dict[str, _RequestState] = {}
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.prefill_tokens_per_s = 0.0  # measured on large steps; 0 until one ran (the router prices tier fetches)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._forward_failures = 0  # forward passes failed in a row (see step)
        self.timings["init"] = time.perf_counter() - t0
        if self.kv_tiers is not None and self.kv_tiers.config.seed_prefixes:
            self._seed_from_tiers(self.kv_tiers.config.seed_prefixes)
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens, selections %s", manifest.reference,
                 self.hardware.describe(), num_blocks, self.block_size,
                 {k: v.name for k, v in self.selections.items()})

    # --- setup ------------------------------------------------------------------------------

    def _technique(self, kind: str) -> Any:
        name = self.selections[kind].name
        technique = self.plugins.techniques.get(kind, name)
        if technique is None:
            raise RuntimeError(f"{kind} '{name}' is selected but no installed plugin provides it")
        return technique.load()

    def _load_quantized(self, quant: SelectionReport, source: ModelSource, t0: float) -> nn.Module:
        """Load and quantize, or load the quantized weights an earlier start cached (skipping both)."""
        quantizer_cls = self._technique("quantization")
        quantizer = quantizer_cls(quant.options)
        cache = QuantizedWeightCache.default()
        key = None
        if cache is not None:
            identity = model_identity(source.weights_dir, source.root if source.is_package else None)
            key = cache.key(identity, quant.name, quant.options, self.dtype, self.device, quantizer_cls)
            state = cache.load(key)
            restored = quantizer.restore(self.model, state) if state is not None else None
            if restored is not None:
                assert state is not None
                materialize(restored, self.device, self.dtype)
                restored.load_state_dict(state, strict=False)  # norms, embeddings, skipped layers; ties share
                self.timings["load"] = time.perf_counter() - t0
                self.timings["quantize"] = 0.0
                self.quantized_from_cache = True
                return restored
            if state is not None:  # restore refused the entry: start from a clean model
                self.model = build_model(self.hf_config, self._technique("attention"), self.dtype, self.device,
                                         ops=self.kernel_ops)
        load_weights(self.model, source.weights_dir)
        self.timings["load"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        model = quantizer.quantize(self.model)
        self.timings["quantize"] = time.perf_counter() - t1
        if cache is not None and key is not None:
            cache.save(key, model)
        return model

    def _num_kv_blocks(self) -> int:
        rt = self.manifest.runtime
        num_layers, kv_heads, head_dim = kv_cache_shape(self.hf_config)
        per_block = kv_bytes_per_block(num_layers, self.block_size, kv_heads, head_dim, self.dtype)
        if rt.kv_cache_memory_gb is not None:
            budget = rt.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * rt.memory_utilization
        else:
            budget = min(CPU_KV_CACHE_DEFAULT_GB * 2**30, self.hardware.host_memory_bytes * 0.25)
        # More than every sequence at full length is never needed.
        ceiling = rt.max_num_seqs * (-(-self.max_model_len // self.block_size) + 1)
        return max(1, min(int(budget // per_block), ceiling))

    def _make_speculator(self) -> Speculator | None:
        spec = self.selections["speculator"]
        if spec.name == "none":
            return None
        cls = self._technique("speculator")
        model_dir = self.source.root / self.manifest.speculator.model if self.manifest.speculator.model else None
        context = SpeculatorContext(self.manifest.speculator.num_speculative_tokens, self.vocab_size, self.device,
                                    self.dtype, model_dir, self.hf_config)
        return cls(spec.options, context)

    def _lora_target(self, peft_module: str) -> tuple[str, Hashable | None] | None:
        """A PEFT module path (transformers' naming) -> (our LoRA layer, shard id): the checkpoint mapping."""
        target = self._checkpoint_target(f"{peft_module}.weight")
        if target is None or not target[0].endswith(".weight"):
            return None
        return target[0].removesuffix(".weight"), target[1]

    # --- LoRA adapters ----------------------------------------------------------------------

    # Like add_request, these run on the engine's thread (AsyncEngine's step loop owns the engine).

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register a PEFT adapter directory under `name` (checked now, loaded on first use)."""
        self.lora.register(check_adapter_name(name), path)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; refused while requests for it are unfinished."""
        if name not in self.lora.specs:
            raise UnknownLoRAError(name, self.lora.names)
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == name]
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise ValueError(f"LoRA adapter '{name}' is in use by unfinished requests ({shown}); abort them first")
        self.lora.unregister(name)

    @property
    def lora_names(self) -> list[str]:
        """Every adapter requests may name."""
        return self.lora.names

    @property
    def loaded_loras(self) -> frozenset[str]:
        """The adapters resident in device slots now (the router routes their requests here)."""
        return self.lora.resident

    def lora_load_seconds(self, name: str) -> float | None:
        """What loading `name` into a slot costs (measured; the mean over adapters for one never loaded)."""
        return self.lora.estimated_load_seconds(name)

    def add_lora_listener(self, callback: Callable[[frozenset[str]], None]) -> None:
        """`callback(loaded_loras)` runs on the engine's thread each time the resident set changes."""
        self.lora.add_listener(callback)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    lora_name: str | None = None, cache_salt: str | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but the model's context is {self.max_model_len} tokens "
                             "(prompt plus at least one generated token)")
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        outside = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if outside:  # the sampler indexes the vocabulary with them (to hold them back until min_tokens)
            raise ValueError(f"stop_token_ids: token ids must be in [0, {self.vocab_size}), got {outside[0]}")
        if lora_name is not None and lora_name not in self.lora.specs:
            raise UnknownLoRAError(lora_name, self.lora.names)
        if self.sleeping:  # a request is what wakes a sleeping engine
            self.wake()
        req = Request(request_id, ids, params, next(self._arrivals), lora_name=lora_name, cache_salt=cache_salt)
        stop = StopStringMatcher(params.stop) if params.stop else None
        self._states[request_id] = _RequestState(IncrementalDetokenizer(self.tokenizer, ids), stop,
                                                 make_generator(params.seed, self.device))
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); its KV blocks are freed at once."""
        req = self.scheduler.requests.get(request_id)
        self._states.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        if self.speculator:
            self.speculator.release(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step for the scheduled batch. A failure that belongs to one request (its sampling, its stop or
        output processing) fails that request alone; a failed forward pass fails the step's requests, and only
        MAX_CONSECUTIVE_FORWARD_FAILURES of those in a row (the model itself is broken) raise EngineBrokenError."""
        outputs: list[RequestOutput] = []
        batch = self.scheduler.schedule()
        outputs.extend(self._finish_output(req, []) for req in batch.refused)
        if not batch.requests:
            if self.scheduler.num_loading and self.kv_tiers is not None:
                self.kv_tiers.wait_staged(0.01)  # only prefixes being read from a tier remain: wait, don't spin
            return outputs
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(batch)
        except Exception as e:
            self._forward_failures += 1
            log.exception("the forward pass failed for %d request(s) (%d in a row)", len(batch.requests),
                          self._forward_failures)
            if self._forward_failures >= MAX_CONSECUTIVE_FORWARD_FAILURES:
                raise EngineBrokenError(f"{self._forward_failures} forward passes in a row failed") from e
            outputs.extend(self._fail(req, "the model's forward pass failed") for req in batch.requests)
            return outputs
        self._forward_failures = 0
        sampled_tokens = self._sample(result)  # reads the tokens back: the device is done with the step here
        self._measure_prefill(sum(batch.num_tokens), time.perf_counter() - t0)
        failed = {id(req) for req, tokens in zip(result.sampled, sampled_tokens, strict=True) if tokens is None}
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            if id(req) in failed:
                continue
            req.num_computed_tokens += n
            # Register full computed blocks now: a request that finishes this step frees them in _append,
            # and its prompt must still be in the prefix cache for the next request.
            self.kv.cache_blocks(req)
        for req, new_tokens in zip(result.sampled, sampled_tokens, strict=True):
            if new_tokens is None:
                outputs.append(self._fail(req, "sampling failed"))
                continue
            try:
                out = self._append(req, new_tokens)
            except Exception:
                log.exception("request %s: processing its new tokens failed", req.request_id)
                outputs.append(self._fail(req, "processing the generated tokens failed"))
                continue
            if out is not None:
                outputs.append(out)
        for req in batch.requests:
            if not req.status.finished:
                self.kv.cache_blocks(req)
        try:
            self._propose()
        except Exception:  # drafts are an optimization: a speculator that fails costs this step's drafts only
            log.exception("the speculator failed; this step has no drafts")
            for req in self.scheduler.running:
                req.spec_token_ids = []
        return outputs

    def _fail(self, req: Request, what: str) -> RequestOutput:
        """End one request with finish reason "error" (its blocks freed); the engine goes on with the others."""
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        if self.speculator:
            with contextlib.suppress(Exception):
                self.speculator.release(req.request_id)
        out = self._finish_output(req, [])
        out.error = f"the engine failed on this request: {what}"
        return out

    def _measure_prefill(self, num_tokens: int, seconds: float) -> None:
        """Track the tokens/s of steps large enough to be prefill-bound (a moving average: the load changes)."""
        if num_tokens < PREFILL_RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
            0.8 * self.prefill_tokens_per_s + 0.2 * rate

    def _sample(self, result: ForwardResult) -> list[list[int] | None]:
        """Each sampled request's new tokens (verified drafts included). If sampling the batch fails, each request
        is sampled alone, so that one whose parameters break the sampler fails alone (None) and the rest go on."""
        if not result.sampled:
            return []
        try:
            return list(self._sample_rows(result.sampled, result.num_rows, result.logits))
        except Exception:
            log.exception("sampling a batch of %d request(s) failed; sampling each alone", len(result.sampled))
        tokens: list[list[int] | None] = []
        row = 0
        for req, n in zip(result.sampled, result.num_rows, strict=True):
            try:
                tokens += self._sample_rows([req], [n], result.logits[row:row + n])
            except Exception:
                log.exception("request %s: sampling failed", req.request_id)
                tokens.append(None)
            row += n
        return tokens

    def _sample_rows(self, reqs: Sequence[Request], num_rows: Sequence[int],
                     logits: torch.Tensor) -> list[list[int]]:
        drafts = [list(r.spec_token_ids) for r in reqs]
        states = [self._states[r.request_id] for r in reqs]
        params = [r.params for r in reqs]
        needs_history = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        suppressed = [self._suppressed(r) for r in reqs]
        batch = SamplingBatch.build(
            params, vocab_size=logits.shape[-1], device=self.device,
            generators=[s.generator for s in states],
            prompt_ids=[r.prompt_token_ids for r in reqs] if needs_history else None,
            output_ids=[r.output_token_ids for r in reqs] if needs_history else None,
            suppressed_ids=suppressed if any(suppressed) else None,
            draft_ids=drafts if any(drafts) else None,
        )
        out = self.sampler.sample(logits, batch)
        token_rows = out.token_ids.tolist()
        logprob_rows = out.token_logprobs() if batch.any_logprobs else None
        probs = None
        results: list[list[int]] = []
        new_logprobs: list[tuple[_RequestState, TokenLogprobs]] = []
        row = 0
        for i, req in enumerate(reqs):
            n = num_rows[i]
            if not drafts[i]:
                results.append([token_rows[row]])
                if logprob_rows is not None and logprob_rows[row] is not None:
                    new_logprobs.append((states[i], logprob_rows[row]))
            elif req.params.greedy:
                results.append(verify_greedy(token_rows[row:row + n], drafts[i]))
            else:
                if probs is None:
                    probs = self.sampler.probs(logits, batch)
                results.append(verify_rejection(probs[row:row + n], drafts[i], None, states[i].generator))
            row += n
        # Recorded only now: when this raises part-way, the requests are sampled again one by one (see _sample).
        for state, logprobs in new_logprobs:
            state.logprobs.append(logprobs)
        for draft, tokens in zip(drafts, results, strict=True):
            if draft:
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(tokens) - 1
        return results

    def _suppressed(self, req: Request) -> set[int]:
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:
            return set()
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.eos_token_ids))

    def _append(self, req: Request, new_tokens: list[int]) -> RequestOutput | None:
        # Drafts the target rejected were computed (their KV written) but are not part of the sequence.
        num_rejected = len(req.spec_token_ids) - (len(new_tokens) - 1)
        req.num_computed_tokens -= num_rejected
        req.spec_token_ids = []
        p = req.params
        eos = self.tokenizer.eos_token_ids
        accepted: list[int] = []
        status: RequestStatus | None = None
        for tok in new_tokens:
            req.output_token_ids.append(tok)
            accepted.append(tok)
            n_out = len(req.output_token_ids)
            if n_out >= p.min_tokens:
                if tok in p.stop_token_ids:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                elif not p.ignore_eos and tok in eos:
                    status = RequestStatus.FINISHED_STOPPED
            if status is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                                   or req.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                break
        # Tokens past a stop are dropped; so is the KV computed for them.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.num_generated_tokens += len(accepted)
        state = self._states[req.request_id]
        text = state.detokenizer.step([t for t in accepted if status != RequestStatus.FINISHED_STOPPED
                                       or (t not in eos and t not in p.stop_token_ids)])
        if state.stop is not None:
            text, hit, matched = state.stop.feed(text)
            if hit:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, matched
        if status is not None:
            if state.stop is None or not state.stop.stopped:
                tail = state.detokenizer.flush()
                text += state.stop.feed(tail)[0] + state.stop.flush() if state.stop else tail
            self.scheduler.finish(req, status)
            if self.speculator:
                self.speculator.release(req.request_id)
        logprobs = state.logprobs[-len(accepted):] if state.logprobs and req.params.logprobs is not None else None
        return RequestOutput(req.request_id, accepted, text, status is not None, req.finish_reason, req.stop_reason,
                             self._usage(req), logprobs)

    def _finish_output(self, req: Request, tokens: list[int]) -> RequestOutput:
        self._states.pop(req.request_id, None)
        return RequestOutput(req.request_id, tokens, "", True, req.finish_reason, None, self._usage(req))

    def _usage(self, req: Request) -> Usage:
        return Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens)

    def _propose(self) -> None:
        if self.speculator is None:
            return
        running = self.scheduler.running
        if len(running) > self.manifest.speculator.max_batch_size:
            return  # large batches are compute-bound: drafts would cost more than they save
        eligible = [r for r in running if r.params.logprobs is None and r.num_computed_tokens == r.num_tokens - 1]
        if not eligible:
            return
        k = self.manifest.speculator.num_speculative_tokens
        for req, proposal in zip(eligible, self.speculator.propose(eligible, k), strict=True):
            if proposal is None or not proposal.token_ids:
                continue
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
            req.spec_token_ids = proposal.token_ids[:max(0, min(k, room))]

    def _seed_from_tiers(self, n: int) -> None:
        """Load the `n` hottest prefixes the replicas published into the device pool (a cold-start phase)."""
        from ember_platform.kvtiers import seed  # the tiers' own module: imported only when they are on

        report = seed(self, n)
        self.timings["kv_seed"] = report.seconds
        log.info("seeded %d KV blocks of %d hot prefixes from the tiers in %.2f s", report.blocks, report.chains,
                 report.seconds)

    # --- sleep ------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV cache, the engine's largest allocation, and keep the weights loaded.

        The state between warm and zero: where a cold start spawns a process and loads (and
        quantizes) the weights, `wake()` has nothing to load. On Linux CPUs the cache's pages go back
        to the OS in place (they read as zeros when next touched, so waking costs nothing up front);
        elsewhere the cache is freed and `wake()` reallocates it. Cached prefixes are forgotten
        (routing sees them evicted); with KV tiers on they stay in the lower tiers.
        """
        if self.sleeping:
            return
        if self.has_unfinished():
            raise RuntimeError("cannot sleep with requests in flight; drain first")
        if not self.kv.pool.reset_prefix_cache():
            raise RuntimeError("cannot sleep: KV blocks are still in use")
        in_place = self.device.type == "cpu" and release_pages(t for kv in self.runner.kv_caches for t in kv)
        if not in_place:
            self.runner.kv_caches = []
            if self.kv_tiers is not None:
                self.kv_tiers.kv_caches = []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.sleeping = True

    def wake(self) -> float:
        """Reallocate the KV cache after `sleep()`; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.sleeping:
            if not self.runner.kv_caches:  # freed, not released in place
                caches = allocate_kv_caches(*self._kv_cache_spec)
                self.runner.kv_caches = caches
                if self.kv_tiers is not None:
                    self.kv_tiers.kv_caches = list(caches)
            self.sleeping = False
        return time.perf_counter() - t0

    def forget(self, request_id: str) -> None:
        """Drop the output state of a finished request (after its last output was delivered)."""
        self._states.pop(request_id, None)

    # --- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "num_waiting_for_kv": self.scheduler.num_loading,  # their prefix is being read from a lower tier
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "generated_tokens": self.num_generated_tokens,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "lora_loaded": len(self.lora.resident),
            "lora_loads": self.lora.num_loads,
            "lora_evictions": self.lora.num_evictions,
            **(self.kv_tiers.stats() if self.kv_tiers is not None else {}),  # kv_tier_* counters
        }


def kv_cache_shape(hf_config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Llama-family or Mixtral config."""
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return int(hf_config["num_hidden_layers"]), int(hf_config.get("num_key_value_heads") or heads), head_dim


def resolve_dtype(name: str, hf_config: dict[str, Any], device: torch.device, *,
                  native_bf16: bool = True) -> torch.dtype:
    """The compute dtype: the manifest's choice, or for "auto" the checkpoint's own dtype, adjusted to
    what the device computes fast (CPUs without bf16 instructions emulate it several times slower than fp32)."""
    if name != "auto":
        return _DTYPES[name]
    checkpoint = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    dtype = _DTYPES.get(checkpoint, torch.bfloat16)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.bfloat16 if native_bf16 else torch.float32
    return dtype
