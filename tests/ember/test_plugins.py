"""The plugin host: discovery through real entry points, blocklist, package hooks, selection."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember import Hardware, Selection, hookimpl
from ember.errors import PluginError
from ember.manifest import load_manifest
from ember.plugins import PluginHost, load_package
from ember.techniques import KINDS

REPO_ROOT = Path(__file__).resolve().parents[2]

CPU = Hardware.cpu(frozenset({"avx2"}))


def write_hooks(pkg: Path, source: str) -> Path:
    (pkg / "hooks.py").write_text(source)
    return pkg


# --- discovery ----------------------------------------------------------------------------


def test_plugins_are_discovered_through_entry_points(use_plugins) -> None:
    use_plugins("redact", "techniques")
    infos = {p.name: p for p in PluginHost().plugins()}
    assert infos["redact"].distribution == "ember-redact" and infos["redact"].version == "0.1.0"
    assert infos["test-techniques"].version == "1.2.3"
    assert {(t.kind, t.name) for t in infos["test-techniques"].techniques} == {
        ("quantization", "fakeq"), ("speculator", "fakespec"), ("attention", "fakeattn"),
        ("parallelism", "tensor"), ("routing_scorer", "fakescore")}
    assert infos["auto"].distribution == "ember"  # built-ins load through the same path


def test_blocklist_from_environment(use_plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    use_plugins("redact", "techniques")
    monkeypatch.setenv("EMBER_DISABLE_PLUGINS", "redact, test-techniques")
    names = {p.name for p in PluginHost().plugins()}
    assert "redact" not in names and "test-techniques" not in names and "auto" in names


def test_broken_plugin_is_named(use_plugins) -> None:
    use_plugins("broken")
    with pytest.raises(PluginError, match=r"plugin 'broken' \(from ember-broken-plugin, ember_broken_plugin\) "
                                          r"failed to import: ModuleNotFoundError"):
        PluginHost()
    assert "broken" not in {p.name for p in PluginHost(disabled={"broken"}).plugins()}


def test_misspelled_hook_fails_loudly(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_select_quantisation(manifest):\n    return 'int8'\n")
    with pytest.raises(PluginError, match=r"ember_select_quantisation.*did you mean 'ember_select_quantization'"):
        PluginHost.for_package(pkg, entry_points=False)


def test_error_in_hooks_file_names_file_and_line(make_package) -> None:
    pkg = write_hooks(make_package(), "x = 1\ny = undefined_name\n")
    with pytest.raises(PluginError, match=r"hooks\.py:2: NameError: name 'undefined_name' is not defined"):
        PluginHost.for_package(pkg, entry_points=False)


def test_technique_registered_twice_names_both_plugins() -> None:
    class A:
        @hookimpl
        def ember_quantizers(self, register):
            register("int8", object)

    host = PluginHost(entry_points=False)
    host.register(A(), "first")
    host.register(A(), "second")
    with pytest.raises(PluginError, match=r"registered by both plugin '(first|second)' and plugin '(first|second)'"):
        host.techniques.of_kind("quantization")


def test_lazy_technique_loads_on_use(use_plugins) -> None:
    use_plugins("techniques")
    technique = PluginHost().techniques.get("quantization", "fakeq")
    assert technique is not None and technique.load().__name__ == "FakeQuantizer"


# --- manifest checks ----------------------------------------------------------------------


def test_unknown_technique_lists_available(use_plugins, make_package) -> None:
    use_plugins("techniques")
    pkg = make_package(extra_toml='[quantization]\nmethod = "fakq"\n')
    with pytest.raises(PluginError) as info:
        load_package(pkg)
    assert re.search(r"ember\.toml: quantization\.method: no installed plugin provides quantization 'fakq' "
                     r"\(available: [^)]*\bfakeq, [^)]*\bint8\b[^)]*, auto, none\) — did you mean 'fakeq'\?",
                     str(info.value))


def test_unknown_attention_backend_is_refused(make_package) -> None:
    pkg = make_package(extra_toml='[kernels]\nattention = "flashy"\n')
    with pytest.raises(PluginError, match="no installed plugin provides attention 'flashy'"):
        load_package(pkg)


# --- selection ----------------------------------------------------------------------------


def test_explicit_manifest_choice_is_the_default(use_plugins, make_package) -> None:
    use_plugins("techniques")
    manifest, host = load_package(make_package(extra_toml='[quantization]\nmethod = "fakeq"\n'
                                                          "options = { bits = 8 }\n"))
    report = host.select("quantization", manifest, CPU)
    assert (report.name, report.decided_by, dict(report.options)) == ("fakeq", "manifest", {"bits": 8})
    assert "in ember.toml" in report.reason


def test_auto_lets_a_plugin_decide(use_plugins, make_package) -> None:
    use_plugins("techniques")
    manifest, host = load_package(make_package(extra_toml='[quantization]\nmethod = "auto"\n'))
    report = host.select("quantization", manifest, CPU)
    assert report.name == "fakeq" and report.options == {"bits": 4}
    assert report.decided_by == "plugin 'test-techniques' (ember_select_quantization)"


def test_package_hooks_override_plugins(use_plugins, make_package) -> None:
    use_plugins("techniques")
    pkg = write_hooks(make_package(extra_toml='[quantization]\nmethod = "auto"\n'),
                      "from ember import Selection, hookimpl\n\n@hookimpl\n"
                      "def ember_select_quantization(manifest, hardware):\n"
                      "    return Selection('none', reason='this model loses too much accuracy')\n")
    manifest, host = load_package(pkg)
    report = host.select("quantization", manifest, CPU)
    assert (report.name, report.decided_by) == ("none", "package hooks.py (ember_select_quantization)")
    assert report.reason == "this model loses too much accuracy"


def test_selection_of_an_uninstalled_technique_is_refused(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_select_speculator():\n    return 'lookahead'\n")
    manifest, host = load_package(pkg)
    with pytest.raises(PluginError, match=r"package hooks.py \(ember_select_speculator\) chose speculator "
                                          r"'lookahead': no installed plugin provides speculator 'lookahead'"):
        host.select("speculator", manifest, CPU)


def test_auto_with_nothing_installed_falls_back_plainly(make_package) -> None:
    manifest = load_manifest(make_package(extra_toml='[quantization]\nmethod = "auto"\n'))
    host = PluginHost(entry_points=False)
    report = host.select("quantization", manifest, CPU)
    assert (report.name, report.decided_by) == ("none", "ember's auto fallback")
    with pytest.raises(PluginError) as refused:
        host.select("attention", manifest, CPU)
    # The remedy is there whatever the kind's first letter ("an attention", "a speculator").
    assert str(refused.value) == ("no installed plugin provides an attention technique for "
                                  f"{CPU.describe()} (set kernels.attention in ember.toml, or install a plugin "
                                  "that provides one)")


def test_hook_error_is_attributed(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_select_parallelism(manifest):\n    return 1 / 0\n")
    manifest, host = load_package(pkg)
    with pytest.raises(PluginError, match=r"package hooks.py: ember_select_parallelism raised ZeroDivisionError"):
        host.select("parallelism", manifest, CPU)


# --- one test per hook (test_every_hook_has_a_test checks that) ---------------------------


@pytest.mark.parametrize("hook", ["ember_quantizers", "ember_speculators", "ember_attention_backends",
                                  "ember_parallel_strategies", "ember_routing_scorers"])
def test_registration_hooks(use_plugins, hook: str) -> None:
    use_plugins("techniques")
    kind = next(k for k, spec in KINDS.items() if spec.register_hook == hook)
    techniques = PluginHost().techniques.of_kind(kind)
    assert any(t.plugin == "test-techniques" for t in techniques.values())
    assert PluginHost(disabled={"test-techniques"}).techniques.of_kind(kind).keys() < techniques.keys()


def test_hook_ember_quantizers(use_plugins) -> None:
    test_registration_hooks(use_plugins, "ember_quantizers")


def test_hook_ember_speculators(use_plugins) -> None:
    test_registration_hooks(use_plugins, "ember_speculators")


def test_hook_ember_attention_backends(use_plugins) -> None:
    test_registration_hooks(use_plugins, "ember_attention_backends")


def test_hook_ember_parallel_strategies(use_plugins) -> None:
    test_registration_hooks(use_plugins, "ember_parallel_strategies")


def test_hook_ember_routing_scorers(use_plugins) -> None:
    test_registration_hooks(use_plugins, "ember_routing_scorers")


def test_hook_ember_select_quantization(use_plugins, make_package) -> None:
    use_plugins("redact")  # README plugin: int8 on CPU when int8 is installed
    manifest, host = load_package(make_package(extra_toml='[quantization]\nmethod = "auto"\n'))
    assert "int8" in host.techniques.of_kind("quantization")  # the built-in int8 plugin
    report = host.select("quantization", manifest, CPU)
    assert report.name == "int8" and report.decided_by.startswith("plugin 'redact'")
    gpu = Hardware("cuda", "H200", 141 * 2**30, (9, 0), frozenset(), 16, 2**40)
    on_gpu = host.select("quantization", manifest, gpu)  # the built-in auto rule: fp8 tensor cores on sm_89+
    assert (on_gpu.name, dict(on_gpu.options)) == ("fp8", {"activations": "fp8"}) and "FP8" in on_gpu.reason


def test_hook_ember_select_speculator(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_select_speculator(manifest, available):\n"
                      "    return 'ngram' if 'ngram' in available else 'none'\n")
    manifest, host = load_package(pkg)
    assert host.select("speculator", manifest, CPU).name == "ngram"  # the built-in ngram plugin is available
    assert PluginHost.for_package(pkg, disabled={"ngram"}).select("speculator", manifest, CPU).name == "none"


def test_hook_ember_select_attention_backend(use_plugins, make_package) -> None:
    use_plugins("techniques")
    manifest, host = load_package(make_package())
    report = host.select("attention", manifest, CPU)  # the built-in auto rule prefers torch on a CPU
    assert (report.name, report.decided_by) == ("torch", "plugin 'auto' (ember_select_attention_backend)")
    host = PluginHost(disabled={"attention-torch"})
    report = host.select("attention", manifest, CPU)  # no rule answers: the plain fallback takes what is installed
    assert (report.name, report.decided_by) == ("fakeattn", "ember's auto fallback")
    pkg = write_hooks(make_package(), "from ember import Selection, hookimpl\n\n@hookimpl\n"
                      "def ember_select_attention_backend(hardware):\n"
                      "    return Selection('fakeattn', reason='on ' + hardware.device_kind)\n")
    manifest, host = load_package(pkg)
    assert host.select("attention", manifest, CPU).reason == "on cpu"


def test_hook_ember_select_parallelism(use_plugins, make_package) -> None:
    use_plugins("techniques")
    manifest, host = load_package(make_package(extra_toml="[parallelism]\ntensor_parallel = 2\n"))
    report = host.select("parallelism", manifest, CPU)
    assert report.name == "tensor" and report.options == {"tensor_parallel": 2, "expert_parallel": 1}
    manifest, host = load_package(make_package())
    assert host.select("parallelism", manifest, CPU).name == "none"


def test_hook_ember_model_loaded(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\nSEEN = []\n\n@hookimpl\n"
                      "def ember_model_loaded(manifest, model, hardware):\n"
                      "    SEEN.append((manifest.model.name, model, hardware.device_kind))\n")
    manifest, host = load_package(pkg)
    host.model_loaded(manifest, model="the-model", hardware=CPU)
    (plugin,) = [p for name, p in host.pm.list_name_plugin() if name.startswith("package:")]
    assert plugin.SEEN == [("tiny", "the-model", "cpu")]


def test_hook_ember_preprocess_request(use_plugins, make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_preprocess_request(request, manifest):\n"
                      "    return {**request, 'max_tokens': min(request.get('max_tokens', 64), 64)}\n")
    manifest, host = load_package(pkg)
    assert host.preprocess_request({"prompt": "hi", "max_tokens": 4096}, manifest) == {
        "prompt": "hi", "max_tokens": 64}


def test_a_preprocess_hook_that_returns_no_dict_is_named(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_preprocess_request(request, manifest):\n    return 'hi'\n")
    manifest, host = load_package(pkg)
    with pytest.raises(PluginError, match=r"^package hooks.py: ember_preprocess_request returned a str; it must "
                                          r"return a request dict or None$"):
        host.preprocess_request({"prompt": "hi"}, manifest)


def test_hook_ember_postprocess_output(use_plugins, make_package) -> None:
    use_plugins("redact")
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_postprocess_output(output, request, manifest):\n"
                      "    return {**output, 'text': output['text'].strip()}\n")
    manifest, host = load_package(pkg)
    out = host.postprocess_output({"text": "  mail bob@example.com now  ", "finish_reason": "stop"}, {},
                                  manifest)
    assert out == {"text": "mail [email] now", "finish_reason": "stop"}  # both implementations chained


def test_hook_ember_postprocess_output_holds_a_stream_back_to_rewrite_it_whole(make_package) -> None:
    pkg = write_hooks(make_package(), "from ember import hookimpl\n\n@hookimpl\n"
                      "def ember_postprocess_output(output, request, manifest):\n"
                      "    return {**output, 'text': output['text'].upper() + str(len(output['token_ids'])),\n"
                      "            'finish_reason': 'content_filter'}\n")
    manifest, host = load_package(pkg)
    pipeline = host.output_pipeline({}, manifest, stream=True)
    assert pipeline is not None and pipeline.buffers
    assert [pipeline.feed(piece) for piece in ("secret ", "stays ", "in")] == ["", "", ""]  # nothing leaks early
    assert pipeline.finish("length", [7, 8, 9]) == ("SECRET STAYS IN3", "content_filter")


def test_hook_ember_postprocess_stream(use_plugins, make_package) -> None:
    use_plugins("redact")  # README plugin: its filter holds back what may still grow into an address
    manifest, host = load_package(make_package())
    text = "mail bob@example.com, or ann.lee+x@mail.test-site.org!\nnot@me"
    expected = "mail [email], or [email]!\nnot@me"
    assert host.postprocess_output({"text": text, "finish_reason": "stop"}, {}, manifest)["text"] == expected
    for size in range(1, len(text) + 1):  # every way of cutting the text into pieces of one size
        pipeline = host.output_pipeline({}, manifest, stream=True)
        assert pipeline is not None and not pipeline.buffers
        sent = [pipeline.feed(text[i:i + size]) for i in range(0, len(text), size)]
        tail, reason = pipeline.finish("length")
        assert "".join(sent) + tail == expected and reason == "length", size
        assert not any(secret in piece for piece in sent for secret in ("bob", "ann.lee", "example.com"))


def test_every_hook_has_a_test() -> None:
    tests = "\n".join(p.read_text() for p in (REPO_ROOT / "tests").rglob("test_*.py"))
    missing = [h for h in PluginHost.hook_names() if f"def test_hook_{h}(" not in tests]
    assert not missing, f"hook specs without a test_hook_<name> test: {missing}"


def test_every_hook_is_documented() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    for name in PluginHost.hook_names():
        assert name in readme, f"{name} is not in README.md"
        spec = getattr(__import__("ember.hookspecs", fromlist=["x"]), name)
        assert spec.__doc__ and spec.__doc__.strip(), f"{name} has no docstring"


def test_selection_dataclass_is_public() -> None:
    assert Selection("x").options == {}
