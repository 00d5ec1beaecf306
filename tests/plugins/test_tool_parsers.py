"""The built-in tool-call parsers (ember_plugins.tools) in `auto` mode: whole outputs parse into content and calls,
and streamed at every split point (markup cut anywhere) they give OpenAI deltas that reassemble to the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ember import hookimpl
from ember.errors import PluginError
from ember.manifest import load_manifest
from ember.plugins import PluginHost, load_package
from ember_platform.api import MAX_PARALLEL_CALLS, Tool, ToolParser
from ember_platform.tools import ToolCallStream, parse_tool_calls
from ember_platform.tools.parser import FirstCallOnly


def parser(name: str) -> ToolParser:
    technique = PluginHost().techniques.get("tool_parser", name)
    assert technique is not None, f"no tool parser {name!r} registered"
    return technique.load()()


WEATHER = '{"city": "Paris", "unit": "c"}'
NESTED = '{"q": "a } \\" ] {", "list": [1, {"x": [2]}]}'

CASES: dict[str, list[tuple[str, str | None, list[tuple[str, str]]]]] = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
         [("get_weather", WEATHER)]),
        (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
         f'<tool_call>\n{{"name": "search", "arguments": {NESTED}}}\n</tool_call>', "Let me look.",
         [("get_weather", WEATHER), ("search", NESTED)]),
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "late_name"}\n</tool_call>', None, [("late_name", '{"a": 1}')]),
        ('<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
        ("Plain text with a < sign and <tool but no call.", "Plain text with a < sign and <tool but no call.", []),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        # cut by max_tokens inside the arguments: the call is reported as far as it was written
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None,
         [("get_weather", '{"city": "Pa')]),
        ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_ca', None, [("f", "{}")]),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "search", "arguments": '
         f'{NESTED}}}', None, [("get_weather", WEATHER), ("search", NESTED)]),
        ("The answer is 42.", "The answer is 42.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]', None, [("get_weather", WEATHER)]),
        (f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "search", '
         f'"arguments": {NESTED}}}]', "Sure.", [("get_weather", WEATHER), ("search", NESTED)]),
        # [TOOL_CALLS] is a special token: skipped when decoding, the array alone remains
        (f' [{{"name": "get_weather", "arguments": {WEATHER}}}]', None, [("get_weather", WEATHER)]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("No [TOOL_ here", "No [TOOL_ here", []),
    ],
}
PARAMS = [(name, *case) for name, cases in CASES.items() for case in cases]


def reassemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    """Join deltas as an OpenAI client does; check each tool-call delta has OpenAI's exact shape on the way."""
    content = ""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if call["index"] == len(calls):  # the opening delta of a call
            assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function", call
            assert call["id"].startswith("call_") and call["function"]["arguments"] == "", call
            calls.append({"name": call["function"]["name"], "arguments": ""})
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}, call
            assert call["index"] == len(calls) - 1, "fragments arrive for the call opened last"
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls


def streamed(p: ToolParser, pieces: list[str]) -> tuple[list[dict[str, Any]], ToolCallStream]:
    stream = ToolCallStream(p)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish(), stream


@pytest.mark.parametrize(("family", "text", "content", "calls"), PARAMS)
def test_whole_output_parses_into_content_and_calls(family: str, text: str, content: str | None,
                                                    calls: list[tuple[str, str]]) -> None:
    parsed_content, parsed_calls = parse_tool_calls(parser(family), text)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in parsed_calls] == calls
    assert len({c.id for c in parsed_calls}) == len(parsed_calls)
    for call in parsed_calls:
        assert call.id.startswith("call_") and len(call.id) == 29
        if not call.arguments.endswith("Pa"):
            json.loads(call.arguments)


@pytest.mark.parametrize(("family", "text", "content", "calls"), PARAMS)
def test_streamed_at_every_split_point_reassembles_to_the_whole_parse(family: str, text: str, content: str | None,
                                                                       calls: list[tuple[str, str]]) -> None:
    p = parser(family)
    expected = ([{"name": n, "arguments": a} for n, a in calls], content or "")
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in [*splits, list(text), [text]]:
        deltas, stream = streamed(p, pieces)
        content_got, calls_got = reassemble(deltas)
        assert (calls_got, content_got) == expected, pieces
        assert stream.made_calls == bool(calls)
        if calls:  # never a piece of the call markup as content
            for delta in deltas:
                for marker in ("<tool", "[TOOL", '{"name"', "</tool_call"):
                    assert marker not in delta.get("content", ""), (pieces, delta)


def test_parallel_tool_calls_false_reads_the_first_call_only() -> None:
    p = FirstCallOnly(parser("hermes"))
    text = CASES["hermes"][1][0]  # content, then two calls
    content, calls = parse_tool_calls(p, text)
    assert (content, [c.name for c in calls]) == ("Let me look.", ["get_weather"])
    for pieces in ([text], list(text)):
        deltas, _ = streamed(p, pieces)
        assert reassemble(deltas) == ("Let me look.", [{"name": "get_weather", "arguments": WEATHER}])


