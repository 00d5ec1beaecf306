"""The speculator contract (documented engine API for speculator plugins) and greedy verification.

A speculator proposes up to k draft tokens per request; the engine feeds them to the target model
together with the request's newest token, in one pass, and keeps the longest prefix the target
agrees with plus one token of its own. The scheduler only ever sees `request.spec_token_ids`, so
proposers of any kind fit without changing it:

* prompt lookup (`ngram`): deterministic, no model — `Proposal.probs` is None;
* a draft model: returns its distributions in `Proposal.probs`; the engine keeps them until the target
  verifies the drafts (`rejection.rejection_sample`), so sampling at temperature > 0 keeps the target's
  distribution exactly. It may declare its own paged KV cache (`kv_cache_spec`), sized with the target's;
* Medusa / EAGLE heads: `uses_hidden_states = True` (the final hidden state of every scheduled token)
  and `aux_layers()` (EAGLE-3: low, middle and high layers), read from `SpeculatorInputs` each step.

Device memory a speculator allocates itself (its weights, buffers) is declared by `memory_bytes()`,
which the engine subtracts from the KV-cache budget before sizing the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ember_platform.engine.attention import AttentionMetadata, KVCache
from ember_platform.engine.request import Request
from ember_platform.engine.spec_tree import check_tree, is_chain

if TYPE_CHECKING:
    from ember_platform.engine.step_plan import StepPlan


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one request; `probs` [k, V] is the draft distribution each token was drawn from, or None
    when the proposer is deterministic (then it is the point mass on each token).

    `parents` makes the drafts a tree (spec_tree.py): for each node the index of its parent node, -1 for the
    request's newest token, nodes in topological order. None (or `[-1, 0, 1, ...]`) is a chain. Trees must be
    deterministic (`probs` None) and need a speculator that sets `drafts_trees` and an attention backend with
    `supports_tree_attention`."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] < len(self.token_ids)):
            raise ValueError(f"Proposal.probs must be [k, V] with k >= {len(self.token_ids)} drafts, got "
                             f"{tuple(self.probs.shape)}")
        if self.parents is not None:
            check_tree(self.parents, len(self.token_ids))
            if self.probs is not None and not is_chain(self.parents):
                raise ValueError("Proposal: tree drafts (parents) must be deterministic (probs None)")


@dataclass(frozen=True, slots=True)
class DraftKVSpec:
    """A speculator's own paged KV cache: the same number of blocks as the target's, so a request's block
    table (and each token's slot) addresses both; per layer a (k, v) pair in the default ("HND") layout.

    `scratch_blocks` more blocks follow the shared ones (ids `num_blocks ..`, budgeted with the cache): a draft
    model writes the KV of the positions it drafts, which may lie past the blocks the request holds yet; it maps
    those positions to scratch blocks of its own for the step."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | None = None  # None: the target's dtype
    scratch_blocks: int = 0


@dataclass(slots=True)
class SpeculatorContext:
    """What a speculator may need to set itself up."""

    num_speculative_tokens: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    model_dir: Path | None = None  # the package's [speculator] model directory, if any
    target_config: Mapping[str, Any] = field(default_factory=dict)
    block_size: int = 16  # tokens per KV block (for a draft KV cache's slots)
    # The target model when it lives in this process (None under a strategy that keeps it in other processes):
    # heads that share its LM head or embeddings (Medusa, EAGLE) use its `lm_head` / `model.embed_tokens`.
    target_model: torch.nn.Module | None = None
    # For a draft model run with the engine's own model code: the selected attention backend as a factory called
    # `attention_backend(layer=AttentionLayerSpec, ops=KernelOps)` over an unquantized cache in the default layout
    # (what a `DraftKVSpec` cache is), the engine's kernel-op table, and the target's checkpoint directory (its
    # tokenizer, which a draft model must share).
    attention_backend: Any = None
    kernel_ops: Any = None
    target_dir: Path | None = None

    @property
    def num_target_layers(self) -> int:
        return int(self.target_config.get("num_hidden_layers", 0))


@dataclass(slots=True)
class SpeculatorInputs:
    """One step as a speculator sees it, after the target verified the step's drafts.

    Rows of `token_ids` / `positions` / the hidden states are the step's scheduled tokens, every request of the
    batch: request i owns rows `query_start_loc[i]` .. `query_start_loc[i] + num_kept[i]` that stay in its
    sequence (its rejected drafts, computed but dropped, come after those and are not part of it). `token_ids` and
    `positions` are the step plan's (on the host); hidden states, filled only when the speculator asked for them,
    are on the target's device. After a step that verified a tree (spec_tree.py), each tree request's rows are
    reordered: its newest token, its accepted path, then its other nodes, with `positions` the ones the model
    computed them at (root + depth), so its kept rows read as a chain's (and its KV was moved to match); `plan` is
    the step as run (node order).
    """

    batch: list[Request]  # every request of the step, in batch order (their new tokens already appended)
    propose_for: list[int]  # batch indices of the requests to propose drafts for, in order
    num_speculative_tokens: int
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [B + 1]
    num_kept: list[int]  # [B]
    num_accepted: list[int]  # [B] drafts the target accepted this step (0 where none were verified)
    num_drafts: list[int] = field(default_factory=list)  # [B] drafts the target verified this step (empty: unknown)
    hidden_states: torch.Tensor | None = None  # [T, D] final (normed) hidden states, if `uses_hidden_states`
    aux_hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, D], if asked
    draft_kv_caches: list[KVCache] = field(default_factory=list)  # the speculator's own, if it declared one
    plan: StepPlan | None = None  # the step as the target ran it (block tables, query and sequence lengths)
    block_size: int = 16

    def attention_metadata(self, device: torch.device | str | None = None) -> AttentionMetadata:
        """The paged-attention metadata of this step's tokens (their slots in the target's blocks, which index a
        draft KV cache too): what a draft model needs to write its KV for these tokens and attend over them."""
        from ember_platform.engine.model_runner import plan_metadata  # the worker's builder: one way to build it

        if self.plan is None:
            raise ValueError("these inputs carry no step plan")
        return plan_metadata(self.plan, self.block_size, torch.device(device or self.token_ids.device))

    @property
    def requests(self) -> list[Request]:
        """The requests to propose for (what `propose` returns one entry for)."""
        return [self.batch[i] for i in self.propose_for]

    def rows(self, i: int) -> slice:
        """Batch request i's kept rows."""
        start = self.query_start_loc[i]
        return slice(start, start + self.num_kept[i])

    def last_rows(self, indices: Sequence[int] | None = None) -> torch.Tensor:
        """[n] the row of each request's last kept token (default: the requests proposed for), on the hidden states'
        device: `inputs.hidden_states[inputs.last_rows()]` is each request's newest hidden state."""
        indices = self.propose_for if indices is None else indices
        rows = [self.query_start_loc[i] + self.num_kept[i] - 1 for i in indices]
        hidden = self.hidden_states if self.hidden_states is not None else next(iter(self.aux_hidden_states.values()),
                                                                                 self.token_ids)
        return torch.tensor(rows, dtype=torch.long, device=hidden.device)


