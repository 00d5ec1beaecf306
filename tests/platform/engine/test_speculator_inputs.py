"""Speculator inputs through the engine, with a third-party speculator installed for real ("hidden-lookup", which
drafts from the target's aux-layer hidden states): the engine fills the hidden states of every scheduled token
with transformers' values, verifies the drafts (greedy output unchanged, acceptance counted), keeps the draft
probabilities through verification, and sizes a draft KV cache and declared memory into the KV budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
# Repetitive code (so that earlier positions predict later ones) with a short cycle at the end.
PROMPT = list(range(100, 140)) * 3 + [7, 8] * 6
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def hidden_lookup(use_plugins):
    use_plugins("speculator")

    def make(**overrides):
        # A fixed draft length: these tests follow every draft; the adaptive choice has its own tests.
        return LLM(EXAMPLE, speculator="hidden-lookup", num_speculative_tokens=4,
                   **{"speculator_adaptive": False, **overrides})

    return make


def test_hidden_states_of_every_token_match_transformers(hidden_lookup) -> None:
    from transformers import AutoModelForCausalLM

    plain = LLM(EXAMPLE).generate([PROMPT], GREEDY)[0].token_ids
    llm = hidden_lookup(max_num_batched_tokens=64)  # a chunked prefill: hidden states arrive over several steps
    out = llm.generate([PROMPT], GREEDY)[0]
    engine, spec = llm.engine, llm.engine.speculator
    assert out.token_ids == plain  # verified drafts never change a greedy result
    assert spec.aux_layers() == (1, 2) and engine.spec.aux_layers == (1, 2)  # EAGLE-3's choice for 4 layers
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0  # its drafts were verified, some kept

    record = next(iter(spec.records.values()))
    tokens = PROMPT + out.token_ids
    computed = len(tokens) - 1  # the last token was sampled, never run through the model
    assert sorted(record["final"]) == list(range(computed))  # every position once: prompt chunks, decodes, drafts kept
    assert [record["tokens"][p] for p in range(computed)] == tokens[:computed]
    hf = AutoModelForCausalLM.from_pretrained(EXAMPLE / "weights", dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens[:computed]]), output_hidden_states=True).hidden_states
    ours_final = torch.stack([record["final"][p] for p in range(computed)])
    torch.testing.assert_close(ours_final, reference[-1][0], rtol=1e-4, atol=1e-4)
    for layer in (1, 2):
        ours = torch.stack([record["aux"][layer][p] for p in range(computed)])
        torch.testing.assert_close(ours, reference[layer][0], rtol=1e-4, atol=1e-4)


def test_draft_probabilities_reach_verification(hidden_lookup) -> None:
    # Sampled (seeded), peaked enough that the text stays repetitive and drafts get proposed.
    sampled = SamplingParams(temperature=0.5, top_k=2, seed=3, max_tokens=40, ignore_eos=True)
    # Point-mass drafts (no probabilities): rejection sampling keeps some of them.
    llm = hidden_lookup()
    llm.generate([PROMPT], sampled)
    assert llm.engine.num_draft_tokens > 0 and llm.engine.num_accepted_tokens > 0
    # The same drafts declared with probability 0 (not drawn from their distribution): rejection sampling reads
    # Proposal.probs, so none is ever accepted.
    zero = hidden_lookup(speculator_options={"zero_probs": True})
    zero.generate([PROMPT], sampled)
    assert zero.engine.num_draft_tokens > 0 and zero.engine.num_accepted_tokens == 0


def test_draft_kv_cache_and_declared_memory_are_budgeted(hidden_lookup) -> None:
    budget_gb = 0.01
    llm = hidden_lookup(kv_cache_memory_gb=budget_gb, speculator_options={"draft_kv": True},
                        max_num_seqs=256, max_model_len=1024)  # the budget holds ~1.5k tokens: one full sequence
    engine, spec = llm.engine, llm.engine.speculator
    target_per_block = 2 * 4 * 16 * 2 * 64 * 4  # 2 (k, v) x layers x block x KV heads x head dim x float32
    draft_per_block = 2 * 1 * 16 * 1 * 256 * 4  # its one layer of one 256-wide head
    expected = int((budget_gb * 2**30 - 2**20) // (target_per_block + draft_per_block))
    assert engine.kv.num_blocks == expected
    assert len(spec.kv_caches) == 1 and spec.kv_caches[0][0].shape == (expected, 1, 16, 256)
    out = llm.generate([PROMPT], GREEDY)[0]
    # The speculator wrote each kept token's top aux hidden state at its slot through the target's block table.
    record = next(iter(spec.records.values()))
    k_cache = spec.kv_caches[0][0]
    req_blocks = [int(b) for b in engine._block_tables.table[0, :8]]
    assert len(PROMPT) + len(out.token_ids) > 100
    for pos in (0, 17, 100):
        block = req_blocks[pos // 16]
        torch.testing.assert_close(k_cache[block, 0, pos % 16], record["aux"][2][pos])


def test_rows_and_last_rows_address_each_requests_kept_tokens() -> None:
    from ember_platform.engine.request import Request
    from ember_platform.engine.speculation import SpeculatorInputs

    reqs = [Request(str(i), [1, 2, 3], GREEDY, arrival=i) for i in range(3)]
    hidden = torch.arange(9, dtype=torch.float32)[:, None].repeat(1, 4)  # row r holds r
    # Request 0: a 4-token prefill chunk; 1: one decode token; 2: the newest token + 3 drafts, 1 accepted.
    inputs = SpeculatorInputs(batch=reqs, propose_for=[1, 2], num_speculative_tokens=3,
                              token_ids=torch.zeros(9, dtype=torch.long), positions=torch.zeros(9, dtype=torch.long),
                              query_start_loc=[0, 4, 5, 9], num_kept=[4, 1, 2], num_accepted=[0, 0, 1],
                              hidden_states=hidden)
    assert inputs.requests == reqs[1:]
    assert (inputs.rows(0), inputs.rows(2)) == (slice(0, 4), slice(5, 7))
    assert hidden[inputs.last_rows()][:, 0].tolist() == [4.0, 6.0]  # rejected drafts (rows 7, 8) are not kept
