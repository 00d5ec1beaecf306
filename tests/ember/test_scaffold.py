"""`ember init`: scaffolding a package from a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from ember.errors import ManifestError, PackageError
from ember.manifest import Manifest, load_manifest, parse_manifest
from ember.package import build_package, scaffold, verify_package
from ember.package.scaffold import checkpoint_name, init_package, slugify


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (tiny, random) checkpoint written by transformers' save_pretrained."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=8192)
    out = tmp_path_factory.mktemp("hf") / "Tiny-Llama_Chat"
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def fake_checkpoint(root: Path, **config: object) -> Path:
    """config.json plus one safetensors file: enough for the scaffold, without torch."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **config}))
    save_file({"lm_head.weight": np.zeros((4, 4), dtype=np.float32)}, str(root / "model.safetensors"))
    return root


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".ember-tmp")]


def test_scaffold_from_transformers_checkpoint_loads_and_builds(llama_dir: Path, tmp_path: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    pkg = init_package(tmp_path / "my-model", llama_dir)

    manifest = load_manifest(pkg)
    assert manifest.model.name == "my-model"  # named after the package directory, not the checkpoint's
    assert manifest.model.version == "0.1.0"
    assert manifest.model.weights == "weights"
    assert "LlamaForCausalLM" in manifest.model.description
    assert manifest.runtime.dtype == config["dtype"] == "float32"
    assert manifest.runtime.max_model_len == 4096  # min(8192, 4096)
    for source in llama_dir.iterdir():
        assert (pkg / "weights" / source.name).read_bytes() == source.read_bytes()

    lock = build_package(pkg)
    assert {f.path for f in lock.files} >= {"ember.toml", "weights/config.json", "weights/model.safetensors"}
    assert verify_package(pkg).digest == lock.digest
    assert leftovers(tmp_path) == []


def test_every_commented_key_is_valid_and_shows_the_schema_default(tmp_path: Path) -> None:
    pkg = init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf", max_position_embeddings=2048))
    text = (pkg / "ember.toml").read_text()
    # Uncomment key lines and table headers; prose comments ("# [runtime]: how ...") stay comments.
    uncommented = re.sub(r"(?m)^# (?=\[\[?\w+\]\]?$|\w+ = )", "", text)
    assert uncommented != text
    full = parse_manifest(tomllib.loads(uncommented))

    scaffolded = load_manifest(pkg).model_dump()
    full_dump = full.model_dump()
    # Keys without a default are shown with an example value instead.
    assert full_dump["model"].pop("license") == "apache-2.0"
    assert full_dump["runtime"].pop("kv_cache_memory_gb") == 8.0
    assert full_dump["speculator"].pop("model") == "speculator"
    assert full_dump.pop("lora") == [{"name": "my-adapter", "path": "adapters/my-adapter"}]
    for section, key in [("model", "license"), ("runtime", "kv_cache_memory_gb"), ("speculator", "model")]:
        assert scaffolded[section].pop(key) is None
    assert scaffolded.pop("lora") == []
    assert full_dump == scaffolded


def test_every_schema_key_appears_in_the_scaffold(tmp_path: Path) -> None:
    text = (init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf")) / "ember.toml").read_text()
    for section, field in Manifest.model_fields.items():
        assert re.search(rf"(?m)^(# )?\[\[?{section}\]\]?$", text), section
        model = scaffold._section_model(field.annotation)[0]
        for key in model.model_fields:
            assert re.search(rf"(?m)^(# )?{key}( =|:)", text), f"{section}.{key}"


@pytest.mark.parametrize(("config", "dtype", "max_model_len"), [
    ({"torch_dtype": "bfloat16", "max_position_embeddings": 1024}, "bfloat16", 1024),
    ({"dtype": "float16", "max_position_embeddings": 131072}, "float16", 4096),
    ({"torch_dtype": "torch.float16"}, "float16", None),
    ({"torch_dtype": "float8_e4m3fn"}, "auto", None),
    ({}, "auto", None),
    ({"text_config": {"torch_dtype": "bfloat16", "max_position_embeddings": 512}}, "bfloat16", 512),
])
def test_runtime_values_come_from_config(tmp_path: Path, config: dict[str, object], dtype: str,
                                         max_model_len: int | None) -> None:
    pkg = init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf", **config))
    runtime = load_manifest(pkg).runtime
    assert (runtime.dtype, runtime.max_model_len) == (dtype, max_model_len)


@pytest.mark.parametrize(("text", "slug"), [
    ("Meta-Llama-3.1-8B-Instruct", "meta-llama-3.1-8b-instruct"),
    ("My Model (v2)!", "my-model-v2"),
    ("__private__", "private"),
    ("Ünïcode model", "unicode-model"),
    ("模型", ""),
    ("x" * 100, "x" * 64),
    ("!!!", ""),
])
def test_slugify(text: str, slug: str) -> None:
    assert slugify(text) == slug


def test_explicit_name_is_slugified(tmp_path: Path) -> None:
    pkg = init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf"), name="Team/Great Model",
                       version="2.0.0")
    manifest = load_manifest(pkg)
    assert (manifest.model.name, manifest.model.version) == ("team-great-model", "2.0.0")


def test_name_of_a_hugging_face_cache_snapshot_is_the_repository(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--meta-llama--Llama-3.2-1B" / "snapshots" / ("a" * 40)
    assert checkpoint_name(snapshot) == "Llama-3.2-1B"
    assert checkpoint_name(tmp_path / "plain") == "plain"


def test_the_checkpoint_names_the_package_only_when_the_directory_cannot(tmp_path: Path) -> None:
    hf = fake_checkpoint(tmp_path / "Llama-Tiny")
    assert load_manifest(init_package(tmp_path / "My Package", hf)).model.name == "my-package"
    assert load_manifest(init_package(tmp_path / "___", hf)).model.name == "llama-tiny"


def test_unusable_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="cannot make a package name"):
        init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf"), name="???")
    assert not (tmp_path / "pkg").exists()


def test_invalid_version_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"pkg/ember.toml: model.version"):
        init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf"), version="1 0")
    assert not (tmp_path / "pkg").exists()
    assert leftovers(tmp_path) == []


