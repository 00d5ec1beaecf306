"""Make `examples/tiny-llama/`: a complete Ember package around a small Llama trained on Python source.

    python examples/make_tiny_llama.py [--out DIR] [--minutes 18 [--clock cpu|wall] | --steps N | --quick]

Everything is made offline, on the CPU, from text every Python install has: a byte-level BPE tokenizer
trained on the standard library's top-level modules; a Llama-architecture model (GQA, untied
embeddings) initialised from a fixed seed and trained with a plain PyTorch loop (AdamW, warmup then
cosine decay, gradient clipping) on the standard library's source files, minus a held-out 2% of whole
files that only measure it; and the package's ember.toml, hooks.py, README.md and training.json.

Training runs on two threads for a time budget (`--minutes`, default 18) or, with `--steps`, for a fixed
number of steps. The budget counts the training thread's CPU time (`--clock cpu`), which keeps pace with
the wall clock on an idle machine and slows down on a busy one or under `nice`, so that a run trains
about as much anywhere (`--clock wall` counts wall-clock time instead). On an idle 2-core machine
the whole script takes about 20 minutes. Float32 throughout: bfloat16 autocast was five times slower on
a CPU without native bfloat16 (AVX2).

Deterministic as far as the CPU allows: tokenizer, initial weights, held-out split and the order of the
training windows depend only on SEED and the Python version's standard library. A `--steps` run gives
the same weights again with the same software, CPU and thread count. A time-budgeted run takes as many
steps as the machine manages, and its learning-rate schedule follows the time used; training.json
records the steps, and `--steps` repeats that many with a schedule by step instead.

`--quick` trains for one minute into a new temporary directory, to check the script. This script is the
source of every file in the package: edit it, not the generated files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

PACKAGE_NAME = "tiny-llama"
DEFAULT_OUT = Path(__file__).resolve().parent / PACKAGE_NAME
SEED = 0
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
# Trained first, so they take ids 0..4 in this order.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML, with tools as Qwen2.5 and Hermes models write them: the functions in the system turn inside <tools>, the
# assistant's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, the results in a user turn as
# <tool_response>s. So the package's tool parser is "hermes". Without tools it renders plain ChatML.
# One line on purpose: transformers renders templates with trim_blocks and lstrip_blocks and a plain jinja2
# Environment does not; a template without newlines around its tags renders the same in both, so the engine
# may use either.
TOOLS_SYSTEM_PROMPT = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    f"{{{{ '{TOOLS_SYSTEM_PROMPT}' }}}}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    f"{{{{ '{TOOLS_INSTRUCTIONS}<|im_end|>\\n' }}}}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Standard-library folders left out of the training text: test suites (half the library, and
# repetitive), codec tables and pydoc's topic strings (data, not code), and installed packages.
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"})
HELD_OUT_ONE_IN = 50  # a file is held out when the hash of its path says so: about 2% of files
# No prompt ends in a newline: byte-level BPE merges a newline with the indentation after it ("\n   " is one
# token), so a prompt that ends in a bare "\n" asks for what follows a token that rarely ends a line in training
# text, and the model answers with a blank line and a new top-level statement.
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os", "class Stack:\n    def __init__(self):")
SAMPLE_TOKENS = 60


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How the model is trained. The defaults are the committed package's."""

    # In a CPU budget the number of optimizer steps matters most: 200 steps of 8 x 256 tokens at a peak lr of
    # 3e-3 reached a held-out loss of 5.48, 100 steps of 8 x 512 at 2e-3 only 6.01 (the same 410k tokens).
    seq_len: int = 256  # tokens per packed window
    batch_size: int = 8  # windows per step: 2048 tokens
    lr: float = 3e-3  # peak learning rate, reached after warmup
    final_lr_ratio: float = 0.1  # the cosine decays to lr * final_lr_ratio at the end of the budget
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on matrices (embeddings included), not on norm weights
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    num_evals: int = 4  # held-out evaluations on a fixed subset during training (the final one is on all of it)
    eval_windows: int = 24  # windows in that subset

    def __post_init__(self) -> None:
        if not 0 < self.seq_len <= MAX_POSITIONS:
            raise ValueError(f"seq_len must be in 1..{MAX_POSITIONS}, not {self.seq_len}")
        if self.batch_size < 1 or self.lr <= 0 or not 0 <= self.final_lr_ratio <= 1:
            raise ValueError(f"bad training config: {self}")


