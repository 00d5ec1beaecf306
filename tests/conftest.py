"""Fixtures shared by every test tree."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def write_tiny_package(root: Path, name: str = "tiny", version: str = "0.1.0", extra_toml: str = "",
                       seed: int = 0) -> Path:
    """A small but well-formed package: manifest, config.json and one safetensors file.

    Written with numpy so that tests of the torch-free base install need no torch.
    """
    from safetensors.numpy import save_file

    weights = root / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((32, 16), dtype=np.float32)},
              str(weights / "model.safetensors"))
    (root / "ember.toml").write_text(f'[model]\nname = "{name}"\nversion = "{version}"\n{extra_toml}')
    return root


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """make_package(name="tiny", version="0.1.0", extra_toml="", subdir=None) -> package dir."""
    counter = iter(range(1_000_000))

    def make(name: str = "tiny", version: str = "0.1.0", extra_toml: str = "", subdir: str | None = None,
             seed: int = 0) -> Path:
        root = tmp_path / (subdir or f"pkg{next(counter)}")
        return write_tiny_package(root, name, version, extra_toml, seed)

    return make