class Speculator(ABC):
    """Proposes draft tokens. Subclasses are registered with `ember_speculators`.

    Constructed once per engine, after the model loads and before the KV cache is sized. `propose` is called
    once per step that ran the model (with `propose_for` empty when no request can take drafts), so a
    speculator that keeps per-request state (a draft KV cache) sees every token, prompts included; one that
    does not need the steps without drafts (stateless, or catching up lazily from the requests' tokens) sets
    `sees_steps_without_drafts = False`, and the engine skips those calls (at a large batch, most steps).
    """

    uses_hidden_states: ClassVar[bool] = False  # the final hidden state of every scheduled token
    sees_steps_without_drafts: ClassVar[bool] = True
    # Proposes trees (`Proposal.parents`); the engine then requires an attention backend that supports tree
    # attention. An instance may set it from its options (Medusa: `tree`).
    drafts_trees: bool = False

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        self.options = dict(options)
        self.context = context
        self.kv_caches: list[KVCache] = []

    def aux_layers(self) -> tuple[int, ...]:
        """Layers whose input hidden state (transformers' `hidden_states[i]`; 0 = the embeddings) to receive for
        every scheduled token, e.g. EAGLE-3's `(2, n // 2, n - 3)` for `n = context.num_target_layers`."""
        return ()

    def memory_bytes(self) -> int:
        """Device memory this speculator allocates itself (weights, buffers; not its KV cache), in bytes."""
        return 0

    def kv_cache_spec(self) -> DraftKVSpec | None:
        """The paged KV cache this speculator wants the engine to allocate beside the target's, or None."""
        return None

    def bind_kv_cache(self, kv_caches: list[KVCache]) -> None:
        """Receive the cache `kv_cache_spec` asked for (again after the engine sleeps and wakes)."""
        self.kv_caches = kv_caches

    @abstractmethod
    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        """Up to `inputs.num_speculative_tokens` drafts for each request of `inputs.requests` (None or an empty
        proposal: no drafts)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional: proposers with state free it
        """Forget a finished request (draft models free its draft KV here)."""


def verify_greedy(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """Greedy verification: `target_ids` are the target's choices at each of the k+1 positions.

    Accept drafts while they equal the target's choice; then add the target's own token. The
    result is exactly what greedy decoding without speculation would have produced.
    """
    accepted = []
    for i, draft in enumerate(draft_ids):
        if target_ids[i] != draft:
            break
        accepted.append(draft)
    accepted.append(target_ids[len(accepted)])
    return accepted
