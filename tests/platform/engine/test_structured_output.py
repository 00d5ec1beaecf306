"""Structured outputs on the real engine (examples/tiny-llama): the grammar mask decides what is sampled.

Each constraint is checked both ways: the model left alone does not produce the format (so the test can fail),
and constrained it always does, greedy and sampled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.llm import LLM
from ember_platform.engine.request import Request
from ember_platform.engine.sampling_params import SamplingParams, StructuredOutput
from ember_platform.engine.structured_output import GrammarCompiler, StructuredRequests

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPTS = ["def main():", "import os\n", "class Point:", "# a comment\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EXAMPLE)


def sampled(structured: StructuredOutput | None, n: int = 8, max_tokens: int = 64) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured=structured) for i in range(n)]


def schema_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_schema_output_always_validates_and_the_unconstrained_model_does_not(llm: LLM) -> None:
    prompts = PROMPTS * 2
    free = llm.generate(prompts, sampled(None))
    assert not any(schema_valid(o.text) for o in free)
    before = llm.engine.structured.num_masked_rows
    outs = llm.generate(prompts, sampled(JSON_SCHEMA))
    for out in outs:
        assert schema_valid(out.text), out.text
        assert out.finish_reason == "stop" and out.error is None
    assert llm.engine.structured.num_masked_rows - before == sum(len(o.token_ids) for o in outs)  # every token
    assert len(llm.engine.structured) == 0  # every matcher released with its request


def test_greedy_constrained_output_validates(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=64, structured=JSON_SCHEMA))
    assert all(schema_valid(o.text) for o in out)


def test_regex(llm: LLM) -> None:
    pattern = r"[a-z]{3}-\d{2}"
    free = llm.generate(PROMPTS, sampled(None, n=4, max_tokens=8))
    assert not any(re.fullmatch(pattern, o.text) for o in free)
    outs = llm.generate(PROMPTS * 2, sampled(StructuredOutput("regex", pattern)))
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_choice_picks_one_of_them_and_sampling_reaches_several(llm: LLM) -> None:
    choices = ["apple pie", "banana", "cherry \"tart\"", "größe\n"]
    outs = llm.generate(PROMPTS * 4, sampled(StructuredOutput("choice", json.dumps(choices)), n=16))
    texts = [o.text for o in outs]
    assert set(texts) <= set(choices) and len(set(texts)) >= 2, texts


def test_lark_grammar_with_inline_json(llm: LLM) -> None:
    grammar = 'start: "call " NAME " " args\nNAME: /[a-z_]{1,8}/\nargs: %json {"type": "array", ' \
              '"items": {"type": "integer"}, "maxItems": 3}'
    outs = llm.generate(PROMPTS * 2, sampled(StructuredOutput("grammar", grammar)))
    for out in outs:
        match = re.fullmatch(r"call ([a-z_]{1,8}) (.*)", out.text, re.S)
        assert match, out.text
        args = json.loads(match.group(2))
        assert isinstance(args, list) and len(args) <= 3 and all(isinstance(a, int) for a in args)


def test_the_schema_true_is_any_json(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, sampled(StructuredOutput("json_schema", "true"), n=4, max_tokens=200))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        json.loads(out.text)  # raises unless the whole output is one JSON value


def test_json_object_is_an_object(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, sampled(StructuredOutput("json_object"), n=4, max_tokens=200))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(o.text), dict) for o in finished)
    assert all(o.text.startswith("{") for o in outs)


def test_a_grammar_is_compiled_once_and_then_served_from_the_cache() -> None:
    llm = LLM(EXAMPLE)
    regex = StructuredOutput("regex", r"(yes|no)!")
    llm.generate(PROMPTS, sampled(regex, n=4))
    llm.generate(PROMPTS, sampled(StructuredOutput("regex", r"(yes|no)!"), n=4))  # an equal, new object
    stats = llm.engine.stats()
    assert stats["grammars_compiled"] == 1 and stats["grammar_cache_hits"] == 7


def test_concurrent_requests_for_one_schema_share_one_compile() -> None:
    from concurrent.futures import ThreadPoolExecutor

    compiler = GrammarCompiler(LLM(EXAMPLE).tokenizer, 4096)
    with ThreadPoolExecutor(8) as pool:  # as the replica's edge compiles: in worker threads
        matchers = list(pool.map(lambda _: compiler.compile(JSON_SCHEMA), range(8)))
    assert compiler.num_compiled == 1 and compiler.num_cache_hits == 7
    assert all(m is matchers[0] for m in matchers)
    bad = StructuredOutput("regex", "[a-z")
    with ThreadPoolExecutor(4) as pool:  # an error reaches every waiter, and nothing is cached
        errors = list(pool.map(lambda _: _compile_error(compiler, bad), range(4)))
    assert all("unclosed character class" in e for e in errors) and not compiler.is_cached(bad)


def _compile_error(compiler: GrammarCompiler, structured: StructuredOutput) -> str:
    try:
        compiler.compile(structured)
    except ValueError as e:
        return str(e)
    return ""


def test_the_cache_is_bounded() -> None:
    compiler = GrammarCompiler(LLM(EXAMPLE).tokenizer, 4096, cache_size=2)
    for pattern in ("a+", "b+", "c+"):
        compiler.compile(StructuredOutput("regex", pattern))
    assert not compiler.is_cached(StructuredOutput("regex", "a+"))
    assert compiler.is_cached(StructuredOutput("regex", "c+")) and compiler.num_compiled == 3


@pytest.mark.parametrize("structured,needle", [
    (StructuredOutput("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (StructuredOutput("json_schema", '{"type": "object", "if": {}, "then": {}}'), '"if", "then"'),
    (StructuredOutput("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (StructuredOutput("json_schema", "false"), "accepts no value"),
    (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "Unsatisfiable"),
    (StructuredOutput("regex", "[a-z"), "unclosed character class"),
    (StructuredOutput("regex", "(?<=a)b"), "look-around"),
    (StructuredOutput("grammar", "start: undefined_rule"), "unknown name"),
])
def test_a_constraint_the_grammar_engine_cannot_honor_is_refused_naming_why(
        llm: LLM, structured: StructuredOutput, needle: str) -> None:
    with pytest.raises(ValueError, match=r"^structured: ") as info:
        llm.engine.add_request("bad", "x", SamplingParams(structured=structured))
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert "bad" not in llm.engine.scheduler.requests


def test_a_grammar_that_fails_mid_generation_fails_its_request_alone() -> None:
    import llguidance

    llm = LLM(EXAMPLE)
    # An ambiguous grammar that compiles, under a parser limit its second or third token's mask exceeds.
    llm.engine.structured.compiler = GrammarCompiler(llm.tokenizer, 4096,
                                                     limits=llguidance.LLParserLimits(step_max_items=20))
    fragile = StructuredOutput("grammar", 'start: x+\nx: y | y y | "a" x "b"\ny: "a" | "aa" | x')
    fine = StructuredOutput("regex", r"[a-z]{3}-\d{2}")
    bad, good = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=20, structured=fragile),
                                          SamplingParams(temperature=0, max_tokens=20, structured=fine)])
    assert bad.finish_reason == "error" and "Too many items" in (bad.error or "") and "\n" not in bad.error
    assert good.finish_reason == "stop" and re.fullmatch(r"[a-z]{3}-\d{2}", good.text)
    assert len(llm.engine.structured) == 0 and not llm.engine.has_unfinished()


def test_preemption_and_recompute_keep_the_matchers_in_step() -> None:
    params = SamplingParams(temperature=0, max_tokens=80, structured=JSON_SCHEMA)
    reference = {p: o.text for p, o in zip(PROMPTS, LLM(EXAMPLE).generate(PROMPTS, params), strict=True)}
    engine = LLMEngine(EXAMPLE, num_kv_blocks=12)  # 192 tokens for 16 requests: they must take turns
    requests = [engine.add_request(str(i), PROMPTS[i % 4], params) for i in range(16)]
    texts: dict[str, str] = {}
    preempted = 0
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
        preempted = max(preempted, *(r.num_preemptions for r in requests))
    assert preempted > 0
    for i in range(16):
        assert texts[str(i)] == reference[PROMPTS[i % 4]] and schema_valid(texts[str(i)])


def test_structured_requests_get_no_drafts_and_decode_as_without_a_speculator() -> None:
    code = "x = [1, 2, 3]\n" * 12  # repetitive: prompt lookup drafts for the free request
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=60, structured=JSON_SCHEMA)
    plain = LLM(EXAMPLE).generate([code, code], [free, constrained])
    engine = LLMEngine(EXAMPLE, speculator="ngram", num_speculative_tokens=4)
    reqs = [engine.add_request("free", code, free), engine.add_request("json", code, constrained)]
    texts = {"free": "", "json": ""}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
        assert not reqs[1].spec_token_ids
    assert engine.num_draft_tokens > 0  # the free request was drafted for
    assert texts == {"free": plain[0].text, "json": plain[1].text} and schema_valid(texts["json"])


def test_padded_vocabulary_columns_are_never_allowed() -> None:
    tokenizer = LLM(EXAMPLE).tokenizer
    padded = tokenizer.vocab_size + 45  # embedding rows beyond the tokenizer, as many checkpoints pad to 64
    structured = StructuredRequests(GrammarCompiler(tokenizer, padded))
    structured.add("r", StructuredOutput("json_object"))
    req = Request("r", [1, 2], SamplingParams(), 0)
    pending = structured.start_masks([req])
    logits = torch.zeros(1, padded)
    masked = structured.apply(pending, logits, [1])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tokenizer.vocab_size
    assert {tokenizer.decode([t]) for t in allowed} == {"{", "{}"}  # how an object starts, without whitespace
    assert torch.equal(logits, torch.zeros(1, padded))  # the executor's logits are left alone


def test_eos_is_allowed_only_where_the_grammar_accepts() -> None:
    tokenizer = LLM(EXAMPLE).tokenizer
    eos = sorted(tokenizer.eos_token_ids)
    structured = StructuredRequests(GrammarCompiler(tokenizer, tokenizer.vocab_size))
    structured.add("r", StructuredOutput("regex", r"ab( cd)?"))
    req = Request("r", [1, 2], SamplingParams(), 0)

    def allowed() -> set[int]:
        masked = structured.apply(structured.start_masks([req]), torch.zeros(1, tokenizer.vocab_size), [1])
        return set(torch.isfinite(masked[0]).nonzero().flatten().tolist())

    assert not allowed() & set(eos)  # nothing written yet: the regex is not matched
    assert not any(structured.accept("r", t) for t in tokenizer.encode("ab", add_special_tokens=False))
    after_ab = allowed()
    assert set(eos) <= after_ab and len(after_ab) > len(eos)  # complete, but " cd" may follow
    assert [structured.accept("r", t) for t in tokenizer.encode(" cd", add_special_tokens=False)][-1]  # stopped
    assert allowed() == set(eos)
