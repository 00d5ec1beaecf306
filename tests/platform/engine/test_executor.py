"""The executor / worker seam: the core sends step plans to an executor; a third-party parallel strategy's executor
(installed for real, with an entry point) runs the engine's steps end to end; the plan is built without per-token
loops and means what the scheduler decided."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.executor import UniprocessExecutor
from ember_platform.engine.parallel import ParallelContext
from ember_platform.engine.request import Request
from ember_platform.engine.step_plan import BlockTables, StepPlan

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(100, 140)), [7, 8, 9] * 5, list(range(300, 420))]


def test_the_default_executor_is_one_worker_in_process() -> None:
    engine = LLM(EXAMPLE).engine
    assert isinstance(engine.executor, UniprocessExecutor)
    parallel = engine.executor.driver.parallel
    assert parallel == ParallelContext.single("cpu") and parallel.is_driver
    assert engine.model.parallel is parallel  # handed to model construction


def test_a_third_party_parallel_strategy_runs_the_steps(use_plugins) -> None:
    plain = [o.token_ids for o in LLM(EXAMPLE).generate(PROMPTS, GREEDY)]
    use_plugins("parallel")
    llm = LLM(EXAMPLE, parallelism="mirror", max_num_batched_tokens=64)  # chunked prefill: several plans
    assert llm.engine.selections["parallelism"].name == "mirror"
    executor = llm.engine.executor
    assert type(executor).__name__ == "MirrorExecutor"
    assert [w.parallel.rank for w in executor.workers] == [0, 1]
    assert [w.model.parallel.world_size for w in executor.workers] == [2, 2]  # each model knows its rank
    assert executor.calls["load_model"] == 1 and executor.calls["init_kv_cache"] == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    # Every step went through it, on both ranks: 3 prompts of 175 tokens in chunks of <= 64, then 11 decodes.
    assert executor.num_steps == executor.calls["execute"] >= 3 + GREEDY.max_tokens - 1
    assert executor.num_tokens == sum(map(len, PROMPTS)) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    with pytest.raises(ValueError, match="not supported yet: LoRA adapters"):
        llm.engine.add_lora("a", EXAMPLE)


def test_a_strategy_that_is_not_an_executor_is_refused(use_plugins) -> None:
    use_plugins("techniques")  # registers parallelism "tensor" as a class that is no Executor
    with pytest.raises(TypeError, match="not an Executor subclass"):
        LLM(EXAMPLE, parallelism="tensor")


def _request(rid: str, prompt: list[int], computed: int, output: list[int] = (), spec: list[int] = ()) -> Request:
    req = Request(rid, prompt, GREEDY, arrival=0)
    req.output_token_ids = list(output)
    req.num_computed_tokens = computed
    req.spec_token_ids = list(spec)
    req.block_ids = list(range(10 * int(rid), 10 * int(rid) + 8))
    return req


def test_the_plan_holds_what_the_scheduler_decided() -> None:
    prefill = _request("0", list(range(50, 90)), computed=16)  # a chunk in the middle of a prompt
    decode = _request("1", [1, 2, 3], computed=4, output=[4, 5])  # one new token
    spec = _request("2", [1, 2], computed=3, output=[6, 7], spec=[8, 9])  # the newest token plus two drafts
    plan = StepPlan.build([prefill, decode, spec], [16, 1, 3], aux_layers=(1,))
    assert plan.input_ids.tolist() == [*range(66, 82), 5, 7, 8, 9]
    assert plan.positions.tolist() == [*range(16, 32), 4, 3, 4, 5]
    assert plan.query_lens == [16, 1, 3] and plan.seq_lens == [32, 5, 6]
    assert plan.sampled == [1, 2] and plan.num_sample_rows == [1, 3]
    assert plan.sample_rows.tolist() == [16, 17, 18, 19]
    assert plan.query_start_loc == [0, 16, 17, 20]
    assert plan.block_tables.shape == (3, 8) and plan.block_tables[2, 0] == 20
    assert plan.spec_token_ids == [[], [], [8, 9]] and plan.aux_layers == (1,)


def test_building_a_decode_plan_costs_no_per_token_python() -> None:
    """A 64-request decode step of long contexts: the plan costs about the same whatever the context length
    (the old runner looked every token up in Python; slices and tensor ops make it O(requests))."""
    def decode_batch(context: int) -> list[Request]:
        return [_request("1", list(range(context)), computed=context, output=[5]) for _ in range(64)]

    def seconds(reqs: list[Request]) -> float:
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            StepPlan.build(reqs, [1] * len(reqs))
            best = min(best, time.perf_counter() - t0)
        return best

    short, long = seconds(decode_batch(64)), seconds(decode_batch(16_000))
    assert long < short * 3 + 1e-3
    assert short < 5e-3  # measured ~0.3 ms on a laptop core


def test_hidden_states_are_returned_for_every_token_when_asked() -> None:
    engine = LLM(EXAMPLE).engine
    req = Request("r", list(range(10, 30)), GREEDY, arrival=0)
    engine.kv.allocate_slots(req, 20)
    plan = StepPlan.build([req], [20], return_hidden_states=True, aux_layers=(0, 3))
    out = engine.executor.execute(plan)
    assert out.logits.shape == (1, engine.vocab_size)
    assert out.hidden_states.shape == (20, 256) and sorted(out.aux_hidden_states) == [0, 3]
    embeddings = engine.model.model.embed_tokens.weight[plan.input_ids]
    torch.testing.assert_close(out.aux_hidden_states[0], embeddings)  # layer 0's input: the embeddings
    torch.testing.assert_close(engine.model.compute_logits(out.hidden_states[-1:]), out.logits)
    engine.kv.free(req)


def test_persistent_block_tables_follow_growth_preemption_and_release() -> None:
    tables = BlockTables(max_blocks_per_seq=4, rows=1)
    a, b = _request("1", [1, 2], computed=0), _request("2", [1, 2], computed=0)
    a.block_ids, b.block_ids = [5], [7, 8]
    assert tables.rows([a, b]).tolist() == [[5, 0], [7, 8]]  # a second request: the rows double
    a.block_ids.append(6)  # grew in place: only the new id is copied
    assert tables.rows([a]).tolist() == [[5, 6]]
    a.block_ids = [9]  # freed and allocated again (preempted): a new list, rewritten from the start
    assert tables.rows([a, b]).tolist() == [[9, 6], [7, 8]]  # past its length a row is padding (masked by seq_lens)
    a.block_ids = [1, 2, 3, 4, 5, 6]  # longer than any row so far: the table widens
    assert tables.rows([a]).tolist() == [[1, 2, 3, 4, 5, 6]]
    tables.release("1")
    c = _request("3", [1], computed=0)
    c.block_ids = [4]
    assert tables.rows([c, b])[:, :1].tolist() == [[4], [7]]  # c took the released row
    plan = StepPlan.build([b], [2], block_tables=tables)
    assert plan.block_tables.tolist() == [[7, 8]]


def test_a_plan_and_its_output_can_cross_a_process_boundary() -> None:
    """A plan names no model and no device, so an executor may send it to workers in other processes."""
    import pickle

    spec = _request("2", [1, 2], computed=3, output=[6, 7], spec=[8, 9])
    plan = StepPlan.build([spec], [3], return_hidden_states=True, aux_layers=(2,))
    again = pickle.loads(pickle.dumps(plan))
    assert again.input_ids.tolist() == plan.input_ids.tolist() and again.block_tables.equal(plan.block_tables)
    assert (again.sampled, again.spec_token_ids, again.aux_layers) == (plan.sampled, plan.spec_token_ids, (2,))
