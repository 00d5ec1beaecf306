"""n choices, best_of, logit_bias, echo, logprobs and GET /v1/models/{id} through `ember serve` (a real gateway and
replica process on loopback) with the official `openai` client: the shapes OpenAI returns, and a 400 naming the
field for each value out of bounds."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-llama"
MODEL = "tiny-llama"
ADMIN_KEY = "ember-sk-admin-for-choices"
BLOCK = 16  # the example's kv_block_size
# A prompt of several whole KV blocks, so that siblings have something to share.
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"


@dataclass
class Served:
    url: str
    api_key: str
    home: Path
    log: Path

    def client(self, base: str = "/v1") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + base, api_key=self.api_key, max_retries=0, timeout=120)

    def replica_urls(self) -> list[str]:
        response = httpx.get(f"{self.url}/admin/deployments/{MODEL}",
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        assert response.status_code == 200, response.text
        return [r["url"] for r in response.json()["replicas"] if r["state"] == "ready"]

    def replica_counter(self, name: str) -> float:
        total = 0.0
        for url in self.replica_urls():
            match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", httpx.get(f"{url}/metrics", timeout=10).text,
                              re.M)
            assert match, f"{name} not in {url}/metrics"
            total += float(match.group(1))
        return total


def package_with_adapter(root: Path) -> Path:
    """The example package with a LoRA adapter "sql" (random weights: what matters is that it is listed and used)."""
    import peft
    import torch
    import transformers

    pkg = root / "pkg"
    shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    base = transformers.AutoModelForCausalLM.from_pretrained(pkg / "weights")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(pkg / "adapters" / "sql")
    with open(pkg / "ember.toml", "a") as f:
        f.write('\n[[lora]]\nname = "sql"\npath = "adapters/sql"\n')
    return pkg


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, stop_serve: Callable[..., None],
           serve_ready_url: Callable[..., str], launch_serve: Callable[..., Any]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-choices")
    launched = launch_serve(tmp, package_with_adapter(tmp), ADMIN_KEY)
    process, log = launched.process, launched.log
    server = Served("", launched.api_key, tmp / "home", log)
    pids: set[int] = set()
    try:
        server.url = serve_ready_url(process, log, 120.0)
        response = httpx.get(f"{server.url}/admin/deployments/{MODEL}",
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        pids.update(r["pid"] for r in response.json()["replicas"] if r["pid"])
        yield server
    finally:
        stop_serve(process, pids, server.home)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A chat completion of PROMPT; with no `extra_body`, EOS is ignored so that token counts are exact."""
    kwargs.setdefault("extra_body", {"ignore_eos": True})
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], **kwargs)


def token_text(token_id: int) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(EXAMPLE / "weights" / "tokenizer.json")).decode([token_id])


# --- n ----------------------------------------------------------------------------------------------------------


def test_chat_n3_returns_three_choices_that_share_one_prefill(served: Served) -> None:
    client = served.client()
    one = chat(client, max_tokens=6, temperature=1.0, seed=11)
    hits = served.replica_counter("ember_prefix_cache_hit_tokens_total")
    queried = served.replica_counter("ember_prefix_cache_queried_tokens_total")
    three = chat(client, max_tokens=6, temperature=1.0, seed=11, n=3, user="user-1234")
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content  # choice 0 keeps the seed
    assert len({c.message.content for c in three.choices}) > 1  # the siblings draw seed + j: they differ
    prompt_tokens = one.usage.prompt_tokens
    assert prompt_tokens > 2 * BLOCK
    assert three.usage.prompt_tokens == prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 18
    # The prompt was cached by the n=1 request: choice 0 hits it, and so do the two siblings, which wait for it.
    full = (prompt_tokens - 1) // BLOCK * BLOCK
    assert served.replica_counter("ember_prefix_cache_queried_tokens_total") - queried == 3 * prompt_tokens
    assert served.replica_counter("ember_prefix_cache_hit_tokens_total") - hits == 3 * full
    again = chat(client, max_tokens=6, temperature=1.0, seed=11, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]


