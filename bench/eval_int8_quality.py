"""int8 quality on the example model: held-out loss through Ember's own model code with and without the `int8`
quantizer (target: within 2%), and greedy agreement over 64 tokens through the engine.

    .venv/bin/python bench/eval_int8_quality.py [--windows N]

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
    args = parser.parse_args()
    torch.set_num_threads(2)
    from tokenizers import Tokenizer

    from ember_platform import LLM, SamplingParams
    from ember_platform.engine.models import build_model
    from ember_platform.engine.models.loader import load_weights
    from ember_plugins.attention.torch_paged import TorchPagedAttention
    from ember_plugins.quantization.int8 import Int8Quantizer

    script = load_example_script()
    tokenizer = Tokenizer.from_file(str(EXAMPLE / "weights" / "tokenizer.json"))
    _, held_out_files = script.training_files()
    windows = script.windows(script.encode_files(tokenizer, held_out_files), SEQ_LEN)
    if args.windows:
        windows = windows[: args.windows]

    model = build_model(EXAMPLE / "weights", TorchPagedAttention, torch.float32)
    load_weights(model, EXAMPLE / "weights")
    full = held_out_loss(model, windows)
    Int8Quantizer({}).quantize(model)
    int8 = held_out_loss(model, windows)

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 4096) for _ in range(rng.randrange(8, 64))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    a = LLM(EXAMPLE).generate(prompts, params)
    b = LLM(EXAMPLE, quantization="int8").generate(prompts, params)
    agree = [sum(x == y for x, y in zip(o.token_ids, q.token_ids, strict=True)) / 64 for o, q in zip(a, b, strict=True)]
    prefix = [next((i for i, (x, y) in enumerate(zip(o.token_ids, q.token_ids, strict=True)) if x != y), 64)
              for o, q in zip(a, b, strict=True)]

    ratio = int8 / full
    print(f"held-out windows: {len(windows)} x {SEQ_LEN} tokens")
    print(f"{'':10} {'loss':>8} {'ppl':>8}")
    print(f"{'full':10} {full:8.6f} {math.exp(full):8.2f}")
    print(f"{'int8':10} {int8:8.6f} {math.exp(int8):8.2f}")
    print(f"int8/full loss ratio {ratio:.4f} (target <= 1.02); greedy agreement over 64 tokens: "
          f"mean {sum(agree) / len(agree):.3f}, identical prefix {sorted(prefix)}")
    record = {"bench": "int8_quality", "ratio": round(ratio, 6), "target": 1.02, "loss_full": round(full, 6),
              "loss_int8": round(int8, 6), "windows": len(windows), "agreement": round(sum(agree) / len(agree), 3),
              "identical_prefix": prefix}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8_quality.json").write_text(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