def test_content_before_a_call_streams_before_the_call_completes() -> None:
    p = parser("hermes")
    stream = ToolCallStream(p)
    assert stream.feed("Checking the weather") == [{"content": "Checking the weather"}]
    assert stream.feed(" now.\n<tool_") == [{"content": " now."}]  # the newline may precede a call: held
    assert stream.feed('call>\n{"name": "get_wea') == []
    opening, fragment = stream.feed('ther", "arguments": {"ci')
    assert opening["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": 1') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1'}}]}]
    assert stream.feed("}}\n</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.finish() == []


def test_llama3_waits_for_the_tag_or_brace_before_deciding() -> None:
    p = parser("llama3_json")
    stream = ToolCallStream(p)
    assert stream.feed("<|python") == []
    assert stream.feed('_tag|>{"name": "f", "parameters": {"a": 1}}') != []
    assert stream.made_calls


def test_template_inference_matches_each_family() -> None:
    assert parser("hermes").matches_template("... <tool_call>\\n{...}\\n</tool_call> ...")
    assert parser("mistral").matches_template("{{ '[TOOL_CALLS]' }}")
    assert parser("llama3_json").matches_template("<|python_tag|>")
    assert not parser("hermes").matches_template("{{ '<|im_start|>' + message['content'] }}")


# --- the grammars that force calls (tool_choice "required" / a named function) -------------------------------------

TOOLS = [
    Tool("get_weather", "Weather in a city", {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}),
    Tool("is_prime", None, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["n"], "additionalProperties": False}),
    Tool("ping", None, None),  # no parameters: OpenAI's function without parameters, arguments {}
]
WEIGHTS = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "weights"


def random_walk(grammar: str, seed: int, max_tokens: int = 400, prefix: str = "") -> str:
    """Text sampled uniformly among the tokens the grammar allows at each step, to its end: what the worst model
    could write under the constraint (after `prefix`, which the grammar must accept)."""
    llguidance = pytest.importorskip("llguidance")
    ll_numpy = pytest.importorskip("llguidance.numpy")
    import numpy as np
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(WEIGHTS / "tokenizer.json"))
    eos = backend.token_to_id("<|eos|>")
    tokenizer = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    mask = ll_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    ids = backend.encode(prefix, add_special_tokens=False).ids
    for token in ids:
        assert matcher.consume_token(token), matcher.get_error()
    for _ in range(max_tokens):
        ll_numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:tokenizer.vocab_size])
        token = int(rng.choice(allowed))
        if token == eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
        if matcher.is_stopped():
            break
    else:
        raise AssertionError("the grammar never ended")
    assert matcher.is_accepting()
    return backend.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_forces_parseable_calls_whose_arguments_follow_the_schema(family: str, parallel: bool) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    p = parser(family)
    grammar = p.grammar(TOOLS, parallel=parallel)
    by_name = {t.name: t for t in TOOLS}
    seen = set()
    for seed in range(12):
        text = random_walk(grammar, seed)
        content, calls = parse_tool_calls(p, text)
        assert content is None and calls, text
        assert len(calls) == 1 or (parallel and len(calls) <= MAX_PARALLEL_CALLS), text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), by_name[call.name].arguments_schema())
            seen.add(call.name)
        deltas, _ = streamed(p, [text[i:i + 3] for i in range(0, len(text), 3)])
        assert reassemble(deltas) == ("", [{"name": c.name, "arguments": c.arguments} for c in calls])
    assert len(seen) >= 2, "the walks reached more than one tool"


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_named_grammar_calls_only_that_function(family: str) -> None:
    p = parser(family)
    grammar = p.grammar([TOOLS[1]], parallel=False)
    for seed in range(5):
        _, calls = parse_tool_calls(p, random_walk(grammar, seed))
        assert [c.name for c in calls] == ["is_prime"]


@pytest.mark.parametrize(("family", "prefix", "content"), [
    ("hermes", "Let me check that.\n<tool_call>\n", "Let me check that."),
    ("hermes", "<tool_call>\n", None),
    ("llama3_json", "{", None),
])
def test_a_free_text_grammar_constrains_the_calls_the_model_chooses_to_write(family: str, prefix: str,
                                                                             content: str | None) -> None:
    """tool_choice "auto" with strict tools: the model may write text or calls, and the calls follow their schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    p = parser(family)
    grammar = p.grammar(TOOLS, parallel=True, free_text=True)
    by_name = {t.name: t for t in TOOLS}
    for seed in range(6):
        text = random_walk(grammar, seed, prefix=prefix)
        parsed_content, calls = parse_tool_calls(p, text)
        assert parsed_content == content and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), by_name[call.name].arguments_schema())


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_a_free_text_grammar_lets_text_end_without_a_call(family: str) -> None:
    llguidance = pytest.importorskip("llguidance")
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(WEIGHTS / "tokenizer.json"))
    tokenizer = llguidance.LLTokenizer(backend.to_str(), eos_token=backend.token_to_id("<|eos|>"))
    grammar = parser(family).grammar(TOOLS, parallel=False, free_text=True)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    for token in backend.encode("It is sunny in Paris, {no call}.", add_special_tokens=False).ids:
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    assert matcher.consume_token(tokenizer.eos_token)


def test_mistral_refuses_a_free_text_grammar() -> None:
    with pytest.raises(NotImplementedError):
        parser("mistral").grammar(TOOLS, parallel=True, free_text=True)


# --- selection: the manifest's [chat] tool_parser, or the chat template ------------------------------------------


class _XmlCalls(ToolParser):
    """A third-party parser, registered in code as a plugin's hook would."""

    name = "xml_calls"

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return "<call " in template


