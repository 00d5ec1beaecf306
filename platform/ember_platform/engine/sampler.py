"""Batched sampling: penalties, temperature, top-k, top-p and min-p in one vectorized pass over [N, V] logits.

Rows of a `SamplingBatch` are rows of the logits. A request normally owns one row; when speculative tokens
are verified it owns 1 + K consecutive rows (`draft_ids`), one per position, which share its params and its
generator, and consume that generator in position order.

Order of processing, as in Hugging Face `generate`: suppressed ids -> logit bias -> repetition penalty -> presence
and frequency penalties -> temperature -> top-k -> top-p -> min-p. Greedy rows take the argmax after penalties
(the later steps never change it) and consume no randomness.

Logprobs are those of the raw model distribution (log_softmax of the unprocessed logits), as OpenAI and
vLLM report them: a client sees what the model thought, independent of its own sampling settings.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ember_platform.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch seeds are 64-bit; any Python int seed maps into that range


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The generator a seeded request owns for its whole life (None when unseeded: it shares the sampler's)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def pad_token_ids(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged token ids -> [len(rows), max(1, longest)] LongTensor padded with `pad_id`.

    The sampler pads with the vocabulary size: scatters land in one spare column that is then dropped.
    """
    width = max(1, max((len(row) for row in rows), default=0))
    padded = [[*row, *([pad_id] * (width - len(row)))] for row in rows]
    return _to_device(torch.tensor(padded, dtype=torch.long), torch.device(device))


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for one step, built once from the requests' params (see `build`).

    Optional tensors are None when no row needs that step, so the sampler skips it.
    """

    params: tuple[SamplingParams, ...]  # per logits row
    generators: tuple[torch.Generator | None, ...]  # per logits row; None = the sampler's shared one
    vocab_size: int
    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor | None  # [N] float32, 1 on greedy rows; None when every row is 1 or greedy
    top_k: torch.Tensor | None  # [N] long, vocab_size where off
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    repetition_penalty: torch.Tensor | None  # [N] float32
    presence_penalty: torch.Tensor | None  # [N] float32
    frequency_penalty: torch.Tensor | None  # [N] float32
    prompt_ids: torch.Tensor | None  # [B, Lp] padded with vocab_size; rows without repetition penalty empty
    output_ids: torch.Tensor | None  # [B, Lo] padded with vocab_size; rows without penalties empty
    draft_prefix_ids: torch.Tensor | None  # [N, K]: row of position j holds the request's drafts[:j]
    suppressed_ids: torch.Tensor | None  # [B, Ls] padded with vocab_size
    logit_bias_ids: torch.Tensor | None  # [B, Lb] token ids each request biases, padded with vocab_size
    logit_bias_values: torch.Tensor | None  # [B, Lb] float32 biases, 0 in the padding
    row_index: torch.Tensor | None  # [N] request of each row; None when each request owns one row
    seeded_random_rows: tuple[int, ...]  # non-greedy rows with their own generator
    any_shared_random: bool  # some non-greedy row draws from the shared generator
    max_num_logprobs: int  # widest top-n asked for
    any_logprobs: bool

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return not self.seeded_random_rows and not self.any_shared_random

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
        output_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
        suppressed_ids: Sequence[Collection[int]] | None = None,
        draft_ids: Sequence[Sequence[int]] | None = None,
        draft_parents: Sequence[Sequence[int] | None] | None = None,
    ) -> SamplingBatch:
        """One entry per request in every sequence argument.

        generators: from `make_generator`, owned by each request (required for seeded requests).
        prompt_ids / output_ids: token histories, needed only when some request has a penalty; a tensor
            is taken as already padded with `vocab_size` (an engine may keep the prompt one between steps).
        suppressed_ids: ids to mask to -inf per request (EOS and stop ids before min_tokens).
        draft_ids: speculative tokens to verify; request r then owns 1 + len(draft_ids[r]) rows, and the
            penalties of position j also count drafts[:j] as output.
        draft_parents: per request None (a chain) or its drafts' tree (spec_tree.py): then the penalties of the row
            after node i count the drafts on the path to node i.
        """
        device = torch.device(device)
        num_requests = len(params)
        if generators is None:
            generators = [None] * num_requests
        for name, value in (("generators", generators), ("prompt_ids", prompt_ids), ("output_ids", output_ids),
                            ("suppressed_ids", suppressed_ids), ("draft_ids", draft_ids)):
            if value is not None and len(value) != num_requests:
                raise ValueError(f"{name} has {len(value)} entries for {num_requests} requests")
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"request {i} has seed={p.seed} but no generator: make one with make_generator")

        repeats = [1 + len(d) for d in draft_ids] if draft_ids is not None else [1] * num_requests
        rows = [i for i, n in enumerate(repeats) for _ in range(n)]
        row_params = tuple(params[i] for i in rows)
        row_generators = tuple(generators[i] for i in rows)

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=dtype), device)

        def optional(values: list[float], neutral: float) -> torch.Tensor | None:
            return column(values, torch.float32) if any(v != neutral for v in values) else None

        greedy = [p.greedy for p in row_params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(row_params, greedy, strict=True)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in row_params]
        repetition = [p.repetition_penalty for p in params]
        output_penalized = [p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params]
        needs_output = [r != 1 or o for r, o in zip(repetition, output_penalized, strict=True)]

        def histories(ids: Sequence[Sequence[int]] | torch.Tensor | None, needed: list[bool],
                      name: str) -> torch.Tensor | None:
            if not any(needed):
                return None
            if ids is None:
                raise ValueError(f"{name} is needed: a request has a penalty that counts those tokens")
            if isinstance(ids, torch.Tensor):
                return ids.to(device)
            return pad_token_ids([row if need else () for row, need in zip(ids, needed, strict=True)],
                                 vocab_size, device)

        draft_prefix = None
        if draft_ids is not None and any(needs_output):
            draft_prefix = pad_token_ids([_draft_prefix(d, None if draft_parents is None else draft_parents[r], j)
                                          if needs_output[r] else () for r, d in enumerate(draft_ids)
                                          for j in range(len(d) + 1)], vocab_size, device)
        seeded_random = tuple(i for i, (g, gen) in enumerate(zip(greedy, row_generators, strict=True))
                              if not g and gen is not None)
        num_logprobs = [p.logprobs for p in row_params if p.logprobs is not None]
        biases = [p.logit_bias or () for p in params]
        bias_ids = bias_values = None
        if any(biases):
            width = max(len(b) for b in biases)
            bias_ids = pad_token_ids([[token_id for token_id, _ in b] for b in biases], vocab_size, device)
            bias_values = _to_device(torch.tensor([[v for _, v in b] + [0.0] * (width - len(b)) for b in biases],
                                                  dtype=torch.float32), device)
        return cls(
            params=row_params,
            generators=row_generators,
            vocab_size=vocab_size,
            greedy=column(greedy, torch.bool),
            temperature=optional(temperatures, 1.0),
            top_k=column(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=optional([p.top_p for p in row_params], 1.0),
            min_p=optional([p.min_p for p in row_params], 0.0),
            repetition_penalty=optional([p.repetition_penalty for p in row_params], 1.0),
            presence_penalty=optional([p.presence_penalty for p in row_params], 0.0),
            frequency_penalty=optional([p.frequency_penalty for p in row_params], 0.0),
            prompt_ids=histories(prompt_ids, [r != 1 for r in repetition], "prompt_ids"),
            output_ids=histories(output_ids, needs_output, "output_ids"),
            draft_prefix_ids=draft_prefix,
            suppressed_ids=(pad_token_ids([sorted(s) for s in suppressed_ids], vocab_size, device)
                            if suppressed_ids is not None and any(suppressed_ids) else None),
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            row_index=column(rows, torch.long) if draft_ids is not None else None,
            seeded_random_rows=seeded_random,
            any_shared_random=any(not g and gen is None for g, gen in zip(greedy, row_generators, strict=True)),
            max_num_logprobs=max(num_logprobs, default=0),
            any_logprobs=bool(num_logprobs),
        )


def _draft_prefix(drafts: Sequence[int], parents: Sequence[int] | None, row: int) -> list[int]:
    """The drafts before row `row` of a verifying request: drafts[:row] for a chain, the path to node row - 1 in a
    tree."""
    if parents is None:
        return list(drafts[:row])
    path, node = [], row - 1
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled token's raw logprob and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    logprobs: torch.Tensor | None  # [N] float32: raw logprob of each sampled token; None when no row asked
    top_token_ids: torch.Tensor | None  # [N, max_num_logprobs], most likely first
    top_logprobs: torch.Tensor | None  # [N, max_num_logprobs]
    num_logprobs: tuple[int | None, ...]  # what each row asked for
    probs: torch.Tensor | None = None  # [N, V] what each row was drawn from (`Sampler.probs`), if asked for

    def token_logprobs(self) -> list[TokenLogprobs | None]:
        """Per row, what it asked for (None where it asked for no logprobs), with one device sync."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        token_ids, logprobs = self.token_ids.tolist(), self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist() if self.top_token_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        result: list[TokenLogprobs | None] = []
        for i, n in enumerate(self.num_logprobs):
            if n is None:
                result.append(None)
                continue
            top = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if n and top_ids and top_lps else []
            result.append(TokenLogprobs(token_ids[i], logprobs[i], top))
        return result