def test_copies_tokenizer_files_and_skips_hidden_ones(tmp_path: Path) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "model.safetensors.index.json", "original/params.json"):
        (hf / name).parent.mkdir(exist_ok=True)
        (hf / name).write_text("{}")
    (hf / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (hf / ".cache" / "huggingface").mkdir(parents=True)
    (hf / ".cache" / "huggingface" / "model.safetensors.lock").write_text("")

    pkg = init_package(tmp_path / "pkg", hf)
    copied = sorted(p.relative_to(pkg / "weights").as_posix()
                    for p in (pkg / "weights").rglob("*") if p.is_file())
    assert copied == ["chat_template.jinja", "config.json", "model.safetensors",
                      "model.safetensors.index.json", "original/params.json", "tokenizer.json",
                      "tokenizer_config.json"]


def test_link_makes_hardlinks(tmp_path: Path) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    pkg = init_package(tmp_path / "pkg", hf, link=True)
    assert (pkg / "weights" / "model.safetensors").samefile(hf / "model.safetensors")
    build_package(pkg)


def test_link_falls_back_to_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(scaffold.os, "link", no_links)
    hf = fake_checkpoint(tmp_path / "hf")
    pkg = init_package(tmp_path / "pkg", hf, link=True)
    copy = pkg / "weights" / "model.safetensors"
    assert not copy.samefile(hf / "model.safetensors")
    assert copy.read_bytes() == (hf / "model.safetensors").read_bytes()


def test_pickle_checkpoint_is_refused_with_the_file_named(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(PackageError) as info:
        init_package(tmp_path / "pkg", hf)
    message = str(info.value)
    assert str(hf / "pytorch_model.bin") in message
    assert "safe_serialization=True" in message and f"d='{hf}'" in message
    assert not (tmp_path / "pkg").exists()
    assert leftovers(tmp_path) == []


def test_pickle_beside_safetensors_is_called_redundant(tmp_path: Path) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    (hf / "original").mkdir()
    (hf / "original" / "consolidated.00.pth").write_bytes(b"x")
    with pytest.raises(PackageError, match=r"consolidated\.00\.pth.*redundant copy: delete it"):
        init_package(tmp_path / "pkg", hf)
    assert not (tmp_path / "pkg").exists()


def test_checkpoint_without_safetensors_is_refused(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(PackageError, match=r"no \*\.safetensors file"):
        init_package(tmp_path / "pkg", hf)
    assert not (tmp_path / "pkg").exists()


def test_non_empty_target_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "pkg"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(PackageError, match=f"{re.escape(str(target))}: directory is not empty"):
        init_package(target, fake_checkpoint(tmp_path / "hf"))
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def test_file_as_target_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pkg").write_text("")
    with pytest.raises(PackageError, match="is not a directory"):
        init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf"))


def test_empty_target_directory_is_used(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    pkg = init_package(tmp_path / "pkg", fake_checkpoint(tmp_path / "hf"))
    assert (pkg / "ember.toml").is_file()


def test_current_directory_as_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    init_package(Path("."), hf, name="here")
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["ember.toml", "weights"]
    assert leftovers(tmp_path) == []
    build_package(tmp_path / "here")


def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    pkg = init_package(tmp_path / "a" / "b" / "pkg", fake_checkpoint(tmp_path / "hf"))
    build_package(pkg)


def test_missing_config_is_refused_with_the_file_named(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(PackageError, match=f"{re.escape(str(hf / 'config.json'))}: no such file"):
        init_package(tmp_path / "pkg", hf)
    assert not (tmp_path / "pkg").exists()


def test_invalid_config_is_refused(tmp_path: Path) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    (hf / "config.json").write_text("{not json")
    with pytest.raises(PackageError, match=r"config\.json: not valid JSON"):
        init_package(tmp_path / "pkg", hf)


def test_failure_while_copying_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = fake_checkpoint(tmp_path / "hf")
    (hf / "tokenizer.json").write_text("{}")
    real_place = scaffold._place
    calls = 0

    def place_then_fail(src: Path, dst: Path, *, link: bool) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(28, "No space left on device")
        real_place(src, dst, link=link)

    monkeypatch.setattr(scaffold, "_place", place_then_fail)
    with pytest.raises(OSError, match="No space left"):
        init_package(tmp_path / "pkg", hf)
    assert not (tmp_path / "pkg").exists()
    assert leftovers(tmp_path) == []
