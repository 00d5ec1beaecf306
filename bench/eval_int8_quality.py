"""int8 quality on the example model: held-out loss through Ember's own model code with and without the `int8`
quantizer (target: within 2%), and greedy agreement over 64 tokens through the engine, for each int8 kernel
(native and int8pack are weight-only, fbgemm quantizes activations too).

    .venv/bin/python bench/eval_int8_quality.py [--windows N] [--kernels auto,fbgemm,int8pack]

The held-out text is the example's own held-out split (whole stdlib files, examples/make_tiny_llama.py).
Prints a table and a JSON line, also written to bench/results/int8_quality.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama"
SEQ_LEN = 256
BLOCK = 16


def load_example_script():
    spec = importlib.util.spec_from_file_location("make_tiny_llama", ROOT / "examples" / "make_tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executing
    spec.loader.exec_module(module)
    return module


def held_out_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over the windows, one paged prefill per window."""
    from ember_platform.engine.attention import AttentionMetadata
    from ember_platform.engine.engine import kv_cache_shape
    from ember_platform.engine.model_runner import allocate_kv_caches

    config = json.loads((EXAMPLE / "weights" / "config.json").read_text())
    layers, kv_heads, head_dim = kv_cache_shape(config)
    caches = allocate_kv_caches(layers, SEQ_LEN // BLOCK, BLOCK, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata.build([SEQ_LEN], [SEQ_LEN], [list(range(SEQ_LEN // BLOCK))], BLOCK)
    positions = torch.arange(SEQ_LEN)
    total, count = 0.0, 0
    with torch.inference_mode():
        for window in windows:
            meta.scratch.clear()
            hidden = model(window[:-1], positions, meta, caches)
            logits = model.compute_logits(hidden)
            total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
            count += SEQ_LEN
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=0, help="evaluate only the first N windows (0: all)")
    parser.add_argument("--kernels", default="auto,fbgemm,int8pack",
                        help="int8 kernels to evaluate, comma-separated (default auto,fbgemm,int8pack: the one "
                             "the quantizer picks here, usually native, then the others)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from tokenizers import Tokenizer

    from ember_platform import LLM, SamplingParams
    from ember_platform.engine.linear_method import UNQUANTIZED, set_linear_methods
    from ember_platform.engine.models import build_model
    from ember_platform.engine.models.loader import load_weights
    from ember_plugins.attention.torch_paged import TorchPagedAttention
    from ember_plugins.quantization.int8 import Int8Quantizer, resolve_kernel

    script = load_example_script()
    tokenizer = Tokenizer.from_file(str(EXAMPLE / "weights" / "tokenizer.json"))
    _, held_out_files = script.training_files()
    windows = script.windows(script.encode_files(tokenizer, held_out_files), SEQ_LEN)
    if args.windows:
        windows = windows[: args.windows]

    def loaded_model(quantizer=None):
        model = build_model(EXAMPLE / "weights", TorchPagedAttention, torch.float32)
        if quantizer is not None:  # each layer's int8 method, quantizing on load
            set_linear_methods(model, lambda spec: quantizer.linear_method(spec, UNQUANTIZED), torch.float32)
        load_weights(model, EXAMPLE / "weights")
        return model

    full = held_out_loss(loaded_model(), windows)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 4096) for _ in range(rng.randrange(8, 64))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reference = LLM(EXAMPLE).generate(prompts, params)

    kernels = list(dict.fromkeys(resolve_kernel(k, torch.device("cpu")) for k in args.kernels.split(",")))
    results: dict[str, dict[str, object]] = {}
    for kernel in kernels:
        # The dense path off: every row, prefill windows included, goes through the kernel under test.
        options = {"kernel": kernel, "dense_threshold": -1}
        loss = held_out_loss(loaded_model(Int8Quantizer(options)), windows)
        quantized = LLM(EXAMPLE, quantization="int8", quantization_options=options).generate(prompts, params)
        pairs = list(zip(reference, quantized, strict=True))
        agree = [sum(x == y for x, y in zip(o.token_ids, q.token_ids, strict=True)) / 64 for o, q in pairs]
        prefix = [next((i for i, (x, y) in enumerate(zip(o.token_ids, q.token_ids, strict=True)) if x != y), 64)
                  for o, q in pairs]
        results[kernel] = {"loss": round(loss, 6), "ratio": round(loss / full, 6),
                           "agreement": round(sum(agree) / len(agree), 3), "identical_prefix": sorted(prefix)}

    print(f"held-out windows: {len(windows)} x {SEQ_LEN} tokens")
    print(f"{'':10} {'loss':>8} {'ppl':>8} {'/full':>7} {'greedy agreement (64 tokens)':>30}")
    print(f"{'full':10} {full:8.6f} {math.exp(full):8.2f}")
    for kernel, r in results.items():
        loss = float(r["loss"])  # type: ignore[arg-type]
        print(f"{kernel:10} {loss:8.6f} {math.exp(loss):8.2f} {loss / full:7.4f} {r['agreement']:>30} "
              f"(identical prefix {r['identical_prefix']})")
    default = resolve_kernel("auto", torch.device("cpu"))
    main_kernel = default if default in results else next(iter(results))
    main_result = results[main_kernel]
    print(f"int8/full loss ratio ({main_kernel}{', the default kernel' if main_kernel == default else ''}): "
          f"{main_result['ratio']} (target <= 1.02)")
    record = {"bench": "int8_quality", "ratio": main_result["ratio"], "target": 1.02, "default_kernel": default,
              "loss_full": round(full, 6), "windows": len(windows), "kernels": results}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8_quality.json").write_text(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
