"""`eagle3`'s dynamic draft tree (EAGLE-2's expansion, which EAGLE-3 keeps), for greedy requests.

From the newest token, depth 1 is the head's top-k tokens. At each further depth the k frontier nodes (the best
by cumulative draft log-probability, the product of the head's probabilities down the path) each run one head pass
(all requests' frontiers in one batched pass: each node attends to the cached context and to its own ancestors'
keys), and each gives its top-k children; the best k of those k * k children become the next frontier. Every
child is a candidate node. The `budget` best candidates by cumulative log-probability are the proposal: a score
never grows down a path, so with ties broken shallowest first they form a tree (every chosen node's parent is
chosen), listed parents first as `Proposal.parents` wants.

The tree is shaped by the head's own confidence per request and step (deep where it is sure, wide where it is not),
unlike a static top-k-per-position tree. Sampled requests draft chains (the engine verifies trees of deterministic
drafts only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from ember_platform.api import Proposal, SpeculatorInputs

if TYPE_CHECKING:
    from ember_plugins.speculators.eagle3 import Eagle3Speculator, _Kept


def draft_tree(spec: Eagle3Speculator, inputs: SpeculatorInputs, chosen: list[_Kept], out: torch.Tensor,
               tables: torch.Tensor, cache: tuple[torch.Tensor, ...], budget: int, top_k: int,
               depth: int) -> list[Proposal | None]:
    """Up to `budget` tree nodes for each chosen request (module docstring)."""
    draft, device = spec.draft, spec.context.device
    m, w = len(chosen), top_k
    heads, hkv, hd = draft.num_heads, draft.num_kv_heads, draft.head_dim
    last = torch.tensor([e.offset + e.count - 1 for e in chosen], device=device)
    last_pos = torch.tensor([e.last_position for e in chosen], device=device)
    vocab = spec.draft_vocab
    hidden = out.index_select(0, last)  # [m, D]
    scores, ids = F.log_softmax(spec._logits(hidden), dim=-1).topk(w, dim=-1)  # [m, w]
    # Candidates, depth by depth (so node ids are topological): target token, cumulative score, parent node id.
    tokens, cum, parent = [vocab[ids]], [scores], [torch.full((m, w), -1, device=device)]
    frontier_ids = torch.arange(w, device=device).expand(m, w)  # node ids of the frontier
    frontier_hidden = hidden[:, None, :].expand(m, w, hidden.shape[-1])
    frontier_tokens, frontier_cum = tokens[0], scores
    extra = w * (depth - 1)  # key slots of the nodes that run a pass
    keys, values, length, written = spec._context(chosen, inputs.batch, tables, cache, extra=extra)
    context = torch.arange(length, device=device)[None, :] <= last_pos[:, None]  # [m, L]
    if written is not None:
        context &= written[:, :length]
    ancestors = torch.zeros(m, w, extra, dtype=torch.bool, device=device)  # frontier nodes' passed ancestors
    num_nodes = w
    rows = torch.arange(m, device=device)[:, None]
    for d in range(1, depth):
        slot0 = (d - 1) * w
        cos, sin = spec._rope((last_pos[:, None] + d).expand(m, w).reshape(-1), spec.context.dtype)
        flat_hidden = frontier_hidden.reshape(m * w, -1)
        q, k, v = draft.qkv(spec.embed(frontier_tokens.reshape(-1)), flat_hidden, cos, sin)
        keys[:, :, length + slot0:length + slot0 + w] = k.view(m, w, hkv, hd).transpose(1, 2)
        values[:, :, length + slot0:length + slot0 + w] = v.view(m, w, hkv, hd).transpose(1, 2)
        own = ancestors.clone()
        own[:, torch.arange(w), slot0 + torch.arange(w)] = True  # each node sees its own key
        end = length + slot0 + w
        mask = torch.cat([context[:, None, :].expand(m, w, length), own[:, :, :slot0 + w]], dim=-1)  # [m, w, end]
        o = F.scaled_dot_product_attention(q.view(m, w, heads, hd).transpose(1, 2), keys[:, :, :end],
                                           values[:, :, :end], attn_mask=mask[:, None], scale=spec.scale,
                                           enable_gqa=True)  # [m, H, w, hd]
        h = draft.finish(o.transpose(1, 2).reshape(m * w, heads * hd), flat_hidden)  # [m * w, D]
        child_scores, child_ids = F.log_softmax(spec._logits(h), dim=-1).topk(w, dim=-1)
        child_cum = (frontier_cum[:, :, None] + child_scores.view(m, w, w)).reshape(m, w * w)
        child_tokens = vocab[child_ids].view(m, w * w)
        child_parent = frontier_ids[:, :, None].expand(m, w, w).reshape(m, w * w)
        tokens.append(child_tokens)
        cum.append(child_cum)
        parent.append(child_parent)
        if d + 1 < depth:  # the best k children run a pass at the next depth
            best = child_cum.topk(w, dim=-1).indices  # [m, w]
            from_node = best // w  # which frontier node each came from
            frontier_ids = num_nodes + best
            frontier_tokens, frontier_cum = child_tokens.gather(1, best), child_cum.gather(1, best)
            frontier_hidden = h.view(m, w, -1)[rows, from_node]
            ancestors = own[rows, from_node]
        num_nodes += w * w
    all_tokens, all_cum, all_parent = torch.cat(tokens, 1), torch.cat(cum, 1), torch.cat(parent, 1)
    n = min(budget, all_tokens.shape[1])
    # Stable: among equal scores the earlier (shallower) node wins, so a chosen node's parent is always chosen.
    picked = all_cum.sort(dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values  # node id order
    picked_tokens = all_tokens.gather(1, picked).tolist()
    picked_parent = all_parent.gather(1, picked).tolist()
    picked_ids = picked.tolist()
    proposals: list[Proposal | None] = []
    for b in range(m):
        index = {node: i for i, node in enumerate(picked_ids[b])}
        proposals.append(Proposal(picked_tokens[b], parents=[index[p] if p >= 0 else -1 for p in picked_parent[b]]))
    return proposals