def test_n3_on_a_new_prompt_computes_its_full_blocks_once(served: Served) -> None:
    client = served.client()
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    hits = served.replica_counter("ember_prefix_cache_hit_tokens_total")
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3)
    full = (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert full >= BLOCK
    assert served.replica_counter("ember_prefix_cache_hit_tokens_total") - hits == 2 * full  # the two siblings
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # choice 0 computed the prompt
    assert len({c.text for c in reply.choices}) == 1  # temperature 0: n identical choices, as OpenAI returns


def test_chat_n3_streamed_carries_each_choice_by_index_and_matches_the_unstreamed(served: Served) -> None:
    client = served.client()
    whole = chat(client, max_tokens=6, temperature=1.0, seed=5, n=3)
    texts, finish, roles = ["", "", ""], [None, None, None], set()
    usage = None
    for chunk in chat(client, max_tokens=6, temperature=1.0, seed=5, n=3, stream=True,
                      stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert roles == {0, 1, 2} and finish == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


def test_completions_n_with_several_prompts_numbers_choices_prompt_by_prompt(served: Served) -> None:
    client = served.client()
    prompts = ["import os\n", "def main():\n"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=3, n=2,
                                          extra_body={"ignore_eos": True})
        assert [c.text for c in reply.choices[2 * p:2 * p + 2]] == [c.text for c in alone.choices]
    separate = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert reply.usage.prompt_tokens == sum(separate) and reply.usage.completion_tokens == 20
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in reply.choices]


# --- best_of ----------------------------------------------------------------------------------------------------


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(served: Served) -> None:
    client = served.client()
    kwargs = {"model": MODEL, "prompt": "def parse(", "max_tokens": 6, "temperature": 1.0, "seed": 21,
              "extra_body": {"ignore_eos": True}}
    candidates = client.completions.create(**kwargs, n=4, logprobs=0).choices  # the same seeds: the same 4
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(**kwargs, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # logprobs were not asked for
    assert best.choices[0].text == candidates[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 24  # every candidate was generated
    two = client.completions.create(**kwargs, best_of=4, n=2, logprobs=1)
    ranked = sorted(range(4), key=lambda i: scores[i], reverse=True)
    assert [c.text for c in two.choices] == [candidates[i].text for i in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1]


# --- logit_bias -------------------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(served: Served) -> None:
    client = served.client()
    forced = client.completions.create(model=MODEL, prompt="def parse(", max_tokens=4, temperature=1.0, seed=1,
                                       logit_bias={"1234": 100})
    assert forced.choices[0].text == token_text(1234) * 4
    plain = client.completions.create(model=MODEL, prompt="def parse(", max_tokens=1, temperature=0, logprobs=0)
    favourite = plain.choices[0].logprobs.tokens[0]
    from tokenizers import Tokenizer

    banned_id = Tokenizer.from_file(str(EXAMPLE / "weights" / "tokenizer.json")).token_to_id(favourite)
    if banned_id is None or token_text(banned_id) != favourite:  # a byte-level token's text is not its name
        banned_id = next(i for i in range(4096) if token_text(i) == favourite)
    banned = client.completions.create(model=MODEL, prompt="def parse(", max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(banned_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != favourite
    chat_forced = chat(client, max_tokens=3, temperature=0, logit_bias={"1234": 100})
    assert chat_forced.choices[0].message.content == token_text(1234) * 3


# --- echo and logprobs ------------------------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_each_choice_streamed_and_not(served: Served) -> None:
    client = served.client()
    reply = client.completions.create(model=MODEL, prompt=["import os\n", "x = 1\n"], max_tokens=4, temperature=0,
                                      echo=True, n=2)
    plain = client.completions.create(model=MODEL, prompt=["import os\n", "x = 1\n"], max_tokens=4, temperature=0,
                                      n=2)
    prompts = ["import os\n", "import os\n", "x = 1\n", "x = 1\n"]
    assert [c.text for c in reply.choices] == [p + c.text for p, c in zip(prompts, plain.choices, strict=True)]
    first: dict[int, str] = {}
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=["import os\n", "x = 1\n"], max_tokens=4,
                                           temperature=0, echo=True, n=2, stream=True):
        for choice in chunk.choices:
            first.setdefault(choice.index, choice.text)
            streamed[choice.index] += choice.text
    assert all(first[i].startswith(prompts[i]) for i in range(4))
    assert streamed == [c.text for c in reply.choices]


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_the_first_null(served: Served) -> None:
    client = served.client()
    prompt = "import os\nimport sys\n"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      echo=True, n=2)
    num_prompt = reply.usage.prompt_tokens
    for choice in reply.choices:
        lp = choice.logprobs
        assert choice.text == prompt + plain.choices[0].text
        assert len(lp.tokens) == num_prompt + 3 and lp.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
        assert all(2 <= len(top) <= 3 and top[t] == x for t, x, top in
                   zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed: list[Any] = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                           echo=True, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset,
                                     strict=True))
    whole = reply.choices[0].logprobs
    assert [t for t, _, _ in streamed] == whole.tokens and [o for _, _, o in streamed] == whole.text_offset
    assert streamed[0][1] is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served: Served) -> None:
    """What lm-evaluation-harness sends to score a text: the prompt's logprobs, nothing generated."""
    client = served.client()
    prompt = "import os\nimport sys\n"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True)
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    num_prompt = scored.usage.prompt_tokens
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.tokens == full.choices[0].logprobs.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(full.choices[0].logprobs.token_logprobs[1:num_prompt],
                                                               abs=1e-5)
    streamed = "".join(c.text for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, stream=True) for c in chunk.choices)
    assert streamed == prompt
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # without echo there is nothing to return
    assert caught.value.body["param"] == "max_tokens"


