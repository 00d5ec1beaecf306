"""examples/tiny-llama: the committed package loads, builds, its checkpoint works with transformers and
with the plain tokenizers + jinja2 stack the engine uses, and its model learned some Python."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ember.manifest import load_manifest
from ember.package import build_package, verify_package

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PACKAGE = EXAMPLES / "tiny-llama"
WEIGHTS = PACKAGE / "weights"
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi\nplease"}]
CHATML = ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi\nplease<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """The package copied out of the repository, so building and importing hooks.py write nothing there."""
    return Path(shutil.copytree(PACKAGE, tmp_path / "tiny-llama",
                                ignore=shutil.ignore_patterns("ember.lock", "__pycache__")))


@pytest.fixture(scope="module")
def make_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tiny_llama", EXAMPLES / "make_tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_manifest_loads() -> None:
    manifest = load_manifest(PACKAGE)
    assert manifest.reference == "tiny-llama:0.1.0"
    assert manifest.model.weights == "weights"
    assert (manifest.runtime.kv_block_size, manifest.runtime.max_model_len) == (16, 2048)
    assert manifest.scaling.min_replicas == 0 and manifest.scaling.scale_down_delay == 300.0


def test_package_builds_and_verifies(package_copy: Path) -> None:
    lock = build_package(package_copy)
    assert sorted(f.path for f in lock.files) == [
        "README.md", "ember.toml", "hooks.py", "speculator/draft/config.json",
        "speculator/draft/generation_config.json", "speculator/draft/model.safetensors",
        "speculator/draft/tokenizer.json", "speculator/draft/tokenizer_config.json", "speculator/draft/training.json",
        "speculator/eagle3/config.json", "speculator/eagle3/eagle3.safetensors", "speculator/eagle3/training.json",
        "speculator/medusa/config.json", "speculator/medusa/medusa.safetensors", "speculator/medusa/training.json",
        "training.json",
        "weights/config.json", "weights/generation_config.json", "weights/model.safetensors", "weights/tokenizer.json",
        "weights/tokenizer_config.json",
    ]
    assert lock.total_size < 27 * 2**20  # the 20 MB model and its speculators (draft 3.1, eagle3 2.1, medusa 1.1 MB)
    assert verify_package(package_copy).digest == lock.digest


def test_hooks_load_and_keep_requests(package_copy: Path) -> None:
    from ember.plugins import PluginHost

    host = PluginHost.for_package(package_copy, entry_points=False)
    request = {"model": "tiny-llama", "messages": MESSAGES}
    assert host.preprocess_request(request, load_manifest(package_copy)) == request


def test_generated_text_files_match_the_script(make_script: ModuleType, tmp_path: Path) -> None:
    """The script is the source of these files; an edit made only in the package would be lost."""
    make_script.write_package_files(tmp_path, json.loads((PACKAGE / "training.json").read_text()))
    for name in ("ember.toml", "hooks.py", "README.md", "training.json"):
        assert (tmp_path / name).read_text() == (PACKAGE / name).read_text(), name


def test_config_describes_a_small_gqa_llama() -> None:
    config = json.loads((WEIGHTS / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == load_manifest(PACKAGE).runtime.max_model_len
    generation = json.loads((WEIGHTS / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [SPECIAL.index("<|eos|>"), SPECIAL.index("<|im_end|>")]


def test_weights_load_with_transformers() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(WEIGHTS)
    assert type(model).__name__ == "LlamaForCausalLM"
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 6_000_000
    assert num_params == json.loads((PACKAGE / "training.json").read_text())["model"]["num_parameters"]
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tokenizer_loads_with_transformers_and_renders_chat() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(WEIGHTS)
    config = json.loads((WEIGHTS / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL] == list(range(5))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == tuple(SPECIAL[:3])

    text = "def f(x):\n    return 'héllo 🙂'  # any text: byte-level BPE has no unknown token"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == CHATML
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False).endswith("please<|im_end|>\n")
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert chat_ids == tokenizer(CHATML, add_special_tokens=False).input_ids
    assert chat_ids.count(tokenizer.bos_token_id) == 1


def test_tokenizer_and_template_work_without_transformers() -> None:
    """The engine reads tokenizer.json with `tokenizers` and renders the template with jinja2."""
    jinja2 = pytest.importorskip("jinja2")
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(WEIGHTS / "tokenizer.json"))
    assert tokenizer.encode("x").ids[0] == 0  # plain encoding starts with <|bos|>
    assert [tokenizer.token_to_id(t) for t in SPECIAL] == list(range(5))
    encoded = tokenizer.encode(CHATML, add_special_tokens=False)
    assert encoded.tokens[:2] == ["<|bos|>", "<|im_start|>"]
    assert tokenizer.decode(encoded.ids, skip_special_tokens=False) == CHATML

    tokenizer_config = json.loads((WEIGHTS / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    rendered = template.render(messages=MESSAGES, add_generation_prompt=True,
                               bos_token=tokenizer_config["bos_token"])
    assert rendered == CHATML


def test_training_record_has_a_held_out_loss() -> None:
    training = json.loads((PACKAGE / "training.json").read_text())
    held_out = training["held_out"]
    # Trained: far below a uniform guess over the vocabulary (ln 4096 = 8.3 nats) or the training text's token
    # frequencies (6.6), and about as good as a bigram table (4.55) or better.
    assert 0 < held_out["loss"] < 4.6
    assert held_out["perplexity"] == pytest.approx(math.exp(held_out["loss"]), rel=1e-3)
    assert training["training"]["steps"] > 0 and training["training"]["tokens_seen"] > 0
    assert training["data"]["held_out_files"] > 0 and training["evaluations"][0]["step"] == 0
    assert list(training["samples"]) == ["def fibonacci(n):", "import os", "class Stack:\n    def __init__(self):"]


def test_held_out_split_is_by_whole_file_and_stable(make_script: ModuleType) -> None:
    train, held_out = make_script.training_files()
    assert held_out and not set(train) & set(held_out)
    assert 0.005 < len(held_out) / (len(train) + len(held_out)) < 0.05
    assert [make_script.is_held_out(p) for p in ("functools.py", "os.py")] == [True, False]


def test_greedy_continuation_looks_like_python() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(WEIGHTS)
    model = transformers.AutoModelForCausalLM.from_pretrained(WEIGHTS, dtype=torch.float32)
    inputs = tokenizer("def ", return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert any(s in text for s in ("(", ":", "return", "\n    ")), text
