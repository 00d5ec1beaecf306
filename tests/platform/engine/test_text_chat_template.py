"""Chat template rendering: the same text as transformers for the Jinja features templates use; clear errors."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pydantic
import pytest

from ember_platform.engine.text import ChatTemplateError, render_chat_template
from ember_platform.engine.text.chat_template import compile_chat_template
from ember_platform.engine.text.testing import write_chatml_tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <in> a city — «ünïcode» 你好",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "reasoning": "Call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "Thanks"},
]

# Each exercises one feature transformers' environment has: its tojson, loop controls, namespaces,
# trim_blocks/lstrip_blocks, dict(), None-valued keys dropped, reasoning aliases, extra variables.
TEMPLATES = {
    "tojson": "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ messages[0] | tojson(separators=(',', ':')) }}"
              "|{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}",
    "loop_controls": "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
                     "{% if loop.index > 4 %}{% break %}{% endif %}[{{ m.role }}]{% endfor %}",
    "namespace": "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
                 "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{{ ns.last_user }}",
    "whitespace": "{% for m in messages %}\n    {% if m.content is defined %}\n{{ m.role }}: {{ m.content }}\n"
                  "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nassistant:\n{% endif %}",
    "dict_and_missing_keys": "{% for m in messages %}{{ dict(role=m.role, has_content=('content' in m)) | tojson }}"
                             "{% endfor %}",
    "reasoning_and_tool_calls": "{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                                "</think>{% endif %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                                "({{ c.function.arguments | tojson }}){% endfor %}{% endfor %}",
    "extra_variables": "{{ bos_token }}{{ eos_token }}{% if enable_thinking is defined and not enable_thinking %}"
                       "no-think{% endif %}{{ messages | length }}",
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory: Path = write_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("feature", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(hf_tokenizer: Any, feature: str, add_generation_prompt: bool) -> None:
    template = TEMPLATES[feature]
    variables = {"bos_token": "<B>", "eos_token": "<E>", "enable_thinking": False}
    expected = hf_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **variables)
    rendered = render_chat_template(template, MESSAGES, tools=TOOLS, add_generation_prompt=add_generation_prompt,
                                    **variables)
    assert rendered == expected


def test_tojson_keeps_non_ascii_and_html_characters() -> None:
    rendered = render_chat_template("{{ messages[0].content | tojson }}", [{"role": "user", "content": "<ü>&你"}])
    assert rendered == '"<ü>&你"'


def test_strftime_now_gives_the_current_date() -> None:
    rendered = render_chat_template("{{ strftime_now('%Y') }}", [{"role": "user", "content": "hi"}])
    assert rendered in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


def test_pydantic_messages_render_as_dicts() -> None:
    class Message(pydantic.BaseModel):
        role: str
        content: str | None = None

    rendered = render_chat_template("{% for m in messages %}{{ m.role }}={{ m.content is defined }};{% endfor %}",
                                    [Message(role="user", content="hi"), Message(role="assistant")])
    assert rendered == "user=True;assistant=False;"


def test_compiled_templates_are_cached() -> None:
    assert compile_chat_template("{{ messages }}") is compile_chat_template("{{ messages }}")


def test_raise_exception_gives_the_templates_message() -> None:
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('First message must be from the user') }}"
                "{% endif %}")
    with pytest.raises(ChatTemplateError, match=r"^First message must be from the user$"):
        render_chat_template(template, [{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(("template", "problem"), [
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages[0].nothing.deeper }}", "failed to render"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed to render"),
    ("{% set xs = [] %}{{ xs.append(1) }}", "failed to render"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
])
def test_template_errors_are_chat_template_errors(template: str, problem: str) -> None:
    with pytest.raises(ChatTemplateError, match=problem) as raised:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert isinstance(raised.value, ValueError)  # the HTTP layer turns ValueErrors into 400s


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(ChatTemplateError, match="message 1"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": "hi"}, "hello"])
    with pytest.raises(ChatTemplateError, match="tool 0"):
        render_chat_template("{{ tools }}", [{"role": "user", "content": "hi"}], tools=["get_weather"])  # type: ignore[list-item]
