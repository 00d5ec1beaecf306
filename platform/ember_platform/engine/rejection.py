"""Rejection sampling of speculative drafts (Leviathan et al. 2023), vectorized over the batch.

Draft j of a request is accepted with probability min(1, p_j(x_j) / q_j(x_j)) while every earlier one was;
at the first rejection a token is drawn from the residual max(0, p_j - q_j) (renormalized), and when all k
drafts are accepted, a bonus token from p_k. The output then follows the target's distribution p exactly,
whatever the drafts were, provided each x_j was drawn from q_j (a deterministic proposer: q_j is the point
mass on x_j). Every request is decided by tensor ops at once; the only host sync is reading the tokens back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _exponential(shape: tuple[int, ...], generators: Sequence[torch.Generator | None], shared: torch.Generator | None,
                 device: torch.device) -> torch.Tensor:
    """Exponential(1) noise, row b drawn from generators[b] where it has one (a seeded request), else shared."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if any(g is None for g in generators):
        noise.exponential_(generator=shared)
    for b, g in enumerate(generators):
        if g is not None:
            noise[b].exponential_(generator=g)
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)  # 0 noise would make a masked 0 / 0 a NaN


def _uniform(lengths: Sequence[int], width: int, generators: Sequence[torch.Generator | None],
             shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[B, width] uniforms; a seeded request draws only its own `lengths[b]` (one per draft), so what its generator
    yields next does not depend on how many drafts the other requests of the batch have."""
    u = torch.rand((len(lengths), width), device=device, generator=shared) if any(g is None for g in generators) \
        else torch.ones((len(lengths), width), device=device)
    for b, g in enumerate(generators):
        if g is not None and lengths[b]:
            u[b, :lengths[b]] = torch.rand(lengths[b], device=device, generator=g)
    return u


def rejection_sample(target_probs: torch.Tensor, row_starts: Sequence[int], draft_ids: Sequence[Sequence[int]],
                     draft_probs: Sequence[torch.Tensor | None], generators: Sequence[torch.Generator | None],
                     shared: torch.Generator | None = None) -> list[list[int]]:
    """The tokens each request keeps: its accepted drafts, then one token of the target's.

    target_probs: [R, V] the target's processed distributions; request b owns rows row_starts[b] ..
        row_starts[b] + len(draft_ids[b]) (one per draft, then the bonus position).
    draft_probs: per request [>= k_b, V] the distributions its drafts were drawn from, or None (point masses).
    generators: per request its own generator (seeded requests), or None to draw from `shared`.
    """
    num_reqs = len(draft_ids)
    if num_reqs == 0:
        return []
    device = target_probs.device
    vocab = target_probs.shape[1]
    ks = [len(d) for d in draft_ids]
    width = max(max(ks), 1)
    k = torch.tensor(ks, dtype=torch.long, device=device)  # [B]
    j = torch.arange(width + 1, device=device)  # positions 0..K
    starts = torch.tensor(list(row_starts), dtype=torch.long, device=device)
    # Row of position j of request b; past its k_b drafts, its bonus row (masked out of acceptance below).
    p = target_probs[starts[:, None] + torch.minimum(j[None, :], k[:, None])]  # [B, K+1, V]
    x = torch.tensor([list(d) + [0] * (width - len(d)) for d in draft_ids], dtype=torch.long,
                     device=device)  # [B, K]
    valid = j[None, :width] < k[:, None]  # [B, K]
    p_draft = p[:, :width]  # [B, K, V]
    p_x = p_draft.gather(2, x[..., None]).squeeze(2)  # [B, K]
    if all(q is None for q in draft_probs):
        q_x = torch.ones_like(p_x)
        residual = p_draft.clone().scatter_(2, x[..., None], 0.0)  # max(0, p - point mass) = p without x
    else:
        q = torch.zeros_like(p_draft)
        for b, probs in enumerate(draft_probs):
            if ks[b] == 0:
                continue
            if probs is None:
                q[b, :ks[b]].scatter_(1, x[b, :ks[b], None], 1.0)
            else:
                q[b, :ks[b]] = probs[:ks[b]].to(device=device, dtype=q.dtype)
        q_x = q.gather(2, x[..., None]).squeeze(2)
        residual = (p_draft - q).clamp_(min=0.0)
    u = _uniform(ks, width, generators, shared, device)
    accept = (u * q_x < p_x) & (q_x > 0) & valid  # u < min(1, p / q), as u < 1
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] accepted until the first rejection
    total = residual.sum(dim=2, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(torch.float32).tiny), p_draft)
    # The final token's distribution: the residual at the first rejection, or p at the bonus position.
    at = num_accepted.clamp(max=width - 1)
    rows = torch.arange(num_reqs, device=device)
    final = torch.where((num_accepted == k)[:, None], p[rows, num_accepted], residual[rows, at])  # [B, V]
    noise = _exponential((num_reqs, vocab), generators, shared, device)
    final_ids = (final / noise).argmax(dim=1)  # an exponential race: token t wins with probability final[t]
    out = torch.cat([x, final_ids[:, None]], dim=1).tolist()  # the one host sync
    counts = num_accepted.tolist()
    return [[*row[:n], row[-1]] for row, n in zip(out, counts, strict=True)]