def manifest_text(num_params: int) -> str:
    return f"""\
# tiny-llama: a small Llama-architecture model trained on Python source, for tests, examples and benchmarks.
# Generated by examples/make_tiny_llama.py: edit that script, not this file.

[model]
name = "{PACKAGE_NAME}"
version = "0.1.0"
weights = "weights"     # Hugging Face layout: config.json, model.safetensors, tokenizer.json
description = "A {num_params / 1e6:.1f}M-parameter Llama (GQA, untied embeddings) trained on Python's standard \
library, with a {VOCAB_SIZE}-token byte-level BPE tokenizer"
license = "Apache-2.0"

[runtime]
dtype = "float32"       # the checkpoint's own dtype: the CPU runs it without casts, and tests compare
                        # the engine's logits with transformers' at tight tolerances
max_model_len = {MAX_POSITIONS}    # the model's max_position_embeddings: the longest context it has RoPE for
kv_block_size = 16      # tokens per KV-cache block: prefix caching shares whole blocks only, so small
                        # blocks share more of a common prompt; 16 keeps block tables short too
max_num_seqs = 64       # a tiny model decodes many sequences per step cheaply: at 64 rather than 32 the
                        # mixed-workload bench ran ~20% faster (per-step costs shared by twice the rows)

[chat]
tool_parser = "hermes"  # the chat template writes calls as <tool_call>{{"name": ..., "arguments": ...}}</tool_call>

[scaling]
min_replicas = 0        # scale to zero when idle: a {num_params * 4 / 1e6:.0f} MB model reloads in well under a second
max_replicas = 2
target_concurrency = 16 # in-flight requests per replica before the autoscaler adds one
scale_down_delay = "5m" # idle time before a replica is removed
prewarm = true          # but start one at deploy time, so `ember serve` answers at once
"""


HOOKS = '''\
"""Hooks that belong to the tiny-llama package.

Ember imports this file when it loads the package and registers it after every plugin, so these
implementations are called first. Any hook in `ember.hookspecs` may be implemented here.
"""

from __future__ import annotations

from typing import Any

from ember import Manifest, hookimpl


@hookimpl
def ember_preprocess_request(request: dict[str, Any], manifest: Manifest) -> dict[str, Any] | None:
    """Called with each request body (OpenAI-style) before it is tokenized.

    Return a new dict to replace the request, or None to keep it. A model could add a default
    system prompt here, for instance:

        if "messages" in request and request["messages"][0]["role"] != "system":
            system = {"role": "system", "content": "You are terse."}
            return {**request, "messages": [system, *request["messages"]]}

    tiny-llama keeps every request as it is, so that tests see exactly what they sent.
    """
    return None
'''


