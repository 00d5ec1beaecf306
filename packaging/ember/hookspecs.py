"""The hook specifications: the whole contract between Ember, plugins and model packages.

Three groups:

* **Registration** — a plugin declares the techniques it adds by calling `register(name, impl,
  summary=...)`. `impl` is the technique class (or factory), or a "module:attr" string that is
  imported only when the technique is used, so that listing plugins never imports torch.
* **Selection** (`firstresult`) — pick one technique of a kind for a package on this hardware.
  Return a technique name, an `ember.Selection` (name, options, reason), or None to pass. The
  package's `hooks.py` is asked first, then plugins (last registered first), and last the
  manifest's own choice. A hardware-aware plugin should answer only when the manifest says
  "auto" (`manifest.quantization.method == "auto"`, ...), so an explicit choice stands.
* **Lifecycle** — called as a model loads and around every request: its body before tokenizing, its output
  (whole, or streamed through a per-request filter) before it is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ember.hooks import hookspec

if TYPE_CHECKING:
    from ember.hardware import Hardware
    from ember.kernel_ops import RegisterKernelOp
    from ember.manifest import Manifest
    from ember.postprocess import OutputFilter
    from ember.selection import Selection


class Register(Protocol):
    """The callback registration hooks receive.

    `options`: the keys of `[quantization] options`, `[speculator] options` or `[kernels] options` (and of a
    selection's options) that the technique reads; a speculator that reads `[speculator] model` declares "model".
    Any other key is refused when a package is built or loaded, since nothing would read it; a technique that
    declares none takes no options.

    `check`: optional, `check(options, prefix)` (a callable or a "module:attr" string, loaded when a manifest names
    the technique): raises ValueError naming `prefix.key` for an option value the technique cannot take. Ember runs
    it wherever it checks a manifest (`ember explain`, `ember build`, an engine's start), so it must import no
    torch; the technique should run the same function when it is built.
    """

    def __call__(self, name: str, impl: Any, *, summary: str = "", options: Iterable[str] = (),
                 check: Any = None) -> None: ...


# --- registration -------------------------------------------------------------------------


@hookspec
def ember_quantizers(register: Register) -> None:
    """Register quantization techniques (weight-only or weight+activation), e.g. "int8".

    `impl` is a `Quantizer` subclass (`ember_platform.api`), built with the `[quantization] options`: it picks each
    linear layer's `LinearMethod` (create_weights / load_weight / after_loading / apply) before the weights load,
    may compose with others in a declared order, may ask for calibration, and, registered under a config.json
    `quant_method` ("compressed-tensors", "gptq"), loads checkpoints quantized in that layout.
    """


@hookspec
def ember_speculators(register: Register) -> None:
    """Register speculative-decoding proposers, e.g. "ngram", "draft", "eagle".

    `impl` is an `ember_platform.api.Speculator` subclass: each step it gets `SpeculatorInputs` (the step's tokens,
    the hidden states and aux layers it asks for, accepted counts) and returns `Proposal`s.
    """


@hookspec
def ember_attention_backends(register: Register) -> None:
    """Register paged-attention backends, e.g. "torch", "triton", "flashinfer".

    `impl` is a class (`ember_platform.api.AttentionBackend`) the model builds once per distinct attention
    configuration as `cls(layer=AttentionLayerSpec, ops=KernelOps, kv_cache_dtype=..., **options)`; declare the
    `[kernels] options` keys it reads with `register(..., options=(...))`. Its `kv_cache_spec(block_size)` is the
    layout the worker allocates, `kv_cache_dtypes` the `[runtime] kv_cache_dtype` values it stores, and
    `metadata_builder(block_size, device)` the planner the runner calls once per step.
    """


@hookspec
def ember_parallel_strategies(register: Register) -> None:
    """Register ways to spread one replica over several devices, e.g. "tensor", "expert".

    `impl` is an `ember_platform.api.Executor` subclass, built as `cls(worker_config, selection_options)`: it runs
    one `Worker` per rank and executes the engine core's `StepPlan`s ("none" is the in-process uniprocess executor).
    """


@hookspec
def ember_routing_scorers(register: Register) -> None:
    """Register router scorers that rate replicas for a request, e.g. "prefix", "load", "lora".

    `impl` is a class built with the scorer's options from the routing configuration as keyword arguments; its
    `score(request, replicas)` returns one `Score` per replica (`ember_platform.routing.scoring`).
    """


@hookspec
def ember_kernel_ops(register: RegisterKernelOp) -> None:
    """Register implementations of the small ops model code calls: "rms_norm", "silu_and_mul", "rotary",
    "write_kv", "linear" (`ember.kernel_ops` has each op's signature).

    `register(op, impl, *, summary="", priority=0)`: unlike the techniques above, several plugins may implement
    one op. An engine tries them per call in descending priority, then the plain-torch reference; an impl declines
    an input it does not take by returning None (or NotImplemented, or False). An unknown op name is an error.
    """


@hookspec
def ember_launchers(register: Register) -> None:
    """Register launchers: where the control plane runs replicas, e.g. "local" (child processes), "ray".

    `impl` is a factory `(ember.launch.LaunchSettings) -> ember.launch.Launcher`; `ember serve --launcher NAME`
    picks one ("local" by default). A launcher gets a `ReplicaSpec` per replica (registry reference and digest,
    never a local path; resources; role; the secret to hand over) and reports its status (ember/launch.py).
    """


@hookspec
def ember_tool_parsers(register: Register) -> None:
    """Register tool-call parsers, one per model family's call format, e.g. "hermes", "llama3_json", "mistral".

    `impl` is an `ember_platform.api.ToolParser` subclass, built without arguments: its `scan(text, final=...)`
    splits output text into text and calls (the replica builds the `tool_calls` of a response and the streamed
    deltas from it), `grammar(tools, parallel=...)` forces the format for `tool_choice` "required" or a named
    function, and `matches_template(template)` lets a package whose `[chat] tool_parser` is "auto" get it from its
    chat template. A package names its parser with `[chat] tool_parser = "NAME"`.
    """


# --- selection ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def ember_select_quantization(manifest: Manifest, hardware: Hardware,
                              available: frozenset[str]) -> Selection | str | None:
    """Choose the quantization technique ("none" for full precision) for this package and hardware."""


@hookspec(firstresult=True)
def ember_select_speculator(manifest: Manifest, hardware: Hardware,
                            available: frozenset[str]) -> Selection | str | None:
    """Choose the speculator ("none" to decode one token per step)."""


@hookspec(firstresult=True)
def ember_select_attention_backend(manifest: Manifest, hardware: Hardware,
                                   available: frozenset[str]) -> Selection | str | None:
    """Choose the attention backend that runs paged attention on this hardware."""


@hookspec(firstresult=True)
def ember_select_parallelism(manifest: Manifest, hardware: Hardware,
                             available: frozenset[str]) -> Selection | str | None:
    """Choose the parallel strategy ("none" for a single device)."""


# --- lifecycle ----------------------------------------------------------------------------


@hookspec
def ember_model_loaded(manifest: Manifest, model: Any, hardware: Hardware) -> None:
    """Called once per replica after the weights are loaded and techniques applied, before warm-up."""


@hookspec
def ember_preprocess_request(request: dict[str, Any], manifest: Manifest) -> dict[str, Any] | None:
    """Inspect or rewrite a request (an OpenAI-style body) before it is tokenized.

    Return a new request dict to replace it, or None to keep it. Implementations are chained:
    each sees the result of the one called before it.

    Runs in the gateway, before KV-aware routing hashes the prompt, so routing sees the prompt the model
    will see (a prepended system prompt keeps its requests on the replica that holds it). Once per
    request, in a worker thread; the replica then skips it for requests from its gateway (authenticated
    with the replica secret) and runs it for any other. Why not hash the rewritten prompt in the replica
    instead: routing is decided before a replica sees the request, and running the chain twice would
    count, log or randomize twice. A hook that raises fails the request with a 500 naming it.
    """


@hookspec
def ember_postprocess_output(output: dict[str, Any], request: dict[str, Any],
                             manifest: Manifest) -> dict[str, Any] | None:
    """Inspect or rewrite a finished output ({"text", "token_ids", "finish_reason"}) before it is sent.

    Return a new output dict to replace it, or None to keep it; chained like preprocessing. `token_ids` are the
    model's; a changed "finish_reason" must be "stop", "length" or "content_filter"; usage stays the model's.

    Streams too: for a plugin that has no `ember_postprocess_stream` filter for the request, the replica holds the
    whole streamed text back, calls this hook on it at the end, and sends the result as the stream's one content
    chunk before its final chunk (which carries the finish_reason this hook set). So nothing a plugin rewrites
    reaches a client, streamed or not; implement `ember_postprocess_stream` as well to let the text flow.
    """


@hookspec
def ember_postprocess_stream(request: dict[str, Any], manifest: Manifest) -> OutputFilter | None:
    """Return a filter for one request's generated text (`ember.OutputFilter`), or None to pass.

    Called once per choice of every streamed request, and of a non-streamed one when this plugin has no
    `ember_postprocess_output`. The filter's `feed(text)` gets the text in order, in pieces split wherever the
    engine's steps and the stream's events fell (a word, an e-mail address can span pieces), and returns what may be
    sent now; holding text back until it knows (a redaction whose pattern may go on) is how a filter sees text that
    spans chunks. `flush(finish_reason)` comes once after the last piece and returns the rest, or `(rest,
    finish_reason)` to change the finish_reason ("stop", "length" or "content_filter"), which the stream's final
    chunk then carries. Filters are chained in hook order (a package's hooks.py first), each fed what the one before
    it sent. Usage counts stay the model's. A request that asks for logprobs is refused (400) while any output hook
    applies to it, since per-token logprobs would show the text before the hooks rewrote it.
    """
