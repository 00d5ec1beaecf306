"""Tree drafts (spec_tree.py): the torch backend's tree attention equals running each root-to-node path as its own
chain (both of its paths, mixed with chain requests); greedy tree verification follows the target's argmax; the
tree rejection sampler keeps the target's distribution (a chi-square test over many seeded draws, with top-k /
top-p processed target probabilities); the KV moves put an accepted branch's entries at consecutive slots."""

from __future__ import annotations

import pytest
import torch

from ember_platform.engine.attention import AttentionMetadata
from ember_platform.engine.model_runner import move_kv
from ember_platform.engine.sampler import Sampler, SamplingBatch
from ember_platform.engine.sampling_params import SamplingParams
from ember_platform.engine.spec_tree import (
    accepted_path,
    ancestor_mask,
    depths,
    kv_moves,
    prune,
    tree_rejection_sample,
    verify_greedy_tree,
)
from ember_plugins.attention.torch_paged import TorchPagedAttention

H, HKV, D, BS = 4, 2, 16, 8
# root -> 0, 1; 0 -> 2; 1 -> 3, 4; 3 -> 5
TREE = [-1, -1, 0, 1, 1, 3]


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(num_blocks, HKV, BS, D), torch.zeros(num_blocks, HKV, BS, D))


@pytest.mark.parametrize("max_batched_query_len", [8, 1])  # the batched path, and SDPA for long runs
@pytest.mark.parametrize(("native", "window"), [(None, None), (False, None), (False, 6), (None, 11)])
def test_tree_attention_equals_each_path_as_a_chain(max_batched_query_len: int, native: bool | None,
                                                    window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    ctx = 13  # cached context of the tree request (its root is position ctx)
    n = len(TREE)
    backend = TorchPagedAttention(max_batched_query_len=max_batched_query_len, native=native, sliding_window=window)
    cache = _cache(16)
    table = [3, 7, 1]  # 24 slots for the tree request (13 context + root + 6 nodes)
    other_table = [5, 9]
    # Fill both requests' context (a prefill through the backend itself).
    ctx_k, ctx_v = torch.randn(ctx, HKV, D, generator=g), torch.randn(ctx, HKV, D, generator=g)
    meta = AttentionMetadata.build([ctx], [ctx], [table], BS)
    backend.forward(torch.randn(ctx, H, D, generator=g), ctx_k, ctx_v, cache, meta, D ** -0.5)
    other_k, other_v = torch.randn(10, HKV, D, generator=g), torch.randn(10, HKV, D, generator=g)
    backend.forward(torch.randn(10, H, D, generator=g), other_k, other_v, cache,
                    AttentionMetadata.build([10], [10], [other_table], BS), D ** -0.5)
    saved = (cache[0].clone(), cache[1].clone())
    # The tree step: root + n nodes for request 0, a chain of 3 for request 1.
    q, k, v = (torch.randn(1 + n, H, D, generator=g), torch.randn(1 + n, HKV, D, generator=g),
               torch.randn(1 + n, HKV, D, generator=g))
    q1, k1, v1 = (torch.randn(3, H, D, generator=g), torch.randn(3, HKV, D, generator=g),
                  torch.randn(3, HKV, D, generator=g))
    meta = AttentionMetadata.build([1 + n, 3], [ctx + 1 + n, 13], [table, other_table], BS)
    meta.tree_masks = {0: ancestor_mask(TREE)}
    out = backend.forward(torch.cat([q, q1]), torch.cat([k, k1]), torch.cat([v, v1]), cache, meta, D ** -0.5)
    # Reference: each node's path (root, ancestors, node) as a chain of its own, on a fresh copy of the context.
    for node in range(-1, n):
        rows = [0] + [1 + i for i in (_path(TREE, node) if node >= 0 else [])]
        ref_cache = (saved[0].clone(), saved[1].clone())
        ref_meta = AttentionMetadata.build([len(rows)], [ctx + len(rows)], [table], BS)
        ref = TorchPagedAttention(native=False, sliding_window=window).forward(q[rows], k[rows], v[rows], ref_cache,
                                                                               ref_meta, D ** -0.5)
        torch.testing.assert_close(out[node + 1], ref[-1], atol=1e-5, rtol=1e-5)
    chain_cache = (saved[0].clone(), saved[1].clone())
    ref = TorchPagedAttention(native=False, sliding_window=window).forward(
        q1, k1, v1, chain_cache, AttentionMetadata.build([3], [13], [other_table], BS), D ** -0.5)
    torch.testing.assert_close(out[1 + n:], ref, atol=1e-5, rtol=1e-5)


def test_kv_moves_put_the_accepted_branch_at_consecutive_slots() -> None:
    cache = _cache(4)
    table = [2, 0]
    root = 5
    for pos in range(root + 1 + len(TREE)):  # slot of position pos holds the value pos
        cache[0][table[pos // BS], :, pos % BS] = float(pos)
        cache[1][table[pos // BS], :, pos % BS] = -float(pos)
    path = [1, 3, 5]  # the second branch: nodes at positions root + 2, root + 4, root + 6
    moves = kv_moves(path, root)
    assert moves == [(root + 2, root + 1), (root + 4, root + 2), (root + 6, root + 3)]
    slot = [table[p // BS] * BS + p % BS for p in range(16)]
    move_kv([cache], torch.tensor([slot[a] for a, _ in moves]), torch.tensor([slot[b] for _, b in moves]), BS)
    got = [float(cache[0][table[p // BS], 0, p % BS, 0]) for p in range(root + 4)]
    assert got == [*range(root + 1), root + 2, root + 4, root + 6]
    assert float(cache[1][table[(root + 3) // BS], 1, (root + 3) % BS, 3]) == -(root + 6)
    assert kv_moves([0, 1], root) == []  # the first branch is already in place


def test_tree_helpers() -> None:
    assert depths(TREE) == [1, 1, 2, 2, 2, 3]
    assert prune(TREE, [True, True, False, True, False, True]) == [-1, -1, 1, 2]
    mask = ancestor_mask(TREE)
    assert mask[6].tolist() == [True, False, True, False, True, False, True]  # node 5: root, 1, 3, itself
    drafts = [10, 11, 12, 13, 14, 15]
    # Target rows: root -> 11 (node 1), node 1 -> 14 (node 4), node 4 -> 7 (no child: the bonus).
    target = [11, 0, 14, 0, 0, 7, 0]
    assert verify_greedy_tree(target, drafts, TREE) == [11, 14, 7]
    assert accepted_path(TREE, drafts, [11, 14, 7]) == [1, 4]
    assert verify_greedy_tree([3, 0, 0, 0, 0, 0, 0], drafts, TREE) == [3]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (cells of tiny expectation are merged)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    assert float(counts[probs == 0].sum()) == 0, "a token of probability 0 was drawn"
    nz = exp > 0
    stat = float(((obs[nz] - exp[nz]) ** 2 / exp[nz]).sum())
    df = int(nz.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize(("params", "duplicate"), [(SamplingParams(temperature=0.9, top_k=5, top_p=0.9), False),
                                                 (SamplingParams(temperature=1.3), False),
                                                 (SamplingParams(temperature=1.0, top_p=0.95), True)])
def test_tree_rejection_sampling_keeps_the_target_distribution(params: SamplingParams, duplicate: bool) -> None:
    vocab, num = 12, 40_000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1 + len(TREE), vocab, generator=g) * 1.5
    batch = SamplingBatch.build([params], vocab_size=vocab, draft_ids=[[0] * len(TREE)])
    probs = Sampler(seed=0).probs(logits, batch)  # processed (temperature, top-k, top-p) target distributions
    # The drafts: the root's two most likely tokens (high acceptance) and less likely ones below.
    order = probs.argsort(dim=1, descending=True).tolist()
    drafts = [order[0][0], order[0][1], order[1][0], order[2][3], order[2][0], order[4][1]]
    if duplicate:  # node 4 repeats its sibling node 3's token: it must never be accepted (already rejected)
        drafts[4] = drafts[3]
    target = probs.repeat(num, 1)
    out = tree_rejection_sample(target, [b * (1 + len(TREE)) for b in range(num)], [drafts] * num, [TREE] * num,
                                [None] * num, torch.Generator().manual_seed(2))
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=vocab).float()
    assert _chi2_pvalue(first, probs[0]) > 1e-3
    # Given its first token is a child of the root (then it was accepted), the second follows that node's row.
    for node in (0, 1):
        second = [o[1] for o in out if o[0] == drafts[node]]
        assert len(second) > 1000
        counts = torch.bincount(torch.tensor(second), minlength=vocab).float()
        assert _chi2_pvalue(counts, probs[1 + node]) > 1e-3
    # Third token after the path 1 -> 3 (node 3 = order[2][3], a less likely token of node 1's row).
    third = [o[2] for o in out if len(o) > 2 and o[:2] == [drafts[1], drafts[3]]]
    if len(third) > 500:
        assert _chi2_pvalue(torch.bincount(torch.tensor(third), minlength=vocab).float(), probs[4]) > 1e-3
    # Accepted drafts really form a root-to-node path.
    for o in out[:2000]:
        path = accepted_path(TREE, drafts, o)
        assert not duplicate or 4 not in path
    # And the second child is accepted when the first is rejected: the tree gains over its first branch alone.
    assert sum(o[0] == drafts[1] for o in out) > 0


def test_a_detected_bug_would_fail_the_test() -> None:
    """The chi-square check rejects a sampler that ignores the residual (accepts child 2 with p(x) unnormalized)."""
    vocab, num = 6, 40_000
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05, 0.0])
    g = torch.Generator().manual_seed(5)
    # Wrong: accept the first child (0) w.p. p(0), then the second child (1) w.p. p(1) (should be p(1) / (1 - p(0))).
    u = torch.rand(num, 2, generator=g)
    first = torch.where(u[:, 0] < p[0], 0, torch.where(u[:, 1] < p[1], 1, torch.multinomial(
        torch.tensor([0, 0, 0.1, 0.05, 0.05, 0.0]) / 0.2, num, replacement=True, generator=g)))
    assert _chi2_pvalue(torch.bincount(first, minlength=vocab).float(), p) < 1e-6


def test_speculation_length_counts_a_tree_budget_by_the_nodes_on_the_accepted_path() -> None:
    from ember_platform.engine.spec_length import SpeculationLength

    length = SpeculationLength(6, tree=True)
    for _ in range(3000):  # every step accepts nodes 1 and 3 (the second branch) of 6
        length.record_verified(6, 2, path=[1, 3])
    # A budget of 1 keeps node 0 only (never accepted); 2 adds node 1; 4 adds node 3; more adds nothing.
    assert length.expected_tokens(1) == pytest.approx(1.0, abs=0.01)
    assert length.expected_tokens(2) == pytest.approx(2.0, abs=0.01)
    assert length.expected_tokens(3) == pytest.approx(2.0, abs=0.01)
    assert length.expected_tokens(6) == pytest.approx(3.0, abs=0.01)
    assert length.mean_accepted_length == pytest.approx(3.0)
    chain = SpeculationLength(6, tree=True)  # a chain is the tree whose path is its first nodes
    for _ in range(3000):
        chain.record_verified(6, 2)
    assert chain.expected_tokens(1) == pytest.approx(2.0, abs=0.01)
    assert chain.expected_tokens(6) == pytest.approx(3.0, abs=0.01)
