"""`LLM`: generate for a list of prompts in one call — for scripts, tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.outputs import CompletionOutput
from ember_platform.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """`LLM(path, **overrides)`: `path` is an Ember package dir or a Hugging Face checkpoint dir;
    overrides replace manifest values (`max_num_seqs=8`, `quantization="int8"`, `speculator="ngram"`, ...)
    or set engine knobs (`max_loras=2`, ...)."""

    def __init__(self, path: str | Path, **overrides: Any) -> None:
        self.engine = LLMEngine(path, **overrides)
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 lora_name: str | Sequence[str | None] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion (batched continuously) and return outputs in prompt order.

        `prompts`: a string, a list of token ids, or a list of either. `params`: one for all, or one each.
        `lora_name`: the LoRA adapter for all prompts, or one each (None = the base model).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} for {len(prompts)} prompts")
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_name: {len(loras)} for {len(prompts)} prompts")
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            req = self.engine.add_request(request_id, prompt, p, lora_name=lora)
            outputs[request_id] = CompletionOutput(request_id, list(req.prompt_token_ids))
            order.append(request_id)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done = outputs[out.request_id]
                done.token_ids.extend(out.new_token_ids)
                done.text += out.new_text
                if out.logprobs:
                    done.logprobs = (done.logprobs or []) + list(out.logprobs)
                if out.finished:
                    done.finish_reason, done.stop_reason, done.usage = out.finish_reason, out.stop_reason, out.usage
                    done.error = out.error
                    self.engine.forget(out.request_id)
        return [outputs[i] for i in order]
