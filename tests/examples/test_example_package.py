"""examples/tiny-llama: the committed package loads, builds, and its checkpoint works with transformers
and with the plain tokenizers + jinja2 stack the engine uses."""

from __future__ import annotations

import importlib.util
import json
import shutil
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
    spec.loader.exec_module(module)
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
        "README.md", "ember.toml", "hooks.py", "weights/config.json", "weights/generation_config.json",
        "weights/model.safetensors", "weights/tokenizer.json", "weights/tokenizer_config.json",
    ]
    assert lock.total_size < 10 * 2**20
    assert verify_package(package_copy).digest == lock.digest


def test_hooks_load_and_keep_requests(package_copy: Path) -> None:
    from ember.plugins import PluginHost

    host = PluginHost.for_package(package_copy, entry_points=False)
    request = {"model": "tiny-llama", "messages": MESSAGES}
    assert host.preprocess_request(request, load_manifest(package_copy)) == request


def test_generated_text_files_match_the_script(make_script: ModuleType, tmp_path: Path) -> None:
    """The script is the source of these files; an edit made only in the package would be lost."""
    make_script.write_package_files(tmp_path)
    for name in ("ember.toml", "hooks.py", "README.md"):
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
    assert 300_000 <= sum(p.numel() for p in model.parameters()) <= 2_000_000
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