def readme_text(training: dict[str, Any]) -> str:
    """The package's README, made from its training.json alone (so a test can check it is current)."""
    run, data, held_out = training["training"], training["data"], training["held_out"]
    samples = "\n".join(f"```python\n{prompt}{text}\n```\n" for prompt, text in training["samples"].items())
    return f"""\
# {PACKAGE_NAME}

An Ember package with a small Llama-architecture model ({training["model"]["num_parameters"]:,} parameters, GQA,
untied embeddings, float32) and a {VOCAB_SIZE}-token byte-level BPE tokenizer with a ChatML chat template, for
tests, examples and benchmarks. Generated by `python examples/make_tiny_llama.py`; edit the script, not these
files.

The model was trained from scratch on a CPU with {run["threads"]} threads: {run["steps"]:,} steps of
{run["batch_size"] * run["seq_len"]:,} tokens, {run["tokens_seen"]:,} in all ({run["epochs"]:.2f} epochs), of the Python
{data["python"]} standard library's source ({data["train_files"]} files, {data["train_tokens"]:,} tokens), in
{run["wall_minutes"]:.0f} minutes (budget: {run["budget"]}). It continues Python code with something that looks
like Python, and knows nothing else: it is not an assistant, whatever its chat template says.

Held-out loss, the mean cross-entropy per token over {data["held_out_files"]} whole files it never trained on
({data["held_out_tokens"]:,} tokens in {run["seq_len"]}-token windows): **{held_out["loss"]:.3f}** nats,
perplexity **{held_out["perplexity"]:.1f}**. More in `training.json`.

Greedy continuations ({SAMPLE_TOKENS} new tokens) of three prompts:

{samples}"""


def corpus_files() -> list[Path]:
    """The tokenizer's training text: the standard library's top-level modules, sorted.

    Every Python install has them, offline; the top level alone (about 170 files, 5 MB) trains in a
    couple of seconds and skips the test suites and site-packages that live in subdirectories.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise SystemExit(f"no .py files in the standard library directory {stdlib}")
    return files


def train_tokenizer(files: Sequence[Path]) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: every byte has a token, so no text is unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((f.read_text(encoding="utf-8") for f in files), trainer)
    # Plain encoding (completions) starts with <|bos|>; chat templates write it themselves and are
    # encoded without special tokens, as transformers' apply_chat_template does.
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tokenizer


def is_held_out(relative_path: str) -> bool:
    """Whether a file (by its path inside the standard library) is held out: a hash, not a position in
    a list, so that the split of a file never depends on which other files a Python version has."""
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % HELD_OUT_ONE_IN == 0


def training_files() -> tuple[list[Path], list[Path]]:
    """The model's text, (train, held out): the standard library's .py files, recursively, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(stdlib).parts))
    held_out = [f for f in files if is_held_out(f.relative_to(stdlib).as_posix())]
    train = [f for f in files if not is_held_out(f.relative_to(stdlib).as_posix())]
    if not train or not held_out:
        raise SystemExit(f"too few .py files in the standard library directory {stdlib}")
    return train, held_out


