"""Sampler: processed distributions against per-row references, seeded reproducibility, raw logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ember_platform.engine.sampler import Sampler, SamplingBatch, make_generator, pad_token_ids
from ember_platform.engine.sampling_params import SamplingParams

V = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def random_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- per-row references, written the plain way ----------------------------------------------------

def reference_penalized(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int] = (), output: list[int] = (),
                    suppressed: set[int] = frozenset()) -> torch.Tensor:
    x = logits.double().clone()
    for t in suppressed:
        x[t] = float("-inf")
    x = reference_penalized(x, p, list(prompt), list(output))
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    x = x / p.temperature
    if p.top_k > 0:
        kept = set(x.topk(min(p.top_k, len(x))).indices.tolist())
        x = torch.tensor([v if i in kept else float("-inf") for i, v in enumerate(x.tolist())], dtype=torch.float64)
    probs = x.softmax(-1)
    if p.top_p < 1:
        kept, mass = [], 0.0
        for i in probs.argsort(descending=True).tolist():
            if mass >= p.top_p:
                break
            kept.append(i)
            mass += probs[i].item()
        mask = torch.zeros_like(probs)
        mask[kept] = 1
        probs = probs * mask / (probs * mask).sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0)
        probs = probs / probs.sum()
    return probs


MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(top_p=0.3),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0),
    SamplingParams(top_k=V + 10, top_p=1.0),
]


# --- greedy ------------------------------------------------------------------------------------------

def test_greedy_rows_take_the_argmax_and_consume_no_randomness() -> None:
    logits = random_logits(4)
    generator = make_generator(3, "cpu")
    state = generator.get_state()
    params = [SamplingParams(temperature=0, seed=3), SamplingParams(temperature=0, top_k=3, top_p=0.5),
              SamplingParams(temperature=0, min_p=0.5), SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, vocab_size=V, generators=[generator, None, None, None])
    out = Sampler().sample(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(Sampler().probs(logits, batch), torch.nn.functional.one_hot(logits.argmax(-1), V).float())


# --- processed distributions -----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_processed_probs_match_per_row_reference_in_one_mixed_batch(device: str) -> None:
    logits = random_logits(len(MIXED), seed=1)
    probs = Sampler().probs(logits.to(device), SamplingBatch.build(MIXED, vocab_size=V, device=device)).cpu()
    for row, p in enumerate(MIXED):
        torch.testing.assert_close(probs[row].double(), reference_probs(logits[row], p), atol=1e-6, rtol=0,
                                   msg=f"row {row}: {p}")


def test_top_k_top_p_min_p_each_remove_tokens() -> None:
    # The reference test cannot pass vacuously: every filter really truncates the distribution here.
    logits = random_logits(4, seed=2)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2), SamplingParams()]
    kept = (Sampler().probs(logits, SamplingBatch.build(params, vocab_size=V)) > 0).sum(-1).tolist()
    assert kept[0] == 5 and 1 <= kept[1] < V and 1 <= kept[2] < V and kept[3] == V


@pytest.mark.parametrize("scale", [8.0, 0.5, 0.02])  # peaked, flat, nearly uniform: nuclei of ~1 to ~4000 tokens
def test_top_p_matches_the_reference_however_wide_the_nucleus(scale: float) -> None:
    # The nucleus is looked for among a row's largest values, more of them where it is wider (sampler.py's
    # NUCLEUS_CANDIDATES, then x8): in a 4096-token vocabulary these rows need one, two or all three rounds.
    vocab = 4096
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * scale
    logits = logits.float()
    params = [SamplingParams(top_p=0.95), SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(top_p=0.999),
              SamplingParams(top_k=300, top_p=0.9), SamplingParams(), SamplingParams(temperature=0)]
    probs = Sampler().probs(logits, SamplingBatch.build(params, vocab_size=vocab))
    for row, p in enumerate(params):
        torch.testing.assert_close(probs[row].double(), reference_probs(logits[row], p), atol=1e-6, rtol=0,
                                   msg=f"row {row}: {p}")
    # alone or in a batch, a row is cut the same
    alone = Sampler().probs(logits[1:2], SamplingBatch.build(params[1:2], vocab_size=vocab))
    assert torch.equal(alone[0], probs[1])


def test_tokens_tied_with_the_last_one_in_the_nucleus_all_stay() -> None:
    # 0.4, then three tokens of 0.1 each, then the rest: top_p 0.45 needs one of the three ties. Which one a sort
    # would keep depends on how it visits ties; the threshold keeps all three, as it does top-k's ties.
    logits = torch.full((1, V), -30.0)
    logits[0, :4] = torch.tensor([0.4, 0.1, 0.1, 0.1]).log()
    logits[0, 4:8] = torch.tensor(0.075).log()
    batch = SamplingBatch.build([SamplingParams(top_p=0.45)], vocab_size=V)
    kept = (Sampler().probs(logits, batch)[0] > 0).nonzero().squeeze(1).tolist()
    assert kept == [0, 1, 2, 3]
    tied_k = SamplingBatch.build([SamplingParams(top_k=2)], vocab_size=V)
    assert (Sampler().probs(logits, tied_k)[0] > 0).nonzero().squeeze(1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_is_processed_in_float32(dtype: torch.dtype) -> None:
    logits = random_logits(len(MIXED), seed=3).to(dtype)
    probs = Sampler().probs(logits, SamplingBatch.build(MIXED, vocab_size=V))
    assert probs.dtype == torch.float32
    for row, p in enumerate(MIXED):
        torch.testing.assert_close(probs[row].double(), reference_probs(logits[row].float(), p), atol=1e-6, rtol=0)


def test_default_batch_skips_every_optional_step() -> None:
    batch = SamplingBatch.build([SamplingParams()] * 3, vocab_size=V)
    optional = [batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.repetition_penalty,
                batch.presence_penalty, batch.frequency_penalty, batch.prompt_ids, batch.output_ids,
                batch.suppressed_ids, batch.row_index, batch.draft_prefix_ids]
    assert all(t is None for t in optional)
    logits = random_logits(3)
    torch.testing.assert_close(Sampler().probs(logits, batch), logits.softmax(-1))


# --- penalties -----------------------------------------------------------------------------------------

PENALIZED = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, presence_penalty=0.5),
    SamplingParams(frequency_penalty=0.4),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.1),
    SamplingParams(),
    SamplingParams(temperature=0, repetition_penalty=2.0),
]
PROMPTS = [[1, 2, 3, 3], [5, 6], [7, 8, 9, 10, 11], [1], [2, 4, 6], [0, 63]]
OUTPUTS = [[4, 4, 1], [], [7, 7, 7, 12], [20, 21, 20, 1, 1], [9], [63, 30, 30]]


def test_penalties_match_reference() -> None:
    logits = random_logits(len(PENALIZED), seed=4)
    batch = SamplingBatch.build(PENALIZED, vocab_size=V, prompt_ids=PROMPTS, output_ids=OUTPUTS)
    processed = Sampler().process_logits(logits, batch)
    for row, p in enumerate(PENALIZED):
        expected = reference_penalized(logits[row], p, PROMPTS[row], OUTPUTS[row])
        if not p.greedy:
            expected = expected / p.temperature
        torch.testing.assert_close(processed[row].double(), expected, atol=1e-5, rtol=1e-6, msg=f"row {row}")
    assert not torch.equal(processed, logits)  # the penalties really moved something


def test_penalties_accept_prebuilt_padded_histories() -> None:
    logits = random_logits(len(PENALIZED), seed=4)
    from_lists = SamplingBatch.build(PENALIZED, vocab_size=V, prompt_ids=PROMPTS, output_ids=OUTPUTS)
    from_tensors = SamplingBatch.build(PENALIZED, vocab_size=V, prompt_ids=pad_token_ids(PROMPTS, V),
                                       output_ids=pad_token_ids(OUTPUTS, V))
    sampler = Sampler()
    assert torch.equal(sampler.process_logits(logits, from_lists), sampler.process_logits(logits, from_tensors))


@pytest.mark.parametrize("penalty", [1.3, 0.6])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    prompts = [[1, 2, 3, 3], [5, 6, 9, 40], [7, 8, 9, 10]]
    outputs = [[4, 4, 1], [33, 2, 5], [62, 7, 7]]
    logits = random_logits(3, seed=5)
    input_ids = torch.tensor([p + o for p, o in zip(prompts, outputs, strict=True)])
    expected = RepetitionPenaltyLogitsProcessor(penalty=penalty)(input_ids, logits.clone())
    batch = SamplingBatch.build([SamplingParams(repetition_penalty=penalty)] * 3, vocab_size=V, prompt_ids=prompts,
                                output_ids=outputs)
    torch.testing.assert_close(Sampler().process_logits(logits, batch), expected, atol=1e-6, rtol=0)


def test_suppressed_ids_are_never_chosen() -> None:
    logits = random_logits(3, seed=6)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0), SamplingParams(min_tokens=2)]
    suppressed = [{top[0]}, set(range(0, V, 2)), set()]
    batch = SamplingBatch.build(params, vocab_size=V, suppressed_ids=suppressed)
    probs = Sampler().probs(logits, batch)
    for row in range(3):
        torch.testing.assert_close(probs[row].double(), reference_probs(logits[row], params[row],
                                                                        suppressed=suppressed[row]), atol=1e-6, rtol=0)
    sampler = Sampler(seed=0)
    tokens = torch.stack([sampler.sample(logits, batch).token_ids for _ in range(50)])
    assert (tokens[:, 0] != top[0]).all() and (tokens[:, 1] % 2 == 1).all()


# --- seeded reproducibility ----------------------------------------------------------------------------

SEEDED_A = SamplingParams(seed=7, temperature=0.9, top_p=0.95)
SEEDED_B = SamplingParams(seed=11, top_k=8, repetition_penalty=1.2)
FILLERS = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=99, temperature=1.5),
           SamplingParams(top_k=3), SamplingParams(seed=5, min_p=0.1), SamplingParams(temperature=0, seed=1)]


def run_steps(order: list[SamplingParams], device: str, steps: int = 12) -> dict[int, list[int]]:
    """Decode `steps` tokens for a batch laid out as `order`; returns the tokens of SEEDED_A and SEEDED_B."""
    generators = [make_generator(p.seed, device) for p in order]
    prompts = [[3, 4, 5]] * len(order)
    outputs: list[list[int]] = [[] for _ in order]
    sampler = Sampler()
    for step in range(steps):
        # Each request sees the same logits at the same step wherever it sits in the batch.
        logits = torch.stack([random_logits(1, seed=1000 * step + (p.seed or 0))[0] for p in order]).to(device)
        batch = SamplingBatch.build(order, vocab_size=V, device=device, generators=generators, prompt_ids=prompts,
                                    output_ids=outputs)
        for row, token in enumerate(sampler.sample(logits, batch).token_ids.tolist()):
            outputs[row].append(token)
    return {p.seed: outputs[row] for row, p in enumerate(order) if p in (SEEDED_A, SEEDED_B)}


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_requests_sample_the_same_tokens_alone_and_anywhere_in_a_batch(device: str) -> None:
    alone = {**run_steps([SEEDED_A], device), **run_steps([SEEDED_B], device)}
    assert len(set(alone[7])) > 1 and alone[7] != alone[11]  # really random, really different
    layouts = [
        [SEEDED_A, SEEDED_B, *FILLERS],
        [*FILLERS[:3], SEEDED_B, *FILLERS[3:5], SEEDED_A, FILLERS[5]],
        [FILLERS[2], SEEDED_A, *FILLERS[3:], FILLERS[0], FILLERS[1], SEEDED_B],
    ]
    for order in layouts:
        assert len(order) == 8
        assert run_steps(order, device) == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = random_logits(1, seed=8).expand(16, V)
    params = [SamplingParams(seed=s) for s in range(16)]
    batch = SamplingBatch.build(params, vocab_size=V, generators=[make_generator(s, "cpu") for s in range(16)])
    assert len(set(Sampler().sample(logits, batch).token_ids.tolist())) > 3


# --- statistics -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seeded", [False, True])
def test_top_p_draws_stay_in_the_nucleus_and_follow_its_probabilities(seeded: bool) -> None:
    draws = 2000
    logits = torch.linspace(2.0, -2.0, 12).expand(draws, 12)
    p = SamplingParams(top_p=0.9, temperature=0.8)
    expected = reference_probs(logits[0], p)
    nucleus = set(torch.nonzero(expected).flatten().tolist())
    assert 1 < len(nucleus) < 12
    params = [SamplingParams(top_p=0.9, temperature=0.8, seed=s if seeded else None) for s in range(draws)]
    generators = [make_generator(q.seed, "cpu") for q in params]
    batch = SamplingBatch.build(params, vocab_size=12, generators=generators)
    tokens = Sampler(seed=0).sample(logits, batch).token_ids
    assert set(tokens.tolist()) <= nucleus
    frequencies = torch.bincount(tokens, minlength=12).double() / draws
    assert (frequencies - expected).abs().max() < 0.05


# --- logprobs -----------------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_top_n_sorted_descending() -> None:
    params = [SamplingParams(logprobs=3, temperature=0.5, top_k=4), SamplingParams(logprobs=0),
              SamplingParams(), SamplingParams(logprobs=5, temperature=0, repetition_penalty=1.5)]
    logits = random_logits(4, seed=9).to(torch.bfloat16)
    batch = SamplingBatch.build(params, vocab_size=V, prompt_ids=[[]] * 4, output_ids=[[]] * 4)
    out = Sampler(seed=1).sample(logits, batch)
    raw = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    entries = out.token_logprobs()
    assert entries[2] is None
    for row, entry in enumerate(entries):
        n = params[row].logprobs
        if n is None:
            continue
        assert entry.token_id == out.token_ids[row].item()
        assert entry.logprob == pytest.approx(raw[row, entry.token_id].item(), abs=1e-6)
        assert len(entry.top) == n
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        expected_values, expected_ids = raw[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in entry.top] == expected_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), expected_values, atol=1e-6, rtol=0)


def test_no_logprobs_when_no_row_asks() -> None:
    out = Sampler().sample(random_logits(2), SamplingBatch.build([SamplingParams()] * 2, vocab_size=V))
    assert out.logprobs is None and out.top_token_ids is None and out.token_logprobs() == [None, None]


# --- speculative verification -------------------------------------------------------------------------------

def test_draft_rows_count_earlier_drafts_in_penalties() -> None:
    params = [SamplingParams(frequency_penalty=0.7, repetition_penalty=1.2, presence_penalty=0.3),
              SamplingParams(temperature=0)]
    prompts, outputs, drafts = [[1, 2], [3]], [[5, 5], [6]], [[5, 9, 2], []]
    batch = SamplingBatch.build(params, vocab_size=V, prompt_ids=prompts, output_ids=outputs, draft_ids=drafts)
    assert batch.num_rows == 5 and batch.row_index.tolist() == [0, 0, 0, 0, 1]
    logits = random_logits(5, seed=10)
    processed = Sampler().process_logits(logits, batch)
    for row, (request, j) in enumerate([(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]):
        expected = reference_penalized(logits[row], params[request], prompts[request],
                                       outputs[request] + drafts[request][:j])
        torch.testing.assert_close(processed[row].double(), expected, atol=1e-5, rtol=1e-6)


def test_draft_rows_consume_the_request_generator_in_position_order() -> None:
    p = SamplingParams(seed=21, temperature=1.2)
    logits = random_logits(4, seed=11)
    verify = SamplingBatch.build([p], vocab_size=V, generators=[make_generator(21, "cpu")], draft_ids=[[1, 2, 3]])
    together = Sampler().sample(logits, verify).token_ids.tolist()
    generator = make_generator(21, "cpu")
    one_by_one = [Sampler().sample(logits[i:i + 1], SamplingBatch.build([p], vocab_size=V, generators=[generator]))
                  .token_ids.item() for i in range(4)]
    assert together == one_by_one


# --- misuse ------------------------------------------------------------------------------------------------------

def test_misuse_is_reported() -> None:
    with pytest.raises(ValueError, match="seed=4 but no generator"):
        SamplingBatch.build([SamplingParams(seed=4)], vocab_size=V)
    with pytest.raises(ValueError, match="output_ids is needed"):
        SamplingBatch.build([SamplingParams(presence_penalty=1)], vocab_size=V)
    with pytest.raises(ValueError, match="2 entries for 1 requests"):
        SamplingBatch.build([SamplingParams()], vocab_size=V, generators=[None, None])
    with pytest.raises(ValueError, match=r"expected \[1, 64\]"):
        Sampler().sample(random_logits(2), SamplingBatch.build([SamplingParams()], vocab_size=V))
