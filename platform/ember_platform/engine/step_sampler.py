"""A step's sampling: one new token per sampled request, or its drafts verified — greedy requests keep the
target's argmax prefix, sampled ones go through rejection sampling, all at once. A request whose parameters break
the sampler fails alone: the batch is then sampled again one request at a time."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from ember_platform.engine.rejection import rejection_sample
from ember_platform.engine.request import Request
from ember_platform.engine.sampler import Sampler, SamplingBatch, TokenLogprobs
from ember_platform.engine.spec_tree import tree_rejection_sample, verify_greedy_tree
from ember_platform.engine.speculation import verify_greedy
from ember_platform.engine.text.detokenizer import IncrementalDetokenizer
from ember_platform.engine.text.stop import StopStringMatcher

log = logging.getLogger("ember.engine")


@dataclass(slots=True)
class RequestState:
    """Output-side state of one request: detokenizer, stop strings, its random generator, its logprobs so far."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher | None
    generator: torch.Generator | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions 1.. computed so far


class StepSampler:
    """Samples the engine's steps and counts the drafts verified and accepted."""

    def __init__(self, sampler: Sampler, eos_token_ids: Collection[int],
                 state_of: Callable[[str], RequestState]) -> None:
        self.sampler = sampler
        self.eos_token_ids = set(eos_token_ids)
        self.state_of = state_of
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def sample(self, reqs: Sequence[Request], num_rows: Sequence[int], logits: torch.Tensor,
               draft_probs: Sequence[torch.Tensor | None]) -> list[list[int] | None]:
        """Each sampled request's new tokens (verified drafts included). If sampling the batch fails, each request
        is sampled alone, so that one whose parameters break the sampler fails alone (None) and the rest go on."""
        if not reqs:
            return []
        try:
            return list(self._sample_rows(reqs, num_rows, logits, draft_probs))
        except Exception:
            log.exception("sampling a batch of %d request(s) failed; sampling each alone", len(reqs))
        tokens: list[list[int] | None] = []
        row = 0
        for req, n, probs in zip(reqs, num_rows, draft_probs, strict=True):
            try:
                tokens += self._sample_rows([req], [n], logits[row:row + n], [probs])
            except Exception:
                log.exception("request %s: sampling failed", req.request_id)
                tokens.append(None)
            row += n
        return tokens

    def _sample_rows(self, reqs: Sequence[Request], num_rows: Sequence[int], logits: torch.Tensor,
                     draft_probs: Sequence[torch.Tensor | None]) -> list[list[int]]:
        drafts = [list(r.spec_token_ids) for r in reqs]
        trees = [r.spec_tree if r.spec_parents is not None else None for r in reqs]  # None: a chain (spec_tree.py)
        any_tree = any(t is not None for t in trees)
        states = [self.state_of(r.request_id) for r in reqs]
        params = [r.params for r in reqs]
        needs_history = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        suppressed = [self._suppressed(r) for r in reqs]
        batch = SamplingBatch.build(
            params, vocab_size=logits.shape[-1], device=logits.device,
            generators=[s.generator for s in states],
            prompt_ids=[r.prompt_token_ids for r in reqs] if needs_history else None,
            output_ids=[r.output_token_ids for r in reqs] if needs_history else None,
            suppressed_ids=suppressed if any(suppressed) else None,
            draft_ids=drafts if any(drafts) else None,
            draft_parents=trees if any_tree else None,
        )
        # Sampled requests' drafts are verified against the distributions sampling draws from: kept from the same
        # pass over the logits rather than processing them twice.
        any_rejection = any(d and not r.params.greedy for d, r in zip(drafts, reqs, strict=True))
        out = self.sampler.sample(logits, batch, keep_probs=any_rejection)
        token_rows = out.token_ids.tolist()
        logprob_rows = out.token_logprobs() if batch.any_logprobs else None
        starts = list(itertools.accumulate(num_rows, initial=0))
        results: list[list[int]] = []
        new_logprobs: list[tuple[RequestState, TokenLogprobs]] = []
        for i in range(len(reqs)):
            row = starts[i]
            if not drafts[i]:
                results.append([token_rows[row]])
                if logprob_rows is not None and logprob_rows[row] is not None:
                    new_logprobs.append((states[i], logprob_rows[row]))
            elif trees[i] is not None:
                results.append(verify_greedy_tree(token_rows[row:row + num_rows[i]], drafts[i], trees[i]))
            else:
                results.append(verify_greedy(token_rows[row:row + num_rows[i]], drafts[i]))
        # Sampled drafts are verified by rejection, all requests at once: the output keeps the target's distribution.
        # Chains and trees of drafts each go through their own sampler, every request of a kind at once.
        sampled = [i for i, r in enumerate(reqs) if drafts[i] and not r.params.greedy]
        shared = self.sampler.shared_generator(logits.device) if sampled else None
        chains = [i for i in sampled if trees[i] is None]
        tree_reqs = [i for i in sampled if trees[i] is not None]
        if chains:
            verified = rejection_sample(out.probs, [starts[i] for i in chains], [drafts[i] for i in chains],
                                        [draft_probs[i] for i in chains], [states[i].generator for i in chains],
                                        shared)
            for i, tokens in zip(chains, verified, strict=True):
                results[i] = tokens
        if tree_reqs:
            verified = tree_rejection_sample(out.probs, [starts[i] for i in tree_reqs], [drafts[i] for i in tree_reqs],
                                             [trees[i] for i in tree_reqs], [states[i].generator for i in tree_reqs],
                                             shared)
            for i, tokens in zip(tree_reqs, verified, strict=True):
                results[i] = tokens
        # Recorded only now: when this raises part-way, the requests are sampled again one by one (see sample).
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
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
