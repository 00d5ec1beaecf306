"""Train Medusa heads for `examples/tiny-llama` and write them into its `speculator/medusa/` directory.

    python examples/train_medusa.py [--package examples/tiny-llama] [--heads 4] [--minutes 8] [--quick]

Medusa (Cai et al., 2024) drafts k tokens at once from the target's last hidden state: head i, a residual block
`h + SiLU(W_i h + b_i)` followed by the target's own LM head, predicts the token i + 1 places after the one the
target predicts itself. The target stays frozen: its final (normed) hidden states over the text it was trained on
(the standard library's source, the same files and held-out split as `make_tiny_llama.py`) are computed once, then
only the heads train on them, with cross-entropy against the target's own choices further ahead. Sharing the target's LM
head keeps the heads small (4 x 66k parameters, about 1 MB) and is what the engine does when it runs them.

Run it again after `make_tiny_llama.py` retrains the model: heads fit the weights they were trained on.

Writes `medusa.safetensors` (head weights), `config.json` (shape) and `training.json` (per-head top-1 accuracy on
the held-out files: how often it agrees with the target's own choice, about the acceptance it can reach at
temperature 0). On an idle 2-core machine the
default budget takes about 10 minutes in all. `--quick` trains for a minute into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_llama import encode_files, training_files, windows  # the same corpus and held-out split

SEED = 1234
SEQ_LEN = 256
TRAIN_TOKENS = 262_144  # positions whose hidden states the heads learn from (about 10% of the training text)
HELD_OUT_TOKENS = 32_768
BATCH = 1024
LEARNING_RATE = 2e-3


class MedusaHead(nn.Module):
    """One residual block on the hidden state (the engine's plugin builds the same module to load these)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head i begins as the target's own prediction
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


def hidden_states(model: nn.Module, tokens: torch.Tensor, num_positions: int, seed: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """([N, D] final normed hidden states, [N, S + 1] the windows they came from) for about num_positions positions
    of random SEQ_LEN windows of `tokens`."""
    all_windows = windows(tokens, SEQ_LEN)
    order = torch.randperm(len(all_windows), generator=torch.Generator().manual_seed(seed))
    chosen = all_windows[order[:max(1, num_positions // SEQ_LEN)]]
    states = []
    with torch.no_grad():
        for start in range(0, len(chosen), 8):
            out = model.model(input_ids=chosen[start:start + 8, :SEQ_LEN])
            states.append(out.last_hidden_state)
    return torch.cat(states), chosen


def targets(states: torch.Tensor, lm_head: nn.Module, num_heads: int) -> torch.Tensor:
    """[W, S, heads] the token head i must predict at each position (-100 past the window's end).

    Position t's hidden state gives the target's own guess for token t + 1; head i guesses token t + 2 + i, and a
    draft is accepted when it equals the target's choice there, so the label is that choice (the target's argmax
    at position t + 1 + i: self-distillation, as Medusa-2 does), not the token the text happened to have. Twice the
    acceptance of training on the text's own tokens, on the example model."""
    with torch.no_grad():
        choice = torch.cat([lm_head(chunk).argmax(-1) for chunk in states.split(16)])  # [W, S]
    labels = torch.full((*choice.shape, num_heads), -100, dtype=torch.long)
    for i in range(num_heads):
        labels[:, :SEQ_LEN - 1 - i, i] = choice[:, 1 + i:]
    return labels


def accuracy(heads: nn.ModuleList, lm_head: nn.Module, states: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per head, the share of positions whose top-1 guess is right (among positions with a label)."""
    flat_states, flat_labels = states.reshape(-1, states.shape[-1]), labels.reshape(-1, labels.shape[-1])
    right = [0] * len(heads)
    counted = [0] * len(heads)
    with torch.no_grad():
        for start in range(0, len(flat_states), 4096):
            h = flat_states[start:start + 4096]
            for i, head in enumerate(heads):
                y = flat_labels[start:start + 4096, i]
                keep = y != -100
                guess = lm_head(head(h[keep])).argmax(-1)
                right[i] += int((guess == y[keep]).sum())
                counted[i] += int(keep.sum())
    return [r / max(1, c) for r, c in zip(right, counted, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=Path(__file__).resolve().parent / "tiny-llama")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=6.0, help="training budget after the hidden states")
    parser.add_argument("--quick", action="store_true", help="one minute, into a temporary directory")
    args = parser.parse_args()
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    weights = args.package / "weights"
    out = Path(tempfile.mkdtemp(prefix="medusa-")) if args.quick else args.package / "speculator" / "medusa"
    minutes = 1.0 if args.quick else args.minutes
    model = LlamaForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
    train_files, held_out_files = training_files()
    t0 = time.perf_counter()
    train_states, _ = hidden_states(model, encode_files(tokenizer, train_files), TRAIN_TOKENS, SEED)
    held_states, _ = hidden_states(model, encode_files(tokenizer, held_out_files), HELD_OUT_TOKENS, SEED)
    print(f"hidden states of {train_states.shape[0] * SEQ_LEN:,} + {held_states.shape[0] * SEQ_LEN:,} positions "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    hidden_size = model.config.hidden_size
    lm_head = model.lm_head.requires_grad_(False)
    train_labels, held_labels = targets(train_states, lm_head, args.heads), targets(held_states, lm_head, args.heads)
    heads = nn.ModuleList(MedusaHead(hidden_size) for _ in range(args.heads))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    flat_states = train_states.reshape(-1, hidden_size)
    flat_labels = train_labels.reshape(-1, args.heads)
    generator = torch.Generator().manual_seed(SEED)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < minutes * 60:
        rows = torch.randint(len(flat_states), (BATCH,), generator=generator)
        h, y = flat_states[rows], flat_labels[rows]
        # Later heads are harder and matter less (a draft is used only if all before it were accepted).
        loss = sum(0.8 ** i * nn.functional.cross_entropy(lm_head(head(h)), y[:, i], ignore_index=-100)
                   for i, head in enumerate(heads))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
        if steps % 50 == 0:
            print(f"step {steps}: loss {float(loss.detach()):.3f}", flush=True)
    held_accuracy = accuracy(heads, lm_head, held_states, held_labels)
    print("held-out top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in held_accuracy))

    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"heads.{i}.linear.{name}": p.detach().contiguous() for i, head in enumerate(heads)
               for name, p in head.linear.named_parameters()}
    save_file(tensors, str(out / "medusa.safetensors"))
    config = {"architecture": "medusa", "num_heads": args.heads, "num_layers": 1, "hidden_size": hidden_size,
              "vocab_size": model.config.vocab_size, "uses_target_lm_head": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    training = {"steps": steps, "batch": BATCH, "learning_rate": LEARNING_RATE, "train_positions":
                int(flat_states.shape[0]), "held_out_positions": int(held_states.shape[0] * SEQ_LEN),
                "held_out_top1_accuracy": [round(a, 4) for a in held_accuracy], "torch": torch.__version__}
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
