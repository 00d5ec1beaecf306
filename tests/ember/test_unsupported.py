"""Settings nothing consumes are refused ("not supported yet", naming the file and the key), never silently accepted:
the manifest's own (ember/manifest/unsupported.py), and options a technique does not declare that it reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember import Hardware, Selection, hookimpl
from ember.errors import ManifestError, PluginError
from ember.manifest import load_manifest, parse_manifest
from ember.manifest.unsupported import UNSUPPORTED
from ember.package.build import lock_package
from ember.plugins import PluginHost, load_package

CPU = Hardware.cpu(frozenset({"avx2"}))

# One manifest snippet per entry of UNSUPPORTED: when a feature lands, its entry and its case here go together.
ASKS = {
    "serving.disaggregated": "[serving]\ndisaggregated = true\n",
    "serving.prefill_replicas": "[serving]\nprefill_replicas = 2\n",
    "serving.decode_replicas": "[serving]\ndecode_replicas = 3\n",
    "parallelism.tensor_parallel": '[parallelism]\nstrategy = "none"\ntensor_parallel = 2\n',
    "parallelism.expert_parallel": '[parallelism]\nstrategy = "none"\nexpert_parallel = 4\n',
}


def test_every_refusal_has_a_case() -> None:
    assert {u.key for u in UNSUPPORTED} == set(ASKS)


@pytest.mark.parametrize("key", sorted(ASKS))
def test_a_setting_nothing_consumes_is_refused_naming_the_file_and_key(make_package, key: str) -> None:
    pkg = make_package(extra_toml=ASKS[key])
    with pytest.raises(ManifestError) as refused:
        load_manifest(pkg)
    assert str(refused.value).startswith(f"{pkg / 'ember.toml'}: {key}: not supported yet: "), refused.value


def test_their_defaults_and_what_is_consumed_load() -> None:
    manifest = parse_manifest({"model": {"name": "m", "version": "1"},
                               "serving": {"disaggregated": False, "prefill_replicas": 1},
                               "parallelism": {"tensor_parallel": 4}})  # "auto": a parallel-strategy plugin's
    assert manifest.parallelism.tensor_parallel == 4


def test_several_refusals_are_listed_together(make_package) -> None:
    with pytest.raises(ManifestError, match=r"2 problems:\n  - serving.disaggregated: not supported yet: .*\n"
                                            r"  - serving.decode_replicas: not supported yet"):
        load_manifest(make_package(extra_toml="[serving]\ndisaggregated = true\ndecode_replicas = 3\n"))


def test_overrides_are_refused_like_the_manifest(make_package) -> None:
    with pytest.raises(ManifestError, match=r"\(with overrides\): parallelism.tensor_parallel: not supported yet"):
        parse_manifest({"model": {"name": "m", "version": "1"},
                        "parallelism": {"strategy": "none", "tensor_parallel": 2}}, source="pkg (with overrides)")


def ember(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())


def test_build_and_verify_refuse_them(make_package) -> None:
    pkg = make_package(extra_toml=ASKS["serving.disaggregated"])
    built = ember("build", str(pkg))
    assert built.returncode != 0 and "serving.disaggregated: not supported yet" in built.stderr, built.stderr
    # A package locked before the refusal existed (its files match the lock) is refused by `ember verify` too.
    manifest = parse_manifest({"model": {"name": "tiny", "version": "0.1.0"}})
    (pkg / "ember.lock").write_bytes(lock_package(pkg, manifest).to_json())
    verified = ember("verify", str(pkg))
    assert verified.returncode != 0, verified.stdout
    assert f"{pkg / 'ember.toml'}: serving.disaggregated: not supported yet" in verified.stderr, verified.stderr


# --- options a technique does not read ------------------------------------------------------------------------


def test_an_option_the_technique_does_not_declare_is_refused_with_what_it_reads(make_package) -> None:
    pkg = make_package(extra_toml='[quantization]\nmethod = "int8"\noptions = { skips = ["lm_head"] }\n')
    with pytest.raises(PluginError) as refused:
        load_package(pkg)
    assert str(refused.value) == (f"{pkg / 'ember.toml'}: quantization.options.skips: not supported by quantization "
                                  "'int8' (plugin 'int8'), which reads only skip, kernel, dense_threshold — did you "
                                  "mean 'skip'?")
    manifest, _ = load_package(make_package(extra_toml='[quantization]\nmethod = "int8"\noptions = { skip = [] }\n'))
    assert manifest.quantization.options == {"skip": []}


def test_options_for_none_or_auto_reach_no_technique(make_package) -> None:
    with pytest.raises(PluginError, match=r"quantization.options.bits: nothing reads it: quantization.method = "
                                          r"'none' names no technique"):
        load_package(make_package(extra_toml="[quantization]\noptions = { bits = 4 }\n"))
    with pytest.raises(PluginError, match=r"speculator.options.max_ngram: nothing reads it: speculator.method = "
                                          r"'auto'"):
        load_package(make_package(extra_toml='[speculator]\nmethod = "auto"\noptions = { max_ngram = 3 }\n'))


def test_a_speculator_model_needs_a_speculator_that_reads_one(make_package) -> None:
    pkg = make_package(extra_toml='[speculator]\nmethod = "ngram"\nmodel = "weights"\n')
    with pytest.raises(PluginError, match=r"speculator.model: not supported by speculator 'ngram' \(plugin "
                                          r"'ngram'\), which reads only min_ngram, max_ngram, adaptive$"):
        load_package(pkg)
    manifest, host = load_package(make_package(extra_toml='[speculator]\nmethod = "ngram"\n'
                                                          'options = { max_ngram = 3 }\n'))
    assert host.select("speculator", manifest, CPU).options["max_ngram"] == 3


def test_a_third_party_technique_gets_the_same_refusal(use_plugins, make_package) -> None:
    use_plugins("techniques")  # a real distribution: its fakeq declares options=("bits",)
    with pytest.raises(PluginError, match=r"quantization.options.bitz: not supported by quantization 'fakeq' "
                                          r"\(plugin 'test-techniques'\), which reads only bits — did you mean"):
        load_package(make_package(extra_toml='[quantization]\nmethod = "fakeq"\noptions = { bitz = 4 }\n'))
    manifest, host = load_package(make_package(extra_toml='[quantization]\nmethod = "fakeq"\n'
                                                          'options = { bits = 4 }\n'))
    assert host.select("quantization", manifest, CPU).options == {"bits": 4}


class _Chooses:
    """A selection plugin whose answers ask for what nothing reads."""

    @hookimpl
    def ember_select_quantization(self, manifest):
        return Selection("int8", options={"group_size": 128})

    @hookimpl
    def ember_select_attention_backend(self, manifest):
        return Selection("torch", options={"block_q": 64})

    @hookimpl
    def ember_select_parallelism(self, manifest):
        return Selection("none", reason="one device will do")


def test_a_selection_plugin_asking_for_unread_settings_is_named(make_package) -> None:
    manifest, host = load_package(make_package(extra_toml="[parallelism]\ntensor_parallel = 2\n"))
    host.register(_Chooses(), "chooser")
    with pytest.raises(PluginError, match=r"^plugin 'chooser' \(ember_select_quantization\): "
                                          r"quantization.options.group_size: not supported by quantization 'int8'"):
        host.select("quantization", manifest, CPU)
    with pytest.raises(PluginError, match=r"^plugin 'chooser' \(ember_select_attention_backend\): "
                                          r"kernels.options.block_q: not supported by attention 'torch' .*, which "
                                          r"reads only max_batched_query_len, chunk_elements, native"):
        host.select("attention", manifest, CPU)
    with pytest.raises(PluginError, match=r"^plugin 'chooser' \(ember_select_parallelism\) chose parallel strategy "
                                          r"'none' for tensor_parallel = 2, expert_parallel = 1: not supported yet"):
        host.select("parallelism", manifest, CPU)


def test_registering_options_as_one_string_declares_that_one(make_package) -> None:
    class OneOption:
        @hookimpl
        def ember_quantizers(self, register):
            register("solo", "x:Y", options="bits")

    host = PluginHost(entry_points=False)
    host.register(OneOption(), "solo-plugin")
    assert host.techniques.get("quantization", "solo").options == ("bits",)


def test_readme_example_manifest_still_loads(tmp_path: Path) -> None:
    """README.md's full ember.toml asks for nothing unsupported (it documents every key)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```toml\n[model]", 1)[1].split("```", 1)[0]
    (tmp_path / "ember.toml").write_text("[model]" + block)
    load_manifest(tmp_path, check_files=False)


def test_attention_options_the_backend_declares_pass_and_others_are_refused(make_package) -> None:
    # [kernels] options reach the backend (tests/platform/engine/test_attention_backends.py runs them); keys the
    # backend did not declare with register(..., options=...) are refused, with the closest declared key.
    manifest, host = load_package(make_package(extra_toml='[kernels]\nattention = "torch"\n'
                                                          'options = { max_batched_query_len = 4 }\n'))
    assert host.select("attention", manifest, CPU).options == {"max_batched_query_len": 4}
    with pytest.raises(PluginError, match=r"kernels.options.max_batched_query: not supported by attention 'torch' "
                                          r".* did you mean 'max_batched_query_len'\?"):
        load_package(make_package(extra_toml='[kernels]\nattention = "torch"\noptions = { max_batched_query = 4 }\n'))