def encode_files(tokenizer: Tokenizer, files: Sequence[Path]) -> torch.Tensor:
    """The files as one token stream: each is <|bos|> text <|eos|>, in order. Returns [N] int64."""
    import torch

    eos_id = tokenizer.token_to_id(EOS)
    texts = [f.read_text(encoding="utf-8") for f in files]
    ids = [token for encoding in tokenizer.encode_batch(texts) for token in [*encoding.ids, eos_id]]
    return torch.tensor(ids, dtype=torch.long)


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into windows of seq_len + 1 tokens, each starting where the last one's inputs end,
    so that every token but the first is predicted once: [W, seq_len + 1]. A shorter tail is dropped."""
    import torch

    num_windows = (len(tokens) - 1) // seq_len
    return tokens[torch.arange(num_windows)[:, None] * seq_len + torch.arange(seq_len + 1)]


def batches(tokens: torch.Tensor, config: TrainConfig, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Endless (epoch, [batch_size, seq_len + 1]) batches of packed windows.

    Each epoch starts the windows at a different offset into the stream and shuffles them, both drawn
    from a generator seeded with `seed`, so the order is the same on every run.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    epoch = 0
    while True:
        offset = int(torch.randint(config.seq_len, (1,), generator=generator))
        epoch_windows = windows(tokens[offset:], config.seq_len)
        order = torch.randperm(len(epoch_windows), generator=generator)
        for start in range(0, len(order) - config.batch_size + 1, config.batch_size):
            yield epoch, epoch_windows[order[start:start + config.batch_size]]
        epoch += 1


def model_config(tokenizer: Tokenizer) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=688,  # about 8/3 of hidden_size, as in Llama, rounded to a multiple of 16
        num_hidden_layers=4,
        num_attention_heads=4,  # head_dim 64
        num_key_value_heads=2,  # GQA: two query heads share each KV head, as in the larger Llamas
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,  # separate lm_head, so the loader's handling of both is exercised
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )


def init_model(config: LlamaConfig) -> LlamaForCausalLM:
    """The model with transformers' random initialisation from SEED; `train` starts from it."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each next token. batch: [B, S + 1]."""
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def evaluate(model: LlamaForCausalLM, held_out: torch.Tensor, batch_size: int = 8) -> float:
    """Mean cross-entropy per token over held_out: [W, S + 1] windows, every window the same length."""
    import torch

    was_training = model.training
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(held_out), batch_size):
            batch = held_out[start:start + batch_size]
            total += next_token_loss(model, batch).item() * len(batch)
    model.train(was_training)
    return total / len(held_out)


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over the first steps, times a cosine from lr to lr * final_lr_ratio over progress
    (the fraction of the time or step budget used)."""
    warmup = min(1.0, (step + 1) / config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * warmup * (config.final_lr_ratio + (1 - config.final_lr_ratio) * cosine)


def cpu_clock() -> float:
    """CPU seconds used by the calling thread: the training loop's, which works from start to end.

    On an idle machine it keeps pace with the wall clock; on a busy one, or under `nice`, it slows down
    while the thread waits for a CPU, so that a budget buys about the same training wherever it runs.
    """
    return time.thread_time()


def train(model: LlamaForCausalLM, train_tokens: torch.Tensor, held_out: torch.Tensor, config: TrainConfig, *,
          seconds: float | None = None, max_steps: int | None = None, clock: Callable[[], float] = time.monotonic,
          log_every: float = 30.0) -> dict[str, Any]:
    """Train in place for `seconds` by `clock` or for `max_steps` steps (one of them), and say how it went.

    held_out: [W, seq_len + 1] windows; its first `eval_windows` are evaluated `num_evals` times on the way.
    The schedule's progress is the fraction of the budget used: clock time or steps.
    """
    import torch

    if (seconds is None) == (max_steps is None):
        raise ValueError("train for seconds or for max_steps, not both")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=(config.beta1, config.beta2), fused=False)
    eval_subset = held_out[:config.eval_windows]
    evaluations = [{"step": 0, "tokens_seen": 0, "held_out_subset_loss": round(evaluate(model, eval_subset), 4)}]
    print(f"step      0  held-out loss {evaluations[0]['held_out_subset_loss']:.3f} (subset)", flush=True)

    def progress(step: int) -> float:
        return (clock() - start) / seconds if seconds is not None else step / max_steps

    model.train()
    tokens_per_step = config.batch_size * config.seq_len
    start, wall_start, cpu_start, thread_start = clock(), time.monotonic(), time.process_time(), time.thread_time()
    last_log = wall_start
    step_time = 0.0  # the last step's duration by `clock`, so that a time budget is not overrun
    smoothed = float("nan")
    step = epoch = 0
    next_eval = 1
    for epoch, batch in batches(train_tokens, config, SEED):
        if step >= max_steps if max_steps is not None else clock() - start + step_time > seconds:
            break
        step_start = clock()
        lr = learning_rate(config, step, progress(step))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = next_token_loss(model, batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_time = clock() - step_start
        smoothed = loss.item() if step == 1 else 0.95 * smoothed + 0.05 * loss.item()
        if (now := time.monotonic()) - last_log >= log_every:
            last_log = now
            print(f"step {step:6d}  epoch {epoch}  train loss {smoothed:.3f}  lr {lr:.2e}  grad norm "
                  f"{float(grad_norm):.2f}  {step * tokens_per_step / (now - wall_start):.0f} tokens/s  "
                  f"{(now - wall_start) / 60:.1f} min", flush=True)
        if next_eval <= config.num_evals and progress(step) >= next_eval / (config.num_evals + 1):
            next_eval += 1
            loss_now = evaluate(model, eval_subset)
            evaluations.append({"step": step, "tokens_seen": step * tokens_per_step,
                                "held_out_subset_loss": round(loss_now, 4)})
            print(f"step {step:6d}  held-out loss {loss_now:.3f} (subset)", flush=True)
    model.eval()
    return {"steps": step, "tokens_seen": step * tokens_per_step, "epochs": step * tokens_per_step / len(train_tokens),
            "wall_minutes": (time.monotonic() - wall_start) / 60,
            "thread_cpu_minutes": (time.thread_time() - thread_start) / 60,
            "process_cpu_minutes": (time.process_time() - cpu_start) / 60, "final_train_loss": smoothed,
            "evaluations": evaluations}


def greedy_samples(weights: Path) -> dict[str, str]:
    """Greedy continuations of SAMPLE_PROMPTS, by the checkpoint as transformers loads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            output = model.generate(**inputs, do_sample=False, max_new_tokens=SAMPLE_TOKENS,
                                    pad_token_id=tokenizer.pad_token_id)
        samples[prompt] = tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    return samples


def write_weights(weights: Path, tokenizer: Tokenizer, model: LlamaForCausalLM) -> None:
    """The Hugging Face checkpoint: config, safetensors, generation config and tokenizer files."""
    # Generation stops at <|eos|> and also at <|im_end|>, which ends an assistant turn in chat.
    model.generation_config.eos_token_id = [tokenizer.token_to_id(EOS), tokenizer.token_to_id(IM_END)]
    model.save_pretrained(weights)
    tokenizer.save(str(weights / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (weights / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_package_files(root: Path, training: dict[str, Any]) -> None:
    """ember.toml, hooks.py, README.md and training.json; all but hooks.py are made from `training`."""
    (root / "ember.toml").write_text(manifest_text(training["model"]["num_parameters"]))
    (root / "hooks.py").write_text(HOOKS)
    (root / "README.md").write_text(readme_text(training))
    (root / "training.json").write_text(json.dumps(training, indent=2, ensure_ascii=False) + "\n")


def check_package(root: Path) -> str:
    """Load what was written the way users will, build the package as `ember build` does (writing its
    ember.lock), and return its digest."""
    from transformers import AutoTokenizer

    from ember.package import build_package
    from ember.plugins import PluginHost

    weights = root / "weights"
    tokenizer = AutoTokenizer.from_pretrained(weights)
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == EOS and tokenizer.pad_token == PAD
    assert tokenizer("def f():").input_ids[0] == tokenizer.bos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == f"{BOS}{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n", chat
    return build_package(root, PluginHost.for_package(root)).digest


def replace_dir(new: Path, out: Path) -> None:
    """Put `new` at `out`, replacing a previous package there but nothing else."""
    if out.exists():
        if any(out.iterdir()) and not (out / "ember.toml").is_file():
            raise SystemExit(f"{out} exists and is not a package (no ember.toml); not replacing it")
        shutil.rmtree(out)
    new.rename(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"package directory to create or replace (default: {DEFAULT_OUT}; with --quick, "
                             "a new temporary directory)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=18.0,
                        help="training budget in minutes by --clock (default: 18; the whole script takes about "
                             "a minute more)")
    budget.add_argument("--steps", type=int, default=None,
                        help="train for exactly this many steps instead, whatever the time")
    budget.add_argument("--quick", action="store_true", help="train for one minute, to check the script")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="what --minutes counts: the training thread's CPU time (the default: about the same "
                             "training on a busy machine as on an idle one, where it keeps pace with the wall "
                             "clock), or wall-clock time")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--lr", type=float, default=TrainConfig().lr,
                        help=f"peak learning rate (default: {TrainConfig().lr})")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix=f"{PACKAGE_NAME}-quick-")) / PACKAGE_NAME if args.quick else DEFAULT_OUT
    out: Path = args.out.resolve()
    minutes = 1.0 if args.quick else args.minutes
    budget_text = f"{args.steps} steps" if args.steps else f"{minutes:g} minutes of {args.clock} time"
    config = TrainConfig(lr=args.lr)

    # Threads waiting for work sleep rather than spin: on a busy machine (or under nice) spinning OpenMP threads
    # took the CPU from the threads with work, and training ran three times slower. Read when torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    files = corpus_files()
    tokenizer = train_tokenizer(files)
    model = init_model(model_config(tokenizer))
    num_params = sum(p.numel() for p in model.parameters())

    train_files, held_out_files = training_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_tokens = encode_files(tokenizer, train_files)
    held_out = windows(encode_files(tokenizer, held_out_files), config.seq_len)
    print(f"model: {num_params:,} parameters; text: {len(train_files)} files, {len(train_tokens):,} tokens to train "
          f"on, {len(held_out_files)} held out ({held_out[:, 1:].numel():,} tokens in {len(held_out)} windows); "
          f"training for {budget_text} on {args.threads} threads",
          flush=True)

    result = train(model, train_tokens, held_out, config, seconds=None if args.steps else minutes * 60,
                   max_steps=args.steps, clock=cpu_clock if args.clock == "cpu" else time.monotonic)
    held_out_loss = evaluate(model, held_out)
    print(f"held-out loss {held_out_loss:.4f} nats/token, perplexity {math.exp(held_out_loss):.2f} "
          f"after {result['steps']} steps, {result['tokens_seen']:,} tokens, {result['wall_minutes']:.1f} minutes",
          flush=True)

    training = {
        "model": {"num_parameters": num_params, **{k: getattr(model.config, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")}, "dtype": "float32"},
        "data": {
            "python": platform.python_version(),
            "source": f"the standard library's .py files, recursively, without {', '.join(sorted(EXCLUDED_DIRS))}",
            "train_files": len(train_files), "train_tokens": len(train_tokens),
            "held_out_files": len(held_out_files), "held_out_tokens": held_out[:, 1:].numel(),
            "held_out": [f.relative_to(stdlib).as_posix() for f in held_out_files],
        },
        "training": {
            **asdict(config), "optimizer": "AdamW",
            "schedule": f"linear warmup, cosine decay by {'step' if args.steps else f'{args.clock} time used'}",
            "precision": "float32", "seed": SEED, "threads": args.threads, "budget": budget_text,
            "steps": result["steps"], "tokens_seen": result["tokens_seen"], "epochs": round(result["epochs"], 4),
            **{k: round(result[k], 2) for k in ("wall_minutes", "thread_cpu_minutes", "process_cpu_minutes")},
            "final_train_loss": round(result["final_train_loss"], 4),
        },
        "evaluations": result["evaluations"],
        "held_out": {"loss": round(held_out_loss, 4), "perplexity": round(math.exp(held_out_loss), 2)},
        "samples": {},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside `out` and renamed at the end, so an interrupted run leaves the old package intact.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700, which would become the package's mode
        write_weights(tmp / "weights", tokenizer, model)
        training["samples"] = greedy_samples(tmp / "weights")
        write_package_files(tmp, training)
        digest = check_package(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    for prompt, text in training["samples"].items():
        print(f"--- greedy sample\n{prompt}{text}\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    made = sorted(f.relative_to(out).as_posix() for f in out.rglob("*") if f.is_file())
    print(textwrap.dedent(f"""\
        made {out} in {(time.monotonic() - started) / 60:.1f} minutes
          tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens, trained on {len(files)} files
                     in {files[0].parent}
          model:     LlamaForCausalLM, {num_params:,} parameters, float32, seed {SEED}
          training:  {result['steps']} steps, {result['tokens_seen']:,} tokens, {result['wall_minutes']:.1f} minutes
          held out:  loss {held_out_loss:.4f}, perplexity {math.exp(held_out_loss):.2f}
          files:     {", ".join(made)}
          size:      {size / 2**20:.1f} MiB
          digest:    {digest}"""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