def test_completion_logprobs_have_openais_shape(served: Served) -> None:
    client = served.client()
    reply = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, temperature=0, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely
    streamed_tokens: list[str] = []
    for chunk in client.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, temperature=0,
                                           logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed_tokens += c.logprobs.tokens
    assert streamed_tokens == lp.tokens


def test_chat_logprobs_have_openais_shape_streamed_and_not(served: Served) -> None:
    client = served.client()
    reply = chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, n=2)
    for choice in reply.choices:
        content = choice.logprobs.content
        assert len(content) == 4 and "".join(t.token for t in content) == choice.message.content
        assert b"".join(bytes(t.bytes) for t in content).decode() == choice.message.content
        for token in content:
            assert len(token.top_logprobs) == 3
            assert token.top_logprobs[0].logprob == token.logprob  # greedy
    streamed: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, n=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed[choice.index] += [t.token for t in choice.logprobs.content]
    assert streamed[0] == streamed[1] == [t.token for t in reply.choices[0].logprobs.content]
    no_top = chat(client, max_tokens=2, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)


# --- /v1/models/{id} --------------------------------------------------------------------------------------------


def test_models_retrieve(served: Served) -> None:
    model = served.client().models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "ember") and model.created > 0
    assert served.client(f"/models/{MODEL}/v1").models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().models.retrieve("no-such-model")
    assert "'no-such-model'" in caught.value.message and MODEL in caught.value.message
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    adapter = served.client().models.retrieve(f"{MODEL}:sql")
    assert (adapter.id, adapter.object, adapter.owned_by) == (f"{MODEL}:sql", "model", "ember")
    assert served.client(f"/models/{MODEL}/v1").models.retrieve(f"{MODEL}:sql").id == f"{MODEL}:sql"
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().models.retrieve(f"{MODEL}:no-adapter")
    assert f"{MODEL}:sql" in caught.value.message  # the 404 lists what is served
    with pytest.raises(openai.NotFoundError):
        served.client(f"/models/{MODEL}/v1").models.retrieve("other-model")


def test_n_choices_of_an_adapter_share_their_prefill_too(served: Served) -> None:
    client = served.client()
    prompt = "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    hits = served.replica_counter("ember_prefix_cache_hit_tokens_total")
    reply = client.completions.create(model=f"{MODEL}:sql", prompt=prompt, max_tokens=3, temperature=0, n=3)
    full = (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert full >= BLOCK and len(reply.choices) == 3
    assert served.replica_counter("ember_prefix_cache_hit_tokens_total") - hits == 2 * full
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert base.choices[0].text != reply.choices[0].text  # the adapter was used


# --- bad values ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "extra", "param"), [
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": 129}, "n"),
    ("completions", {"n": 129}, "n"),
    ("completions", {"best_of": 2, "n": 3}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"),
    ("completions", {"best_of": 129}, "best_of"),
    ("completions", {"prompt": ["a"] * 65, "n": 2}, "n"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"4096": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_values_out_of_bounds_are_400s_naming_the_field(served: Served, endpoint: str, extra: dict[str, Any],
                                                        param: str) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            chat(client, max_tokens=2, **extra)
        else:
            client.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra})
    assert caught.value.body["param"] == param, caught.value.body


def test_user_is_accepted(served: Served) -> None:
    reply = chat(served.client(), max_tokens=2, user="someone@example.com")
    assert reply.usage.completion_tokens == 2
