"""LLMEngine: one replica's engine core — load a package, then `add_request` / `step` / `abort`.

Each `step()` schedules a batch, turns it into a `StepPlan`, has the executor run it (one worker per rank:
model, KV cache, runner), samples (verifying speculative drafts where there are any), appends tokens, checks
stop conditions, detokenizes, and returns one `RequestOutput` per request that made progress. The core holds
the scheduler, the KV block manager and the outputs; it knows no model and no device. `LLM` (batch scripts)
and `AsyncEngine` (serving) are thin loops around it. Requests may name a LoRA adapter (the package's
`[[lora]]` entries, or `add_lora` at run time); requests for different adapters share one batch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.plugins import PluginHost
from ember.selection import SelectionReport
from ember_platform.engine.config import ModelSource, read_hf_config, resolve_source
from ember_platform.engine.executor import Executor, UniprocessExecutor
from ember_platform.engine.kernel_ops import KernelOps
from ember_platform.engine.kv_cache_manager import KVCacheManager
from ember_platform.engine.limits import check_context_length, check_kv_capacity
from ember_platform.engine.lora import check_adapter_name
from ember_platform.engine.lora_manager import LoRAManager, UnknownLoRAError
from ember_platform.engine.outputs import RequestOutput, Usage
from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.sampler import Sampler, TokenLogprobs, make_generator
from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.engine.scheduler import ScheduledBatch, Scheduler
from ember_platform.engine.spec_decode import SpecDecoder
from ember_platform.engine.spec_tree import kv_moves
from ember_platform.engine.speculation import Speculator, SpeculatorContext
from ember_platform.engine.step_plan import BlockTables, StepOutput, StepPlan
from ember_platform.engine.step_sampler import RequestState, StepSampler
from ember_platform.engine.step_threads import StepThreads
from ember_platform.engine.structured_output import GrammarCompiler, StructuredOutputError, StructuredRequests
from ember_platform.engine.text.detokenizer import IncrementalDetokenizer
from ember_platform.engine.text.stop import StopStringMatcher
from ember_platform.engine.text.tokenizer import Tokenizer
from ember_platform.engine.worker import WorkerConfig, kv_cache_shape
from ember_platform.kvtiers.identity import model_identity
from ember_platform.kvtiers.store import KVTierStore

__all__ = ["EngineBrokenError", "LLMEngine", "kv_cache_shape", "resolve_dtype"]

log = logging.getLogger("ember.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREFILL_RATE_MIN_TOKENS = 64  # steps with fewer tokens are decode-bound: they say little about recomputing a prefix
NATIVE_BF16_CPU_FEATURES = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# LoRA serving knobs (engine keywords; no manifest field yet): device slots, the largest rank accepted,
# adapters kept in host memory, and an optional device-memory budget for the slots in GiB.
# A forward pass fails for the whole batch; so many in a row mean the model itself is broken, not one request.
MAX_CONSECUTIVE_FORWARD_FAILURES = 3
LORA_OPTIONS = {"max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": None, "lora_memory_gb": None}


class EngineBrokenError(RuntimeError):
    """The engine cannot run its model any more (forward passes keep failing): the replica must be replaced."""


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
        self.device = torch.device("cuda" if self.hardware.is_cuda else "cpu")  # its type picks the dtype
        self.hf_config = read_hf_config(source.weights_dir)
        self.dtype = resolve_dtype(manifest.runtime.dtype, self.hf_config, self.device,
                                   native_bf16=bool(self.hardware.cpu_features & NATIVE_BF16_CPU_FEATURES))
        rt = manifest.runtime
        self.block_size = rt.kv_block_size
        quant = self.selections["quantization"]
        # The kernel-op table (ember_kernel_ops): resolved once here, given to every layer and attention backend.
        self.kernel_ops = KernelOps.from_plugins(self.plugins)
        worker_config = WorkerConfig(
            source=source, hf_config=self.hf_config, dtype=self.dtype, block_size=self.block_size,
            attention=self._technique("attention"), kernel_ops=self.kernel_ops, quantization=quant, manifest=manifest,
            hardware=self.hardware, plugins=self.plugins, lora_options=lora_options,
            attention_options=dict(self.selections["attention"].options))
        self.executor = self._make_executor(worker_config)
        self.device = self.executor.parallel_context(0).device  # rank 0's: logits, generators and KV tiers live there
        # Small steps on one thread or torch's, as measured (step_threads.py): only where the forward runs here.
        self.step_threads = StepThreads(isinstance(self.executor, UniprocessExecutor) and self.device.type == "cpu")
        report = self.executor.load_model()
        self.timings.update(report.timings)
        self.quantized_from_cache = report.quantized_from_cache
        self.quantization_states = report.quantization_states  # what the techniques decided (rotation's seed, ...)
        self.lora: LoRAManager | None = self.executor.lora
        package_loras = manifest.lora if source.is_package else ()
        if package_loras and self.lora is None:
            raise ValueError(f"not supported yet: [[lora]] adapters with parallel strategy "
                             f"'{self.selections['parallelism'].name}' ({type(self.executor).__name__})")
        for entry in package_loras:
            self._lora().register(entry.name, source.root / entry.path)

        self.tokenizer = Tokenizer.from_dir(source.weights_dir)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.max_model_len = rt.max_model_len or int(self.hf_config.get("max_position_embeddings", 2048))
        check_context_length(rt.max_model_len, self.hf_config, source)
        self.speculator = self._make_speculator()
        self._check_tree_attention()
        self.spec = None if self.speculator is None else SpecDecoder(
            self.speculator, num_speculative_tokens=manifest.speculator.num_speculative_tokens,
            max_batch_size=manifest.speculator.max_batch_size, max_model_len=self.max_model_len,
            adaptive=manifest.speculator.adaptive,
            num_layers=kv_cache_shape(self.hf_config)[0])
        draft_spec = self.speculator.kv_cache_spec() if self.speculator is not None else None
        num_blocks = engine_only.get("num_kv_blocks") or self._num_kv_blocks(draft_spec)
        if not engine_only.get("num_kv_blocks"):  # an explicit count (tests, benches) may be small on purpose
            check_kv_capacity(num_blocks, self.block_size, self.max_model_len, source)
        self.executor.init_kv_cache(num_blocks, draft_spec)
        if self.spec is not None and draft_spec is not None:
            self._bind_draft_kv()
        self.sleeping = False
        # KV tiers below the device (kvtiers/): None unless the `kv_tiers` engine option turns a tier on.
        tiers_option = engine_only.get("kv_tiers")
        self.kv_tiers = KVTierStore.for_engine(
            tiers_option, block_size=self.block_size, device=self.device,
            kv_caches=self.executor.kv_caches if tiers_option else [],
            model_id=lambda: model_identity(source.weights_dir, source.root if source.is_package else None,
                                            quantization=quant.name, quantization_options=quant.options))
        self.kv = KVCacheManager(num_blocks, self.block_size, rt.enable_prefix_caching, tiers=self.kv_tiers)
        self.scheduler = Scheduler(self.kv, max_num_seqs=rt.max_num_seqs,
                                   max_num_batched_tokens=max(rt.max_num_batched_tokens, rt.max_num_seqs),
                                   max_model_len=self.max_model_len, lora=self.lora)
        self.sampler = Sampler(seed=rt.seed)
        self._block_tables = BlockTables(-(-self.max_model_len // self.block_size) + 1, rows=rt.max_num_seqs)
        self._states: dict[str, RequestState] = {}
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.prefill_tokens_per_s = 0.0  # measured on large steps; 0 until one ran (the router prices tier fetches)
        self.step_sampler = StepSampler(self.sampler, self.tokenizer.eos_token_ids, self._states.__getitem__)
        # Structured outputs: grammars compiled once per constraint (the replica compiles at its edge, off the step
        # loop), one matcher per structured request.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.structured = StructuredRequests(self.grammars)
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

    def _make_executor(self, config: WorkerConfig) -> Executor:
        """The selected parallel strategy's executor ("none": one worker in this process)."""
        selection = self.selections["parallelism"]
        if selection.name == "none":
            return UniprocessExecutor(config, selection.options)
        cls = self._technique("parallelism")
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"parallel strategy '{selection.name}' is {cls!r}, which is not an Executor subclass "
                            "(ember_platform.api.Executor): its plugin registered something else")
        return cls(config, selection.options)

    def _num_kv_blocks(self, draft: Any = None) -> int:
        """As many blocks as the tightest rank's budget holds, less what the speculator will allocate itself."""
        rt = self.manifest.runtime
        budget = self.executor.available_kv_memory()
        if self.speculator is not None:
            budget -= self.speculator.memory_bytes()
        per_block = self.executor.kv_bytes_per_block(draft)
        if draft is not None and draft.scratch_blocks:  # the draft cache's own blocks past the shared ones
            budget -= draft.scratch_blocks * (per_block - self.executor.kv_bytes_per_block())
        # More than every sequence at full length is never needed.
        ceiling = rt.max_num_seqs * (-(-self.max_model_len // self.block_size) + 1)
        return max(1, min(int(budget // per_block), ceiling))

    def _make_speculator(self) -> Speculator | None:
        spec = self.selections["speculator"]
        if spec.name == "none":
            return None
        cls = self._technique("speculator")
        model_dir = self.source.root / self.manifest.speculator.model if self.manifest.speculator.model else None
        driver = self.executor.driver
        # A draft model's layers run on the selected attention backend, over its own unquantized HND cache.
        attention = functools.partial(self._technique("attention"), kv_cache_dtype="auto",
                                      **self.selections["attention"].options)
        context = SpeculatorContext(self.manifest.speculator.num_speculative_tokens, self.vocab_size, self.device,
                                    self.dtype, model_dir, self.hf_config, self.block_size,
                                    target_model=driver.model if driver is not None else None,
                                    attention_backend=attention, kernel_ops=self.kernel_ops,
                                    target_dir=self.source.weights_dir)
        return cls(spec.options, context)

    def _check_tree_attention(self) -> None:
        """A speculator that drafts trees needs an attention backend that applies tree masks (spec_tree.py)."""
        if self.speculator is None or not self.speculator.drafts_trees:
            return
        backend = self._technique("attention")
        if not getattr(backend, "supports_tree_attention", False):
            raise ValueError(f"speculator '{self.selections['speculator'].name}' drafts trees, but attention backend "
                             f"'{self.selections['attention'].name}' does not support tree attention (its class "
                             "sets no supports_tree_attention): select a backend that does, e.g. 'torch', or "
                             "draft chains (no speculator.options.tree)")

    def _bind_draft_kv(self) -> None:
        assert self.spec is not None and self.speculator is not None
        self.spec.draft_kv_caches = caches = self.executor.draft_kv_caches
        self.speculator.bind_kv_cache(caches)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts the target verified so far."""
        return self.step_sampler.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Drafts the target accepted so far."""
        return self.step_sampler.num_accepted_tokens

    @property
    def model(self) -> nn.Module:
        """Rank 0's model (executors whose rank-0 worker is in this process): for introspection and benches."""
        driver = self.executor.driver
        if driver is None or driver.model is None:
            raise RuntimeError(f"the {type(self.executor).__name__} executor's model is not in this process")
        return driver.model

    # --- LoRA adapters ----------------------------------------------------------------------

    # Like add_request, these run on the engine's thread (AsyncEngine's step loop owns the engine).

    def _lora(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError(f"not supported yet: LoRA adapters with parallel strategy "
                             f"'{self.selections['parallelism'].name}'")
        return self.lora

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register a PEFT adapter directory under `name` (checked now, loaded on first use)."""
        self._lora().register(check_adapter_name(name), path)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; refused while requests for it are unfinished."""
        lora = self._lora()
        if name not in lora.specs:
            raise UnknownLoRAError(name, lora.names)
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == name]
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise ValueError(f"LoRA adapter '{name}' is in use by unfinished requests ({shown}); abort them first")
        lora.unregister(name)

    @property
    def lora_names(self) -> list[str]:
        """Every adapter requests may name."""
        return self.lora.names if self.lora is not None else []

    @property
    def loaded_loras(self) -> frozenset[str]:
        """The adapters resident in device slots now (the router routes their requests here)."""
        return self.lora.resident if self.lora is not None else frozenset()

    def lora_load_seconds(self, name: str) -> float | None:
        """What loading `name` into a slot costs (measured; the mean over adapters for one never loaded)."""
        return self._lora().estimated_load_seconds(name)

    def add_lora_listener(self, callback: Callable[[frozenset[str]], None]) -> None:
        """`callback(loaded_loras)` runs on the engine's thread each time the resident set changes."""
        if self.lora is not None:
            self.lora.add_listener(callback)

    # --- requests ---------------------------------------------------------------------------

    @property
    def max_sequence_len(self) -> int:
        """The longest sequence (prompt and output) this engine can hold: its context, or its whole KV cache where
        that is smaller (an explicit `num_kv_blocks`; a cache sized from memory always holds the context)."""
        return min(self.max_model_len, self.kv.num_blocks * self.block_size)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    lora_name: str | None = None, cache_salt: str | None = None,
                    share_prefill_with: str | None = None) -> Request:
        """Queue a request. `share_prefill_with`: the id of a sibling added before with the same prompt, adapter and
        salt (another of n choices); this one then waits for that one's prefill and reads the prompt's full blocks
        from the prefix cache. Ignored when the sibling is gone, the prompt differs or fills no whole block."""
        params = params or SamplingParams()
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but the model's context is {self.max_model_len} tokens "
                             "(prompt plus at least one generated token)")
        if self.kv.blocks_needed(len(ids) + 1) > self.kv.num_blocks:  # could never be scheduled, even alone
            raise ValueError(f"prompt: {len(ids)} tokens, but this engine's KV cache holds "
                             f"{self.kv.num_blocks * self.block_size} tokens (prompt plus at least one generated "
                             "token)")
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        outside = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if outside:  # the sampler indexes the vocabulary with them (to hold them back until min_tokens)
            raise ValueError(f"stop_token_ids: token ids must be in [0, {self.vocab_size}), got {outside[0]}")
        biased = [token_id for token_id, _ in params.logit_bias or () if token_id >= self.vocab_size]
        if biased:  # the sampler scatters the biases into the vocabulary
            raise ValueError(f"logit_bias: token ids must be in [0, {self.vocab_size}), got {biased[0]}")
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.specs):
            raise UnknownLoRAError(lora_name, self.lora_names)
        if params.structured is not None:
            try:  # a copy of the cached grammar, unless nothing compiled it before (LLM scripts)
                self.structured.add(request_id, params.structured)
            except StructuredOutputError as e:
                raise ValueError(f"structured: {e}") from None
        if self.sleeping:  # a request is what wakes a sleeping engine
            self.wake()
        req = Request(request_id, ids, params, next(self._arrivals), lora_name=lora_name, cache_salt=cache_salt,
                      prefill_leader=self._prefill_leader(share_prefill_with, ids, params, lora_name, cache_salt),
                      num_shared_tokens=(len(ids) - 1) // self.block_size * self.block_size,
                      prompt_logprobs=params.prompt_logprobs is not None)
        stop = StopStringMatcher(params.stop) if params.stop else None
        self._states[request_id] = RequestState(IncrementalDetokenizer(self.tokenizer, ids), stop,
                                                 make_generator(params.seed, self.device))
        self.scheduler.add(req)
        return req

    def _prefill_leader(self, request_id: str | None, ids: list[int], params: SamplingParams, lora_name: str | None,
                        cache_salt: str | None) -> Request | None:
        leader = self.scheduler.requests.get(request_id) if request_id is not None else None
        if (leader is None or not self.kv.enable_prefix_caching or (len(ids) - 1) // self.block_size < 1
                or params.prompt_logprobs is not None or leader.params.prompt_logprobs is not None  # cache bypassed
                or leader.prompt_token_ids != ids or (leader.lora_name, leader.cache_salt) != (lora_name, cache_salt)):
            return None  # nothing to share: no cache, no whole block, or not the same prompt after all
        return leader

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); its KV blocks are freed at once."""
        req = self.scheduler.requests.get(request_id)
        self._states.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._release(request_id)
        return True

    def _release(self, request_id: str) -> None:
        """Forget a finished request's block-table row and speculation state (pending draft probabilities, the
        speculator's)."""
        self._block_tables.release(request_id)
        self.structured.release(request_id)
        if self.spec is not None:
            self.spec.release(request_id)

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
        with self.step_threads.running(sum(batch.num_tokens)):
            return self._run_step(batch, outputs)

    def _run_step(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`step` for a scheduled batch with requests to run."""
        t0 = time.perf_counter()
        spec = self.spec
        spec_t0 = spec.clock() if spec is not None else 0.0
        plan = StepPlan.build(batch.requests, batch.num_tokens,
                              return_hidden_states=spec is not None and spec.return_hidden_states,
                              aux_layers=spec.aux_layers if spec is not None else (),
                              block_tables=self._block_tables)
        sampled = [batch.requests[i] for i in plan.sampled]
        # The grammar masks of the structured requests are computed while the forward pass runs.
        masks = self.structured.start_masks(sampled) if len(self.structured) else None
        try:
            result = self.executor.execute(plan)
        except Exception as e:
            self._forward_failures += 1
            log.exception("the forward pass failed for %d request(s) (%d in a row)", len(batch.requests),
                          self._forward_failures)
            if self._forward_failures >= MAX_CONSECUTIVE_FORWARD_FAILURES:
                raise EngineBrokenError(f"{self._forward_failures} forward passes in a row failed") from e
            outputs.extend(self._fail(req, "the model's forward pass failed") for req in batch.requests)
            return outputs
        self._forward_failures = 0
        draft_probs = spec.take_draft_probs(sampled) if spec is not None else [None] * len(sampled)
        logits, grammar_errors = result.logits, {}
        if plan.prompt_logprob_rows:  # their rows follow the sampled ones
            num_sampled_rows = sum(plan.num_sample_rows)
            self._record_prompt_logprobs(batch.requests, plan, logits[num_sampled_rows:])
            logits = logits[:num_sampled_rows]
        try:
            logits = self.structured.apply(masks, logits, plan.num_sample_rows)
            grammar_errors = masks.errors if masks is not None else {}
        except Exception:
            log.exception("computing the grammar masks failed; the step's structured requests fail")
            grammar_errors = dict.fromkeys((r.request_id for r in sampled if r.request_id in self.structured),
                                           "its grammar's token mask could not be computed")
        # Reads the tokens back: the device is done with the step here.
        sampled_tokens = self.step_sampler.sample(sampled, plan.num_sample_rows, logits, draft_probs)
        if grammar_errors:  # their tokens were drawn without their grammar
            sampled_tokens = [None if r.request_id in grammar_errors else t
                              for r, t in zip(sampled, sampled_tokens, strict=True)]
        if spec is not None and plan.trees:  # before any block is cached: the next step sees ordinary sequences
            self._move_tree_kv(sampled, spec.tree_paths(sampled, sampled_tokens))
        seconds = time.perf_counter() - t0
        self._measure_prefill(sum(batch.num_tokens), seconds)
        if spec is not None:
            verified = [(req, tokens) for req, tokens in zip(sampled, sampled_tokens, strict=True)
                        if tokens is not None and req.spec_token_ids]
            # Requests drawing at temperature > 0 are priced apart (their rows cost more: spec_length.py).
            spec.record_step(plan.num_tokens, spec.clock() - spec_t0,
                             [(len(req.spec_token_ids), len(tokens) - 1, not req.params.greedy)
                              for req, tokens in verified],
                             [req.request_id for req, _ in verified], num_requests=len(batch.requests),
                             num_drafts=sum(map(len, plan.spec_token_ids)),
                             num_sampled=sum(not req.params.greedy for req in sampled),
                             num_sampled_drafts=sum(len(d) for d, req in zip(plan.spec_token_ids, batch.requests,
                                                                            strict=True) if not req.params.greedy))
        failed = {id(req) for req, tokens in zip(sampled, sampled_tokens, strict=True) if tokens is None}
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            if id(req) in failed:
                continue
            req.num_computed_tokens += n
            # Register full computed blocks now: a request that finishes this step frees them in _append,
            # and its prompt must still be in the prefix cache for the next request.
            self.kv.cache_blocks(req)
        num_accepted = dict.fromkeys(range(len(batch.requests)), 0)
        for i, req, new_tokens in zip(plan.sampled, sampled, sampled_tokens, strict=True):
            if new_tokens is None:
                grammar_error = grammar_errors.get(req.request_id)
                outputs.append(self._fail(req, "sampling failed" if grammar_error is None
                                          else f"its grammar failed: {grammar_error}"))
                continue
            num_accepted[i] = len(new_tokens) - 1 if req.spec_token_ids else 0
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
        if spec is not None:
            self._propose(spec, batch.requests, plan, result, num_accepted)
        return outputs

    def _move_tree_kv(self, sampled: list[Request], paths: dict[str, list[int]]) -> None:
        """Move each tree request's accepted path's KV to the positions after its root (spec_tree.kv_moves)."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for req in sampled:
            path = paths.get(req.request_id)
            if not path:
                continue
            for a, b in kv_moves(path, req.num_computed_tokens):  # the root is the newest token, not yet counted
                src.append(req.block_ids[a // bs] * bs + a % bs)
                dst.append(req.block_ids[b // bs] * bs + b % bs)
        if src:
            self.executor.move_kv(src, dst)

    def _record_prompt_logprobs(self, batch: list[Request], plan: StepPlan, logits: torch.Tensor) -> None:
        """Each prompt position's logprob of the prompt token after it, with the top alternatives (raw model
        distribution, like sampled tokens' logprobs). Positions already recorded (before a preemption) are skipped."""
        logprobs = logits.float().log_softmax(dim=-1)
        row = 0
        for i, first, count in plan.prompt_logprob_rows:
            req = batch[i]
            rows = logprobs[row:row + count]
            row += count
            state = self._states.get(req.request_id)
            if state is None or first + count <= len(state.prompt_logprobs):
                continue
            targets = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + count], device=rows.device)
            chosen = rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            k = req.params.prompt_logprobs or 0
            top_lps, top_ids = rows.topk(k, dim=-1) if k else (None, None)
            top_ids_list = top_ids.tolist() if top_ids is not None else None
            top_lps_list = top_lps.tolist() if top_lps is not None else None
            for j in range(len(state.prompt_logprobs) - first, count):
                top = list(zip(top_ids_list[j], top_lps_list[j], strict=True)) if top_ids_list and top_lps_list \
                    else []
                state.prompt_logprobs.append(TokenLogprobs(int(targets[j]), chosen[j], top))

    def _propose(self, spec: SpecDecoder, batch: list[Request], plan: StepPlan, result: StepOutput,
                 num_accepted: dict[int, int]) -> None:
        try:
            budgets = spec.draft_lengths(batch, self.scheduler.num_running)
            if budgets is None:  # no drafts this step, and the speculator need not see it
                return
            # The rows of each request that stay in its sequence: its tokens computed this step, less rejected drafts.
            num_kept = [max(0, min(n, req.num_computed_tokens - (s - n)))
                        for req, n, s in zip(batch, plan.query_lens, plan.seq_lens, strict=True)]
            spec.propose(batch, plan, result, budgets, num_kept, [num_accepted[i] for i in range(len(batch))])
        except Exception:  # drafts are an optimization: a speculator that fails costs this step's drafts only
            log.exception("the speculator failed; this step has no drafts")
            for req in batch:
                req.spec_token_ids = []
            spec.take_draft_probs(batch)

    def _fail(self, req: Request, what: str) -> RequestOutput:
        """End one request with finish reason "error" (its blocks freed); the engine goes on with the others."""
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        with contextlib.suppress(Exception):
            self._release(req.request_id)
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

    def _append(self, req: Request, new_tokens: list[int]) -> RequestOutput | None:
        # Drafts the target rejected were computed (their KV written) but are not part of the sequence.
        num_rejected = len(req.spec_token_ids) - (len(new_tokens) - 1)
        req.num_computed_tokens -= num_rejected
        req.spec_token_ids = []
        req.spec_parents = None
        p = req.params
        eos = self.tokenizer.eos_token_ids
        structured = req.request_id in self.structured
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
            if status is None and structured and self.structured.accept(req.request_id, tok):
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: only EOS could follow
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
            self._release(req.request_id)
        logprobs = state.logprobs[-len(accepted):] if state.logprobs and req.params.logprobs is not None else None
        first_output = len(req.output_token_ids) == len(accepted)
        prompt_logprobs = state.prompt_logprobs if first_output and p.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, accepted, text, status is not None, req.finish_reason, req.stop_reason,
                             self._usage(req), logprobs, prompt_logprobs=prompt_logprobs)

    def _finish_output(self, req: Request, tokens: list[int]) -> RequestOutput:
        self._states.pop(req.request_id, None)
        return RequestOutput(req.request_id, tokens, "", True, req.finish_reason, None, self._usage(req))

    def _usage(self, req: Request) -> Usage:
        return Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens)

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
        self.executor.sleep()
        if self.kv_tiers is not None:
            self.kv_tiers.kv_caches = list(self.executor.kv_caches)  # empty where the cache was freed
        self.sleeping = True

    def wake(self) -> float:
        """Reallocate the KV cache after `sleep()`; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.sleeping:
            self.executor.wake()
            if self.kv_tiers is not None:
                self.kv_tiers.kv_caches = list(self.executor.kv_caches)
            if self.speculator is not None and self.speculator.kv_cache_spec() is not None:
                self._bind_draft_kv()
            self.sleeping = False
        return time.perf_counter() - t0

    def forget(self, request_id: str) -> None:
        """Drop the output state of a finished request (after its last output was delivered)."""
        self._states.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, process groups); the engine is unusable afterwards."""
        self.executor.shutdown()
        self.structured.shutdown()

    # --- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        lora = self.lora
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "num_waiting_for_kv": self.scheduler.num_loading,  # their prefix is being read from a lower tier
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "prefix_cache_queried_tokens": self.kv.num_prefix_queries,  # admitted requests' tokens looked up
            "prefix_cache_hit_tokens": self.kv.num_prefix_hits,  # of those, found cached (not computed)
            "generated_tokens": self.num_generated_tokens,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "grammars_compiled": self.grammars.num_compiled,
            "grammar_cache_hits": self.grammars.num_cache_hits,
            "grammar_masked_rows": self.structured.num_masked_rows,
            **(self.spec.length_stats() if self.spec is not None else {}),
            "lora_loaded": len(lora.resident) if lora is not None else 0,
            "lora_loads": lora.num_loads if lora is not None else 0,
            "lora_evictions": lora.num_evictions if lora is not None else 0,
            **(self.kv_tiers.stats() if self.kv_tiers is not None else {}),  # kv_tier_* counters
        }


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