class _XmlPlugin:
    @hookimpl
    def ember_tool_parsers(self, register: Any) -> None:
        register("xml_calls", _XmlCalls, summary="<call name=...>")


def test_hook_ember_tool_parsers(make_package: Any) -> None:
    host = PluginHost()
    builtins = host.techniques.of_kind("tool_parser")
    assert {"hermes", "llama3_json", "mistral"} <= set(builtins)
    assert all(t.plugin == "tools" for name, t in builtins.items() if name in CASES)
    host.register(_XmlPlugin(), "xml")
    manifest = load_manifest(make_package())
    report = host.select_tool_parser(manifest, "{{ '<call name=' }}")
    assert (report.name, report.decided_by) == ("xml_calls", "the chat template (chat.tool_parser = 'auto')")


def test_the_manifest_names_the_parser_or_the_template_decides(make_package: Any) -> None:
    host = PluginHost()
    named = load_manifest(make_package(extra_toml='[chat]\ntool_parser = "mistral"\n'))
    report = host.select_tool_parser(named, "<tool_call>")
    assert (report.name, report.decided_by) == ("mistral", "manifest")
    auto = load_manifest(make_package())
    assert host.select_tool_parser(auto, "... <tool_call> ...").name == "hermes"
    assert host.select_tool_parser(auto, "{{ messages }}").name == "none"
    assert host.select_tool_parser(auto, None).reason == "auto: the model has no chat template"
    several = host.select_tool_parser(auto, "<tool_call> or [TOOL_CALLS]")
    assert several.name == "none" and "several parsers (hermes, mistral)" in several.reason
    off = load_manifest(make_package(extra_toml='[chat]\ntool_parser = "none"\n'))
    assert host.select_tool_parser(off, "<tool_call>").name == "none"


def test_an_unknown_parser_is_refused_naming_the_file_and_key(make_package: Any) -> None:
    package = make_package(extra_toml='[chat]\ntool_parser = "hermez"\n')
    with pytest.raises(PluginError) as caught:
        load_package(package)
    message = str(caught.value)
    assert message.startswith(f"{package / 'ember.toml'}: chat.tool_parser: no installed plugin provides tool_parser "
                              "'hermez'")
    assert "did you mean 'hermes'?" in message


def test_explain_shows_the_tool_parser(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    example = WEIGHTS.parent
    auto = Path(shutil.copytree(example, tmp_path / "auto", ignore=shutil.ignore_patterns("ember.lock", "__pycache__")))
    manifest = auto / "ember.toml"
    manifest.write_text(manifest.read_text().replace('tool_parser = "hermes"', 'tool_parser = "auto"'))
    for package, decided_by in ((example, "manifest"), (auto, "the chat template (chat.tool_parser = 'auto')")):
        done = subprocess.run([sys.executable, "-m", "ember", "explain", str(package), "--json"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)["selections"]["tool_parser"]
        assert (report["name"], report["decided_by"]) == ("hermes", decided_by), report


FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", '{"name": "f"', '{"name": "g", "arguments": {"x": [1, "}"]}}',
             ', "arguments": ', '{"a": 1}', "}", "hello", "<tool", "_call>", '"', "{", "[TOOL_CALLS]", "[", "]", ",",
             "; ", "<|python_tag|>", '"name"', ": ", '"parameters": {}', '[TOOL_CALLS] [{"name": "h", "arguments": {}}',
             '[{"name": "h", "arguments": {"b": 2}}', '<tool_call>\n{"name": "k", "arguments": {"c": 3}}\n</tool_call>']


@pytest.mark.parametrize("family", sorted(CASES))
def test_any_mix_of_markup_and_text_streams_to_what_the_whole_parse_says(family: str) -> None:
    """Malformed and truncated markup included: a streamed response never says something the whole one does not."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    p = parser(family)
    made_calls = []

    # no health checks: on a loaded machine "too slow" would fail a test about parsing
    @hypothesis.settings(max_examples=400, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.lists(st.sampled_from(FRAGMENTS), max_size=8))
    def check(parts: list[str]) -> None:
        text = "".join(parts)
        content, calls = parse_tool_calls(p, text)
        made_calls.append(bool(calls))
        for pieces in (list(text), [text]):
            deltas, _ = streamed(p, pieces)
            got = reassemble(deltas)
            assert got == (content or "", [{"name": c.name, "arguments": c.arguments} for c in calls]), pieces

    check()
    assert any(made_calls) and not all(made_calls)
