"""ember.toml: every section accepts a valid value and names the key of an invalid one."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import ManifestError
from ember.manifest import load_manifest, parse_duration

BASE = '[model]\nname = "tiny"\nversion = "0.1.0"\n'


def write(pkg: Path, body: str) -> Path:
    (pkg / "ember.toml").write_text(BASE + body)
    return pkg


def error_of(pkg: Path, body: str) -> str:
    with pytest.raises(ManifestError) as info:
        load_manifest(write(pkg, body))
    return str(info.value)


@pytest.fixture
def pkg(make_package) -> Path:
    return make_package()


def test_defaults_need_only_name_and_version(pkg: Path) -> None:
    m = load_manifest(write(pkg, ""))
    assert m.reference == "tiny:0.1.0"
    assert m.runtime.kv_block_size == 16 and m.quantization.method == "none"
    assert m.kernels.attention == "auto" and m.scaling.min_replicas <= m.scaling.max_replicas


def test_model_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, 'description = "demo"\n'))
    assert m.model.weights == "weights" and m.model.description == "demo"
    (pkg / "ember.toml").write_text('[model]\nname = "Tiny Model"\nversion = "1"\n')
    with pytest.raises(ManifestError, match=r"model\.name: 'Tiny Model' is not a valid package name"):
        load_manifest(pkg)
    (pkg / "ember.toml").write_text('[model]\nname = "tiny"\n')
    with pytest.raises(ManifestError, match=r"model\.version: required key is missing"):
        load_manifest(pkg)
    (pkg / "ember.toml").write_text('[model]\nname = "tiny"\nversion = "1"\nweights = "nope"\n')
    with pytest.raises(ManifestError, match=r"model\.weights: weights directory 'nope' does not exist"):
        load_manifest(pkg)


def test_model_section_missing(pkg: Path) -> None:
    (pkg / "ember.toml").write_text('[runtime]\ndtype = "float32"\n')
    with pytest.raises(ManifestError, match=r"\[model\] section is missing"):
        load_manifest(pkg)


def test_runtime_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[runtime]\ndtype = "bfloat16"\nkv_block_size = 32\nmax_num_seqs = 8\n'))
    assert m.runtime.dtype == "bfloat16" and m.runtime.kv_block_size == 32
    assert "runtime.kv_block_size: must be a power of two from 1 to 256, got 12" in error_of(
        pkg, "[runtime]\nkv_block_size = 12\n")
    assert "runtime.dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16' (got 'fp9')" in error_of(
        pkg, '[runtime]\ndtype = "fp9"\n')
    assert "max_num_batched_tokens (16) must be at least max_num_seqs (64)" in error_of(
        pkg, "[runtime]\nmax_num_batched_tokens = 16\n")


def test_quantization_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[quantization]\nmethod = "int8"\noptions = { group_size = 128 }\n'))
    assert m.quantization.method == "int8" and m.quantization.options == {"group_size": 128}
    assert "quantization.options: Input should be a valid dictionary (got 3)" in error_of(
        pkg, "[quantization]\noptions = 3\n")


def test_speculator_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[speculator]\nmethod = "ngram"\nnum_speculative_tokens = 5\n'))
    assert m.speculator.num_speculative_tokens == 5
    assert "speculator.num_speculative_tokens: must be from 1 to 16, got 17" in error_of(
        pkg, "[speculator]\nnum_speculative_tokens = 17\n")
    assert "speculator.model: speculator model 'draft' does not exist in the package" in error_of(
        pkg, '[speculator]\nmodel = "draft"\n')


def test_parallelism_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, "[parallelism]\ntensor_parallel = 4\n"))
    assert m.parallelism.tensor_parallel == 4
    assert "parallelism.tensor_parallel: must be a power of two from 1 to 64, got 3" in error_of(
        pkg, "[parallelism]\ntensor_parallel = 3\n")


def test_kernels_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[kernels]\nattention = "torch"\n'))
    assert m.kernels.attention == "torch"
    assert "kernels.attention: Input should be a valid string (got 1)" in error_of(pkg, "[kernels]\nattention = 1\n")


def test_scaling_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[scaling]\nmin_replicas = 0\nmax_replicas = 3\nscale_down_delay = "5m"\n'))
    assert m.scaling.min_replicas == 0 and m.scaling.scale_down_delay == 300.0
    assert "scaling: min_replicas (4) must not exceed max_replicas (2)" in error_of(
        pkg, "[scaling]\nmin_replicas = 4\nmax_replicas = 2\n")
    assert "scaling.scale_down_delay: expected a duration" in error_of(pkg, '[scaling]\nscale_down_delay = "soon"\n')


def test_lora_section(pkg: Path) -> None:
    adapter = pkg / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    m = load_manifest(write(pkg, '[[lora]]\nname = "sql"\npath = "adapters/sql"\n'))
    assert [a.name for a in m.lora] == ["sql"]
    assert "lora[0].path: adapter directory 'adapters/chat' does not exist in the package" in error_of(
        pkg, '[[lora]]\nname = "chat"\npath = "adapters/chat"\n')
    assert "lora[0].path: '../x' must be a path inside the package" in error_of(
        pkg, '[[lora]]\nname = "x"\npath = "../x"\n')
    assert "two [[lora]] entries are named 'sql'" in error_of(
        pkg, '[[lora]]\nname = "sql"\npath = "adapters/sql"\n[[lora]]\nname = "sql"\npath = "adapters/sql"\n')


def test_serving_section(pkg: Path) -> None:
    m = load_manifest(write(pkg, '[serving]\ndisaggregated = false\nrequest_timeout = "2m"\n'))
    assert not m.serving.disaggregated and m.serving.request_timeout == 120.0
    assert "serving.max_queue: Input should be greater than or equal to 0" in error_of(
        pkg, "[serving]\nmax_queue = -1\n")


def test_unknown_key_suggests_closest(pkg: Path) -> None:
    message = error_of(pkg, "[runtime]\nmax_num_seq = 4\n")
    assert str(pkg / "ember.toml") in message
    assert "unknown key 'runtime.max_num_seq' in [runtime] — did you mean 'max_num_seqs'?" in message


def test_unknown_section_suggests_closest(pkg: Path) -> None:
    assert "unknown key 'quantisation' in top level — did you mean 'quantization'?" in error_of(
        pkg, '[quantisation]\nmethod = "int8"\n')


def test_unknown_key_in_array_of_tables(pkg: Path) -> None:
    assert "unknown key 'lora[0].pth' in [lora[0]] — did you mean 'path'?" in error_of(
        pkg, '[[lora]]\nname = "a"\npth = "x"\n')


def test_several_problems_listed_together(pkg: Path) -> None:
    message = error_of(pkg, "[runtime]\nkv_block_size = 3\n[parallelism]\ntensor_parallel = 6\n")
    assert "2 problems" in message and "kv_block_size" in message and "tensor_parallel" in message


def test_toml_syntax_error_names_file_and_line(pkg: Path) -> None:
    (pkg / "ember.toml").write_text('[model]\nname = "tiny\n')
    with pytest.raises(ManifestError, match=r"ember\.toml: invalid TOML: .*line 2"):
        load_manifest(pkg)


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such file"):
        load_manifest(tmp_path / "nothing")
    with pytest.raises(ManifestError, match=r"needs an ember\.toml"):
        load_manifest(tmp_path)


@pytest.mark.parametrize(("text", "seconds"), [(30, 30.0), ("30s", 30.0), ("5m", 300.0), ("1.5h", 5400.0),
                                               ("250ms", 0.25)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds
