"""Output post-processing chains (ember/postprocess.py) built by the plugin host from real hook implementations."""

from __future__ import annotations

import pytest

from ember import hookimpl
from ember.manifest import load_manifest
from ember.plugins import PluginHost
from ember.postprocess import OutputHookError


class Upper:
    """A filter that sends each piece at once, upper-cased, and ends with a marker."""

    def feed(self, text: str) -> str:
        return text.upper()

    def flush(self, finish_reason: str) -> str:
        return f"<{finish_reason}>"


class StreamPlugin:
    @hookimpl
    def ember_postprocess_stream(self, request, manifest):
        return None if request.get("skip") else Upper()


class WholePlugin:
    @hookimpl
    def ember_postprocess_output(self, output, request, manifest):
        return {**output, "text": f"[{output['text']}]"}


class BothPlugin(StreamPlugin, WholePlugin):
    pass


def host_with(*plugins: object) -> PluginHost:
    host = PluginHost(entry_points=False)
    for index, plugin in enumerate(plugins):
        host.register(plugin, f"p{index}")
    return host


@pytest.fixture
def manifest(make_package):
    return load_manifest(make_package())


def run_stream(host: PluginHost, manifest, pieces: list[str], request: dict | None = None,
               finish_reason: str = "stop") -> tuple[list[str], str, str]:
    pipeline = host.output_pipeline(request or {}, manifest, stream=True)
    assert pipeline is not None
    sent = [pipeline.feed(piece) for piece in pieces]
    tail, reason = pipeline.finish(finish_reason, [1, 2])
    return sent, tail, reason


def test_no_output_hooks_means_no_pipeline(manifest) -> None:
    assert host_with().output_pipeline({}, manifest, stream=True) is None


def test_chain_runs_last_registered_first_each_fed_what_the_one_before_sent(manifest) -> None:
    host = host_with(WholePlugin(), StreamPlugin())  # p1 (the filter) is called first, then p0 holds it all back
    sent, tail, reason = run_stream(host, manifest, ["ab", "c"])
    assert sent == ["", ""] and (tail, reason) == ("[ABC<stop>]", "stop")
    host = host_with(StreamPlugin(), WholePlugin())  # the whole-output hook first: the filter sees it at the end
    assert run_stream(host, manifest, ["ab", "c"])[1] == "[ABC]<stop>"


def test_a_plugin_with_both_hooks_streams_through_its_filter_and_answers_whole_outputs_with_the_other(
        manifest) -> None:
    host = host_with(BothPlugin())
    assert run_stream(host, manifest, ["ab", "c"]) == (["AB", "C"], "<stop>", "stop")
    assert host.postprocess_output({"text": "abc", "finish_reason": "length"}, {}, manifest)["text"] == "[abc]"
    # no filter for this request: its whole-output hook still applies, holding the stream back
    assert run_stream(host, manifest, ["ab", "c"], {"skip": True}) == (["", ""], "[abc]", "stop")


def test_a_filter_may_change_the_finish_reason_to_one_openai_knows(manifest) -> None:
    class Cut:
        def feed(self, text):
            return ""

        def flush(self, finish_reason):
            return "", "content_filter"

    class Plugin:
        @hookimpl
        def ember_postprocess_stream(self, request, manifest):
            return Cut()

    assert run_stream(host_with(Plugin()), manifest, ["x"]) == ([""], "", "content_filter")

    class Wrong(Cut):
        def flush(self, finish_reason):
            return "", "because"

    Plugin.ember_postprocess_stream = hookimpl(lambda self, request, manifest: Wrong())
    with pytest.raises(OutputHookError, match=r"plugin 'p0': changed finish_reason to 'because': it must be one of "
                                              r"stop, length, content_filter"):
        run_stream(host_with(Plugin()), manifest, ["x"])


def test_filter_errors_and_contract_breaks_name_the_plugin(manifest) -> None:
    class Broken:
        def feed(self, text):
            raise KeyError("boom")

        def flush(self, finish_reason):
            return 3

    class Plugin:
        @hookimpl
        def ember_postprocess_stream(self, request, manifest):
            return Broken()

    pipeline = host_with(Plugin()).output_pipeline({}, manifest, stream=True)
    with pytest.raises(OutputHookError, match=r"plugin 'p0': its output filter's feed\(\) raised KeyError") as info:
        pipeline.feed("x")
    assert info.value.plugin == "plugin 'p0'"
    with pytest.raises(OutputHookError, match=r"flush\(\) returned int, not the text still held back"):
        pipeline.finish("stop")

    class NotAFilter:
        @hookimpl
        def ember_postprocess_stream(self, request, manifest):
            return "redact"

    with pytest.raises(OutputHookError, match=r"plugin 'p0': ember_postprocess_stream returned 'str', which has no "
                                              r"feed\(text\) and flush\(finish_reason\) methods"):
        host_with(NotAFilter()).output_pipeline({}, manifest, stream=True)


def test_each_pipeline_has_its_own_filter_state(manifest) -> None:
    class Count:
        def __init__(self):
            self.seen = 0

        def feed(self, text):
            self.seen += len(text)
            return ""

        def flush(self, finish_reason):
            return str(self.seen)

    class Plugin:
        @hookimpl
        def ember_postprocess_stream(self, request, manifest):
            return Count()

    host = host_with(Plugin())
    first, second = (host.output_pipeline({}, manifest, stream=True) for _ in range(2))
    first.feed("abc")
    second.feed("de")
    assert first.finish("stop") == ("3", "stop") and second.finish("stop") == ("2", "stop")
