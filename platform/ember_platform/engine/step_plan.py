"""What the engine core sends an executor each step (`StepPlan`), and what comes back (`StepOutput`).

A plan holds plain facts about the batch (token ids, positions, block tables, which rows to sample, the
drafts being verified, LoRA adapters, which hidden states to return), built once per step with tensor ops
rather than per-token Python loops, on the host: the worker moves them to its device. It names no model
and no device, so an executor may run it in-process or ship it to workers elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ember_platform.engine.request import Request


@dataclass(slots=True)
class StepPlan:
    """One step of B requests and T tokens (each request's new tokens are the last `query_lens[i]` positions of
    its context; `seq_lens[i]` counts this step's tokens)."""

    request_ids: list[str]  # [B] batch order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (read, then masked by seq_lens)
    sample_rows: torch.Tensor  # [N] int64: the token rows whose logits are returned, grouped by request
    sampled: list[int]  # batch indices of the requests sampled this step, in `sample_rows` order
    num_sample_rows: list[int]  # rows each sampled request owns: 1 + the drafts it verifies
    spec_token_ids: list[list[int]]  # [B] the drafts scheduled for verification (empty for most)
    lora_names: list[str | None]  # [B] the adapter each request runs with
    return_hidden_states: bool = False  # the final (normed) hidden state of every token, for a speculator
    aux_layers: tuple[int, ...] = ()  # layers whose input hidden state (the residual stream) to return, all tokens
    # (batch index, first position, count): prompt positions whose logits give the next prompt token's logprob
    # (params.prompt_logprobs); their rows follow every sampled row in `sample_rows`, in this order.
    prompt_logprob_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # Tree drafts (spec_tree.py): (batch index, parents of its scheduled drafts) for requests whose drafts form a
    # tree; their drafts keep sequence positions (`positions`: their KV slots) root + 1 + i, while the model computes
    # them at `rope_positions` (root + depth). Both empty / None when no request of the step has a tree.
    trees: list[tuple[int, list[int]]] = field(default_factory=list)
    rope_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def query_start_loc(self) -> list[int]:
        """[B + 1]: request i owns token rows query_start_loc[i]:query_start_loc[i + 1]."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    @classmethod
    def build(cls, requests: Sequence[Request], num_tokens: Sequence[int], *, return_hidden_states: bool = False,
              aux_layers: tuple[int, ...] = (), block_tables: BlockTables | None = None) -> StepPlan:
        """The plan for `requests` computing `num_tokens[i]` new tokens each (the scheduler's batch).

        `block_tables`: the engine's persistent rows (each step then copies only new block ids); without it the
        tables are built from the requests' lists."""
        input_ids: list[int] = []
        starts: list[int] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        num_sample_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_logprob_rows: list[tuple[int, int, int]] = []
        trees: list[tuple[int, list[int], int]] = []  # (batch index, parents, row of its root)
        for i, (req, n) in enumerate(zip(requests, num_tokens, strict=True)):
            start = req.num_computed_tokens
            offset = len(input_ids)
            known, prompt = req.num_tokens, req.num_prompt_tokens
            end = start + n
            # Slices, not a per-token lookup: the prompt part, the output part, then drafts past the known tokens.
            if start < prompt:
                input_ids += req.prompt_token_ids[start:min(end, prompt)]
            if end > prompt and start < known:
                input_ids += req.output_token_ids[max(start, prompt) - prompt:min(end, known) - prompt]
            if end > known:
                input_ids += req.spec_token_ids[:end - known]
                if req.spec_parents is not None and (tree := req.spec_tree) is not None:
                    trees.append((i, tree[:end - known], offset + known - 1 - start))
            starts.append(start)
            if req.prompt_logprobs and start < prompt - 1:
                last = min(end, prompt - 1)  # position prompt - 1 predicts the first output token: sampled
                prompt_rows.extend(range(offset, offset + last - start))
                prompt_logprob_rows.append((i, start, last - start))
            if end >= known:  # reaches the newest token: sample it (and verify any drafts)
                first = known - 1 - start
                sample_rows.extend(range(offset + first, offset + n))
                sampled.append(i)
                num_sample_rows.append(n - first)
        query_lens = list(num_tokens)
        lens = torch.tensor(query_lens, dtype=torch.long)
        total = len(input_ids)
        # positions: start_i + (t - offset_i) for each token t of request i, without a Python loop per token.
        offsets = torch.cumsum(lens, 0) - lens
        shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - offsets, lens, output_size=total)
        positions = torch.arange(total, dtype=torch.long) + shift
        rope_positions = None
        if trees:
            from ember_platform.engine.spec_tree import depths

            rope_positions = positions.clone()
            for _, parents, root_row in trees:
                rope_positions[root_row + 1:root_row + 1 + len(parents)] = \
                    positions[root_row] + torch.tensor(depths(parents), dtype=torch.long)
        if block_tables is not None:
            tables = block_tables.rows(requests)
        else:
            lists = [r.block_ids for r in requests]
            width = max((len(t) for t in lists), default=0)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in lists], dtype=torch.int32).view(len(lists),
                                                                                                         width)
        return cls(
            request_ids=[r.request_id for r in requests],
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=positions,
            query_lens=query_lens,
            seq_lens=[s + n for s, n in zip(starts, query_lens, strict=True)],
            block_tables=tables,
            sample_rows=torch.tensor(sample_rows + prompt_rows, dtype=torch.long),
            sampled=sampled,
            num_sample_rows=num_sample_rows,
            spec_token_ids=[list(r.spec_token_ids) for r in requests],
            lora_names=[r.lora_name for r in requests],
            return_hidden_states=return_hidden_states,
            aux_layers=tuple(aux_layers),
            prompt_logprob_rows=prompt_logprob_rows,
            trees=[(i, parents) for i, parents, _ in trees],
            rope_positions=rope_positions,
        )