def _id_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # ids: [R, L] padded with vocab_size -> [R, V] bool
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def _per_row(per_request: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return per_request if batch.row_index is None else per_request.index_select(0, batch.row_index)


class Sampler:
    """Samples one token per logits row. Owns the generator shared by unseeded rows (one per device)."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from on `device` (a rejection sampler draws from it too)."""
        return self._shared_generator(device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed & _SEED_MASK)
            self._shared[device] = generator
        return self._shared[device]

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, *, keep_probs: bool = False) -> SamplerOutput:
        """logits: [N, V], any float dtype (computed in float32) -> one token per row, plus logprobs; `keep_probs`:
        and the distributions `probs` would return (for rejection sampling), without processing the logits twice."""
        self._check(logits, batch)
        logits = logits.float()
        processed = self.process_logits(logits, batch)
        probs = processed.softmax(dim=-1)
        token_ids = self.sample_from_probs(probs, batch, greedy_logits=processed)
        kept = self._one_hot_greedy(probs, processed, batch) if keep_probs else None
        logprobs = top_ids = top_lps = None
        if batch.any_logprobs:
            raw = logits.log_softmax(dim=-1)
            logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            if batch.max_num_logprobs:
                top_lps, top_ids = raw.topk(batch.max_num_logprobs, dim=-1)  # sorted, most likely first
        return SamplerOutput(token_ids, logprobs, top_ids, top_lps, tuple(p.logprobs for p in batch.params), kept)

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution `sample` draws each row from: [N, V] float32; one-hot at the argmax on greedy rows.

        For speculative decoding: a rejection sampler compares these target probabilities with the draft's.
        """
        self._check(logits, batch)
        processed = self.process_logits(logits.float(), batch)
        return self._one_hot_greedy(processed.softmax(dim=-1), processed, batch)

    @staticmethod
    def _one_hot_greedy(probs: torch.Tensor, processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.greedy.any():
            one_hot = torch.zeros_like(probs).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(batch.greedy.unsqueeze(1), one_hot, probs)
        return probs

    def sample_from_probs(self, probs: torch.Tensor, batch: SamplingBatch,
                          greedy_logits: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of `probs` [N, V]: argmax on greedy rows, else an exponential race.

        argmax(p / E) with E ~ Exponential(1) i.i.d. picks token t with probability p[t]. Each seeded row
        draws its noise from its own generator only, so its tokens do not depend on the rest of the batch.
        A rejection sampler can reuse this to draw its recovered tokens.
        """
        greedy_ids = (probs if greedy_logits is None else greedy_logits).argmax(dim=-1)
        if batch.all_greedy:
            return greedy_ids
        noise = torch.empty_like(probs, dtype=torch.float32)
        if batch.any_shared_random:
            noise.exponential_(generator=self._shared_generator(probs.device))
        else:
            noise.fill_(1.0)
        for row in batch.seeded_random_rows:
            noise[row].exponential_(generator=batch.generators[row])
        # An exponential draw of exactly 0 would turn a masked token's 0 / 0 into NaN, which argmax picks.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_ids, sampled)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, suppression, temperature, top-k, top-p, min-p: a new float32 [N, V] tensor."""
        x = logits.to(torch.float32, copy=True)  # [N, V]
        vocab_size = x.shape[-1]
        if batch.suppressed_ids is not None:
            x.masked_fill_(_per_row(_id_mask(batch.suppressed_ids, vocab_size), batch), _NEG_INF)
        if batch.logit_bias_ids is not None and batch.logit_bias_values is not None:
            bias = torch.zeros(batch.logit_bias_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=x.device)
            bias.scatter_add_(1, batch.logit_bias_ids, batch.logit_bias_values)  # the padding lands in the spare column
            x += _per_row(bias[:, :vocab_size], batch)
        x = self._apply_penalties(x, batch)
        if batch.all_greedy:
            return x  # nothing below moves the argmax
        if batch.temperature is not None:
            x.div_(batch.temperature.unsqueeze(1))
        if batch.top_k is not None or batch.top_p is not None:
            x = _apply_top_k_top_p(x, batch.top_k, batch.top_p)
        if batch.min_p is not None:
            probs = x.softmax(dim=-1)
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            x.masked_fill_(probs < threshold, _NEG_INF)
        return x

    @staticmethod
    def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.output_ids is None:
            return x
        vocab_size = x.shape[-1]
        # counts: [N, V] how often each token is in the output so far (plus earlier drafts)
        ids = batch.output_ids
        counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=x.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        counts = _per_row(counts, batch)
        if batch.draft_prefix_ids is not None:
            drafts = batch.draft_prefix_ids
            counts.scatter_add_(1, drafts, torch.ones_like(drafts, dtype=torch.float32))
        counts = counts[:, :vocab_size]
        if batch.repetition_penalty is not None:
            seen = counts > 0
            if batch.prompt_ids is not None:
                seen |= _per_row(_id_mask(batch.prompt_ids, vocab_size), batch)
            penalty = batch.repetition_penalty.unsqueeze(1)
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if batch.frequency_penalty is not None:
            x -= batch.frequency_penalty.unsqueeze(1) * counts
        if batch.presence_penalty is not None:
            x -= batch.presence_penalty.unsqueeze(1) * (counts > 0)
        return x

    @staticmethod
    def _check(logits: torch.Tensor, batch: SamplingBatch) -> None:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the batch: expected "
                             f"[{batch.num_rows}, {batch.vocab_size}]")


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p on the distribution top-k left, remove from each row: a logit threshold
    per row, found from the row's largest values only (NUCLEUS_CANDIDATES first, more where its nucleus is wider).

    A full sort of every row cost a quarter of a decode step at batch 32 on a CPU (0.37 ms per row of a 4096-token
    vocabulary, sampled and greedy rows alike), while a nucleus is usually a few dozen tokens. The threshold keeps
    every token tied with the last one in (a sort would keep an arbitrary few of them): a row's result never
    depends on the order its ties were visited in, nor on the rest of the batch."""
    vocab_size = x.shape[-1]
    active = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if top_k is not None:
        active |= top_k < vocab_size
    if top_p is not None:
        active |= top_p < 1
    rows = active.nonzero().squeeze(1)
    if rows.numel() == 0:
        return x
    sub = x.index_select(0, rows)  # [n, V]
    threshold = torch.full((rows.numel(),), _NEG_INF, dtype=x.dtype, device=x.device)
    if top_k is not None:  # the rows with a top-k only (a top-p-only row would make this a full sort)
        k = top_k.index_select(0, rows)
        limited = (k < vocab_size).nonzero().squeeze(1)
        if limited.numel():
            k = k.index_select(0, limited).clamp(min=1)
            largest = sub.index_select(0, limited).topk(int(k.max()), dim=-1).values  # [m, max k], descending
            threshold.index_copy_(0, limited, largest.gather(1, (k - 1).unsqueeze(1)).squeeze(1))
    if top_p is not None:
        _top_p_threshold(sub, threshold, top_p.index_select(0, rows))
    sub.masked_fill_(sub < threshold.unsqueeze(1), _NEG_INF)
    return x.index_copy_(0, rows, sub)


NUCLEUS_CANDIDATES = 64  # largest values a nucleus is first looked for in; x8 for the rows it did not fit in


def _top_p_threshold(x: torch.Tensor, threshold: torch.Tensor, top_p: torch.Tensor) -> None:
    """Raise `threshold` [n] (top-k's, -inf without) to each row's top-p cut of the distribution of x [n, V] above
    it: the smallest value among the fewest largest tokens that hold at least top_p of its mass (a token is dropped
    when the tokens ranked above it already hold top_p)."""
    masked = x.masked_fill(x < threshold.unsqueeze(1), _NEG_INF)
    log_total = masked.logsumexp(dim=-1)
    pending = (top_p < 1).nonzero().squeeze(1)
    vocab_size, candidates = x.shape[-1], NUCLEUS_CANDIDATES
    while pending.numel():
        c = min(candidates, vocab_size)
        largest = masked.index_select(0, pending).topk(c, dim=-1).values  # descending
        probs = (largest - log_total.index_select(0, pending).unsqueeze(1)).exp()
        above = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each
        last = (above < top_p.index_select(0, pending).unsqueeze(1)).sum(dim=-1).clamp(min=1) - 1
        # Found: a candidate past the last kept one exists, or every token was a candidate, or the rest are out.
        found = (last < c - 1) | (c == vocab_size) | (largest[:, -1] == _NEG_INF)
        cut = largest.gather(1, last.unsqueeze(1)).squeeze(1)
        done = pending[found]
        threshold.index_copy_(0, done, torch.maximum(threshold.index_select(0, done), cut[found]))
        pending, candidates = pending[~found], candidates * 8
