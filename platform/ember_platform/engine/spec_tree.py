"""Tree drafts: a speculator may propose several continuations at once as a tree of draft tokens, verified in one
target pass (Medusa's and SpecInfer's tree attention, EAGLE-2's dynamic trees).

A tree is given by `Proposal.parents`: for each draft node, the index of its parent node (-1: the request's newest
token, the root), nodes in topological order (a parent before its children). A chain is the tree
`[-1, 0, 1, ...]`; the engine treats such a proposal, or one without parents, exactly as before (no tree logic
runs). Any prefix of the node list is again a tree, so cutting drafts to a budget (the scheduler's token budget,
a request's room) keeps it valid.

In the verify pass, node i (0-based) is written at the request's sequence position `root + 1 + i` (its KV slot)
and computed at RoPE position `root + depth(i)`; it attends to the whole cached context and to its ancestors and
itself (`ancestor_mask`), which is what the same tokens would see as a chain along their own path. After
verification the accepted path's KV entries are moved to consecutive positions (`kv_moves`), so the next step
sees an ordinary sequence.

Verification keeps the target's distribution exactly: greedy follows the target's argmax down the tree
(`verify_greedy_tree`); sampling uses multi-candidate rejection for deterministic drafts
(`tree_rejection_sample`): at a node its children are tried in order, child c accepted with probability
p(c) / (residual mass) where the residual is p with the tokens of the children already rejected removed; when all
are rejected, the final token is drawn from that residual (at a leaf: from p). Every child of a node being a
point mass, this is SpecInfer's multi-round speculative sampling, so the output follows p whatever the tree.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ember_platform.engine.rejection import _exponential, _uniform


def check_tree(parents: Sequence[int], num_nodes: int) -> None:
    """ValueError unless `parents` gives one parent per node, each an earlier node or -1 (the root)."""
    if len(parents) != num_nodes:
        raise ValueError(f"Proposal.parents has {len(parents)} entries for {num_nodes} draft tokens")
    for i, p in enumerate(parents):
        if not -1 <= int(p) < i:
            raise ValueError(f"Proposal.parents[{i}] = {p}: a node's parent must be -1 (the newest token) or an "
                             "earlier node (nodes in topological order)")


def is_chain(parents: Sequence[int] | None) -> bool:
    return parents is None or all(int(p) == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (1 for a child of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def prune(parents: Sequence[int], keep: Sequence[bool]) -> list[int]:
    """The parents of the kept nodes, renumbered (a dropped node's descendants must be dropped too)."""
    index: dict[int, int] = {-1: -1}
    out = []
    for i, (p, k) in enumerate(zip(parents, keep, strict=True)):
        if k:
            if p not in index:
                raise ValueError(f"node {i} is kept but its parent {p} is not")
            index[i] = len(out)
            out.append(index[p])
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool over the root (row/column 0) and the nodes: entry (q, k) when k is q or an ancestor of q.
    Shared between calls with the same tree (a speculator's trees repeat): read it, never write it."""
    return _ancestor_mask(tuple(int(p) for p in parents))


@functools.lru_cache(maxsize=256)
def _ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children of the root (entry 0) and of each node (entry i + 1), in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def accepted_path(parents: Sequence[int], drafts: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The nodes of the accepted drafts `tokens[:-1]` (the verifiers accept, at each node, the first child with the
    token: a later sibling with the same token is never accepted, and the final token matches no child)."""
    kids = children(parents)
    path: list[int] = []
    node = -1
    for tok in tokens[:-1]:
        node = next(c for c in kids[node + 1] if drafts[c] == tok)
        path.append(node)
    return path


def verify_greedy_tree(target_ids: Sequence[int], drafts: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Greedy verification down the tree: `target_ids[r]` is the target's choice at row r (0: the root, i + 1: node
    i). From the root, move to the child whose token is the target's choice while there is one; then add the
    target's own token. Exactly what greedy decoding without speculation produces."""
    kids = children(parents)
    out: list[int] = []
    node = -1
    while True:
        choice = target_ids[node + 1]
        nxt = next((c for c in kids[node + 1] if drafts[c] == choice), None)
        out.append(choice)
        if nxt is None:
            return out
        node = nxt


def tree_rejection_sample(target_probs: torch.Tensor, row_starts: Sequence[int], drafts: Sequence[Sequence[int]],
                          parents: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
                          shared: torch.Generator | None = None) -> list[list[int]]:
    """The tokens each request keeps (accepted drafts down one path, then one of the target's) for deterministic
    tree drafts. target_probs: [R, V] processed target distributions; request b owns rows row_starts[b] (its root)
    .. row_starts[b] + len(drafts[b]) (row i + 1: after node i).

    Vectorized: every node's acceptance test is computed at once (whether it is reached or not: a test that is
    never reached is never read), then the walk down each tree is a few list lookups, then one final draw per
    request from its residual."""
    num_reqs = len(drafts)
    if num_reqs == 0:
        return []
    device = target_probs.device
    width = max(max(len(d) for d in drafts), 1)
    starts = torch.tensor(list(row_starts), dtype=torch.long, device=device)
    # Per node: its parent's row, its token, and which earlier siblings (distinct tokens) it is tried after.
    parent_rows, tokens, valid, dup = [], [], [], []
    earlier = torch.zeros(num_reqs, width, width)
    for b, (d, par) in enumerate(zip(drafts, parents, strict=True)):
        n = len(d)
        parent_rows.append([p + 1 for p in par] + [0] * (width - n))
        tokens.append(list(d) + [0] * (width - n))
        valid.append([True] * n + [False] * (width - n))
        seen: dict[tuple[int, int], int] = {}
        flags = []
        for i, (p, t) in enumerate(zip(par, d, strict=True)):
            for s in range(i):
                if par[s] == p and seen.get((p, d[s])) == s:
                    earlier[b, i, s] = 1.0
            first = seen.setdefault((p, t), i)
            flags.append(first != i)
        dup.append(flags + [False] * (width - n))
    x = torch.tensor(tokens, dtype=torch.long, device=device)  # [B, N]
    rows = starts[:, None] + torch.tensor(parent_rows, dtype=torch.long, device=device)  # [B, N]
    p_x = target_probs[rows.view(-1), x.view(-1)].view(num_reqs, width).float()  # p(x_c) at c's parent
    p_x = p_x.masked_fill(torch.tensor(dup, device=device), 0.0)  # a repeated sibling token: already rejected
    rejected_mass = torch.bmm(earlier.to(device), p_x[..., None]).squeeze(-1)  # [B, N] earlier siblings' mass
    u = _uniform([len(d) for d in drafts], width, generators, shared, device)
    # Accepted when reached with probability p(x) / (1 - rejected mass): the residual's share of x.
    accept = (u * (1.0 - rejected_mass).clamp_(min=0.0) < p_x) & torch.tensor(valid, device=device)
    accept_rows = accept.tolist()  # host sync 1: the walk
    paths: list[list[int]] = []
    finals: list[int] = []  # row (within the request) of each request's final node
    for b, par in enumerate(parents):
        kids = children(par)
        node, path = -1, []
        while True:
            nxt = next((c for c in kids[node + 1] if accept_rows[b][c]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        paths.append(path)
        finals.append(node + 1)
    final_rows = starts + torch.tensor(finals, dtype=torch.long, device=device)
    residual = target_probs[final_rows].float()  # [B, V]
    # Remove the final node's children's tokens: all of them were rejected (a leaf has none: the bonus token).
    drop = [[d[c] for c in children(par)[f]] for d, par, f in zip(drafts, parents, finals, strict=True)]
    most = max((len(t) for t in drop), default=0)
    if most:
        ids = torch.tensor([t + [t[0] if t else 0] * (most - len(t)) for t in drop], dtype=torch.long, device=device)
        keep_mask = torch.tensor([[True] * len(t) + [False] * (most - len(t)) for t in drop], device=device)
        zeroed = residual.scatter(1, ids, 0.0)
        has = keep_mask.any(1, keepdim=True)
        residual = torch.where(has, zeroed, residual)
    total = residual.sum(dim=1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(torch.float32).tiny),
                           target_probs[final_rows].float())
    noise = _exponential(tuple(residual.shape), generators, shared, device)
    final_ids = (residual / noise).argmax(dim=1).tolist()  # host sync 2
    return [[d[c] for c in path] + [t] for d, path, t in zip(drafts, paths, final_ids, strict=True)]


def kv_moves(path: Sequence[int], root: int) -> list[tuple[int, int]]:
    """(from, to) sequence positions that put the accepted path's KV after the root: node i was written at
    position root + 1 + i; the path's d-th node (1-based) belongs at root + d. Sources never precede their target,
    so the moves may be applied in order (or all at once)."""
    return [(root + 1 + node, root + d) for d, node in enumerate(path, start=1) if node != d - 1]