class BlockTables:
    """Each running request's block table as a row of one persistent int32 tensor, so that a step copies only
    the block ids a request gained since its last step (a decode step: usually none) instead of every table."""

    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.table = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32)
        self._rows: dict[str, tuple[int, list[int], int]] = {}  # request id -> (row, its block list, ids written)
        self._free = list(range(rows - 1, -1, -1))

    def rows(self, requests: Sequence[Request]) -> torch.Tensor:
        """[B, longest table] the requests' rows (padded with what the row held before: masked by seq_lens)."""
        index, width = [], 0
        for req in requests:
            ids = req.block_ids
            entry = self._rows.get(req.request_id)
            if entry is None:
                entry = (self._take(), ids, 0)
            row, written_list, written = entry
            if written_list is not ids:  # freed (preempted) and allocated again: a new list, from the start
                written = 0
            if len(ids) > self.table.shape[1]:
                self.table = torch.cat([self.table, torch.zeros_like(self.table)[:, :len(ids)]], dim=1)
            if len(ids) > written:
                self.table[row, written:len(ids)] = torch.tensor(ids[written:], dtype=torch.int32)
            self._rows[req.request_id] = (row, ids, len(ids))
            index.append(row)
            width = max(width, len(ids))
        return self.table[torch.tensor(index, dtype=torch.long), :width]

    def release(self, request_id: str) -> None:
        entry = self._rows.pop(request_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def _take(self) -> int:
        if not self._free:  # more requests hold rows than ever before: double the rows
            old = self.table
            self.table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=torch.int32)
            self.table[:old.shape[0]] = old
            self._free = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))
        return self._free.pop()


@dataclass(slots=True)
class StepOutput:
    """The driver worker's results for one plan, on its device."""

    logits: torch.Tensor  # [N, V] float32, one row per `plan.sample_rows` entry
    hidden_states: torch.Tensor | None = None  # [T, D] final hidden states, when the plan asked
    aux_hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, D], as asked
