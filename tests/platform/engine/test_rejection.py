"""Vectorized rejection sampling keeps the target's distribution exactly (checked statistically against the
exact distributions, seeded), for drawn drafts with their probabilities and for deterministic drafts."""

from __future__ import annotations

import torch

from ember_platform.engine.rejection import rejection_sample

V, K, N = 6, 2, 60_000


def _dist(g: torch.Generator, sharp: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=g) * sharp, dim=0)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _run(p_rows: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
         seed: int) -> list[list[int]]:
    target = p_rows.repeat(len(drafts), 1)  # request b owns rows b*(K+1) .. b*(K+1)+K
    shared = torch.Generator().manual_seed(seed)
    return rejection_sample(target, [b * (K + 1) for b in range(len(drafts))], drafts, draft_probs,
                            [None] * len(drafts), shared)


def _check(out: list[list[int]], drafts: list[list[int]], p_rows: torch.Tensor) -> None:
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float()
    assert _tv(first, p_rows[0]) < 0.012  # sampling error at N = 60k is ~0.005
    # Given that the first draft was kept, the second token follows the target's next distribution.
    second = [o[1] for o, d in zip(out, drafts, strict=True) if len(o) > 1 and o[0] == d[0]]
    assert len(second) > N // 20
    assert _tv(torch.bincount(torch.tensor(second), minlength=V).float(), p_rows[1]) < 0.03
    for o, d in zip(out, drafts, strict=True):  # structure: accepted drafts are a prefix, then one token
        assert 1 <= len(o) <= K + 1 and o[:len(o) - 1] == d[:len(o) - 1]


def test_drawn_drafts_keep_the_target_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    p_rows = torch.stack([_dist(g) for _ in range(K + 1)])
    q_rows = torch.stack([_dist(g, sharp=2.0) for _ in range(K)])  # a sharper, wrong draft
    drafts = torch.stack([torch.multinomial(q_rows[i], N, replacement=True, generator=g) for i in range(K)], 1)
    out = _run(p_rows, drafts.tolist(), [q_rows] * N, seed=1)
    _check(out, drafts.tolist(), p_rows)
    accepted = sum(len(o) - 1 for o in out) / N
    expected_first = float(torch.minimum(p_rows[0], q_rows[0]).sum())  # P(accept draft 1) = sum min(p, q)
    assert abs(sum(len(o) > 1 for o in out) / N - expected_first) < 0.01
    assert accepted > 0


def test_deterministic_drafts_keep_the_target_distribution() -> None:
    g = torch.Generator().manual_seed(3)
    p_rows = torch.stack([_dist(g) for _ in range(K + 1)])
    drafts = [[2, 4]] * N  # a point mass: accepted with probability p(x)
    out = _run(p_rows, drafts, [None] * N, seed=4)
    _check(out, drafts, p_rows)
    assert abs(sum(len(o) > 1 for o in out) / N - float(p_rows[0, 2])) < 0.01


def test_ragged_batches_and_seeded_requests() -> None:
    g = torch.Generator().manual_seed(5)
    p = torch.stack([_dist(g) for _ in range(6)])
    drafts, starts, probs = [[1], [], [3, 3, 3]], [0, 2, 3], [None, None, torch.stack([_dist(g)] * 3)]

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]

    a = rejection_sample(p[[0, 1, 2, 0, 1, 2, 3]], starts, drafts, probs, gens(), torch.Generator().manual_seed(1))
    b = rejection_sample(p[[0, 1, 2, 0, 1, 2, 3]], starts, drafts, probs, gens(), torch.Generator().manual_seed(2))
    assert [len(x) <= len(d) + 1 for x, d in zip(a, drafts, strict=True)] == [True] * 3
    assert len(a[1]) == 1  # no drafts: one token from its bonus row
    assert a[0] == b[0] and a[2] == b[2]  # seeded requests do not depend on the shared generator


def test_greedy_target_accepts_exactly_the_argmax_prefix() -> None:
    one_hot = torch.eye(V)[[3, 1, 5]]  # a greedy target: one-hot rows
    out = rejection_sample(one_hot, [0], [[3, 2]], [None], [None], torch.Generator().manual_seed(0))
    assert out == [[3, 1]]


def test_a_seeded_request_draws_the_same_whatever_the_rest_of_the_batch_drafts() -> None:
    g = torch.Generator().manual_seed(3)
    p_rows = torch.stack([_dist(g) for _ in range(4)])  # up to 3 drafts + the bonus row

    def seeded_outputs(other_drafts: list[int]) -> list[list[int]]:
        generator = torch.Generator().manual_seed(5)
        target = torch.cat([p_rows[:2], p_rows[:len(other_drafts) + 1]])
        outs = []
        for _ in range(200):  # the seeded request (one draft) first, then one with `other_drafts`
            outs.append(rejection_sample(target, [0, 2], [[1], other_drafts], [None, None], [generator, None],
                                         torch.Generator().manual_seed(9))[0])
        return outs

    # Its generator yields one uniform per draft of its own, not one per the widest request's.
    assert seeded_outputs([2]) == seeded_outputs([2, 3, 4]) == seeded_outputs([])
