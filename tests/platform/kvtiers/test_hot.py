"""Hot prefixes: a shared prefix outranks the unique prompts built on it; lists merge across replicas."""

from __future__ import annotations

from ember_platform.kvtiers.hot import HotPrefixes, merge_hot_lists


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_shared_system_prompt_is_the_hottest_prefix() -> None:
    hot = HotPrefixes()
    system = [h(i) for i in range(8)]
    for user in range(5):
        hot.note([*system, h(100 + user), h(200 + user)])
    hot.note([h(300), h(301)])
    top = hot.top(3)
    assert top[0] == (system, 5 * 8)  # its ancestors are covered by it, not listed again
    assert all(chain[-1] not in system for chain, _ in top[1:])
    assert hot.top(3, min_count=1)[0][0] == system


def test_forgotten_ancestors_make_a_chain_unusable() -> None:
    hot = HotPrefixes(max_entries=3)
    hot.note([h(0), h(1), h(2), h(3)])
    hot.note([h(0), h(1), h(2), h(3)])
    assert hot.top(5) == []  # h(0) was forgotten: no chain can be loaded from its start


def test_merge_sums_scores_across_replicas_and_skips_junk() -> None:
    a = {"chains": [[h(0).hex(), h(1).hex()], [h(5).hex()]], "scores": [10, 8]}
    b = {"chains": [[h(5).hex()], ["not hex"]], "scores": [7, 100]}
    assert merge_hot_lists([a, b, None, {"chains": 3}], 5) == [[h(5)], [h(0), h(1)]]
