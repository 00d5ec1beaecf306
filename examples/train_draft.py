"""Distil a small draft model from `examples/tiny-llama` and write it into its `speculator/draft/` directory.

    python examples/train_draft.py [--package examples/tiny-llama] [--minutes 9] [--quick]

Draft-target speculation (Leviathan et al. 2023; Chen et al. 2023) runs a small model of the same tokenizer ahead of
the target: it drafts k tokens autoregressively, the target checks them in one pass. The draft is worth what it
agrees with the target, so it learns the target's own distributions (distillation), not the text: the target, frozen,
reads windows of the text it was trained on (the standard library's source, the same files and held-out split as
`make_tiny_llama.py`) once, its top-32 next-token probabilities at every position are kept, and the draft trains
with cross-entropy against them (the soft labels carry the target's argmax, what greedy acceptance needs, and its
spread, what rejection sampling at temperature > 0 accepts in proportion to).

The draft is a Llama in the Hugging Face layout (config.json + model.safetensors + the target's tokenizer files), 2
layers of width 128 (about a fifth of the target's parameters, most of them its embeddings), so the engine runs it
with its own model code. Its embeddings and LM head start as the target's projected on their top 128 principal
directions, which gives it the target's token geometry from the first step.

Run it again after `make_tiny_llama.py` retrains the model: a draft fits the target it was distilled from.

Writes `config.json`, `model.safetensors` (float16), the tokenizer files (copied from the target: the plugin checks
they are the same) and `training.json` (held-out top-1 agreement with the target: how often the draft's greedy choice
is the target's, given the same context; about the acceptance rate at temperature 0). The training budget counts the
training thread's CPU time, so it buys the same training on a busy machine: the committed draft is the default run
(labels 255 s, then 4 CPU minutes, 399 steps; 34 minutes wall on a machine loaded 10-14 deep, under 10 on an idle
2-core one), held-out agreement 0.666. `--quick` trains for a minute into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_llama import cpu_clock, encode_files, training_files, windows  # the same corpus and held-out split

SEED = 1234
SEQ_LEN = 256
TRAIN_TOKENS = 131_072  # positions the target labels (about 5% of the training text)
HELD_OUT_TOKENS = 16_384
PREFIX = 64  # text tokens a generated window starts from (label: `generated`)
GENERATED = 0.0  # share of the training windows continued by the target itself (--generated)
TOP_K = 32  # target probabilities kept per position (the rest of its mass is ~2% on this text)
BATCH = 8  # windows per step
LEARNING_RATE = 3e-3
WIDTH, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 2, 2, 1, 384
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def draft_config(target: dict) -> dict:
    """The draft's config.json: a narrow Llama with the target's vocabulary, special tokens and RoPE."""
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "rms_norm_eps",
            "rope_parameters", "hidden_act", "model_type", "architectures", "dtype")
    config = {key: target[key] for key in keep if key in target}
    config.update(hidden_size=WIDTH, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=WIDTH // HEADS,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    return config


def label(teacher: nn.Module, tokens: torch.Tensor, num_positions: int, seed: int, generated: float = 0.0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(windows [W, S + 1], the target's top-K log-probabilities [W, S, K] (float16), their ids [W, S, K] (int16))
    for about num_positions positions of random SEQ_LEN windows of `tokens`. A `generated` share of the windows
    keeps only its first PREFIX tokens and continues them with the target's own greedy output (`continue_greedy`)."""
    all_windows = windows(tokens, SEQ_LEN)
    order = torch.randperm(len(all_windows), generator=torch.Generator().manual_seed(seed))
    chosen = all_windows[order[:max(1, num_positions // SEQ_LEN)]].clone()
    num_generated = round(generated * len(chosen))
    if num_generated:
        chosen[:num_generated] = continue_greedy(teacher, chosen[:num_generated, :PREFIX], SEQ_LEN + 1 - PREFIX)
    values, ids = [], []
    with torch.no_grad():
        for start in range(0, len(chosen), 8):
            logits = teacher(input_ids=chosen[start:start + 8, :SEQ_LEN]).logits.float()
            top = logits.log_softmax(-1).topk(TOP_K, dim=-1)
            values.append(top.values.half())
            ids.append(top.indices.short())
    return chosen, torch.cat(values), torch.cat(ids)


def continue_greedy(teacher: nn.Module, prefixes: torch.Tensor, num_new: int) -> torch.Tensor:
    """prefixes [W, P] followed by the target's greedy continuation of num_new tokens: [W, P + num_new]. What the
    draft meets when it drafts: the target's own output (greedy decoding of code repeats itself, and a draft that
    learned only the text would not have seen those repetitions), EOS included, as with ignore_eos."""
    rows = []
    with torch.no_grad():
        for start in range(0, len(prefixes), 64):
            seq = prefixes[start:start + 64]
            out = teacher(input_ids=seq, use_cache=True)
            for _ in range(num_new):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, token], dim=1)
                if seq.shape[1] == prefixes.shape[1] + num_new:
                    break
                out = teacher(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            rows.append(seq)
    return torch.cat(rows)


def soft_loss(logits: torch.Tensor, top_logprobs: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft's distribution against the target's top-K (renormalized over those K)."""
    p = top_logprobs.float().softmax(-1)
    return -(p * logits.log_softmax(-1).gather(-1, top_ids.long())).sum(-1).mean()


def agreement(draft: nn.Module, chosen: torch.Tensor, top_ids: torch.Tensor, skip: int = 0) -> float:
    """Share of positions (past the first `skip` of each window) where the draft's argmax is the target's."""
    right = total = 0
    with torch.no_grad():
        for start in range(0, len(chosen), 8):
            guess = draft(input_ids=chosen[start:start + 8, :SEQ_LEN]).logits.argmax(-1)[:, skip:]
            right += int((guess == top_ids[start:start + 8, skip:, 0].long()).sum())
            total += guess.numel()
    return right / max(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=Path(__file__).resolve().parent / "tiny-llama")
    parser.add_argument("--minutes", type=float, default=4.0,
                        help="training budget after the target's labels, in CPU minutes of the training thread (on "
                             "a busy machine or under nice it takes longer, for the same training)")
    parser.add_argument("--generated", type=float, default=GENERATED,
                        help=f"share of the training windows whose text after their first {PREFIX} tokens is the "
                             "target's own greedy continuation (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the draft (default: the package's speculator/draft)")
    parser.add_argument("--quick", action="store_true", help="one minute on fewer positions, into a temporary dir")
    args = parser.parse_args()
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    weights = args.package / "weights"
    if not 0.0 <= args.generated <= 1.0:
        raise SystemExit(f"--generated {args.generated}: a share, between 0 and 1")
    out = args.out or (Path(tempfile.mkdtemp(prefix="draft-")) if args.quick else args.package / "speculator" / "draft")
    minutes = 1.0 if args.quick else args.minutes
    train_positions = TRAIN_TOKENS // 8 if args.quick else TRAIN_TOKENS
    teacher = LlamaForCausalLM.from_pretrained(weights, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
    train_files, held_out_files = training_files()
    t0 = time.perf_counter()
    train = label(teacher, encode_files(tokenizer, train_files), train_positions, SEED, args.generated)
    held_out_tokens = encode_files(tokenizer, held_out_files)
    held = label(teacher, held_out_tokens, HELD_OUT_TOKENS, SEED)
    # The held-out text continued by the target: about the contexts the bench's greedy requests draft in.
    held_generated = label(teacher, held_out_tokens, HELD_OUT_TOKENS // 2, SEED + 1, 1.0)
    label_s = time.perf_counter() - t0
    print(f"target's top-{TOP_K} on {train[0].shape[0] * SEQ_LEN:,} + {held[0].shape[0] * SEQ_LEN:,} positions "
          f"in {label_s:.0f} s", flush=True)

    config = draft_config(json.loads((weights / "config.json").read_text()))
    draft = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    with torch.no_grad():  # the target's embeddings and LM head on their top WIDTH principal directions
        _, _, vh = torch.linalg.svd(teacher.model.embed_tokens.weight, full_matrices=False)
        basis = vh[:WIDTH].t()  # [D_target, WIDTH]
        draft.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight @ basis)
        draft.lm_head.weight.copy_(teacher.lm_head.weight @ basis)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    chosen, top_logprobs, top_ids = train
    generator = torch.Generator().manual_seed(SEED)
    steps, started, cpu_started, budget = 0, time.perf_counter(), cpu_clock(), minutes * 60
    while (elapsed := cpu_clock() - cpu_started) < budget:
        for group in optimizer.param_groups:  # warm up for 20 steps, then cosine over the time budget
            group["lr"] = LEARNING_RATE * min(1.0, (steps + 1) / 20) * 0.5 * (1 + torch.cos(
                torch.tensor(torch.pi * elapsed / budget)).item())
        rows = torch.randint(len(chosen), (BATCH,), generator=generator)
        logits = draft(input_ids=chosen[rows, :SEQ_LEN]).logits
        loss = soft_loss(logits, top_logprobs[rows], top_ids[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        steps += 1
        if steps % 20 == 0:
            print(f"step {steps} ({elapsed:.0f} s): loss {float(loss.detach()):.3f}", flush=True)
    draft.eval()
    held_agreement = agreement(draft, held[0], held[2])
    train_agreement = agreement(draft, chosen[:128], top_ids[:128])
    print(f"top-1 agreement with the target: held out {held_agreement:.3f}, train {train_agreement:.3f}")

    out.mkdir(parents=True, exist_ok=True)
    # Stored in float16 (half the bytes: the example package stays under 25 MiB); the engine runs it in the target's
    # dtype. The agreement below is measured on the stored weights.
    held_agreement_fp32 = held_agreement
    draft.half().float()
    held_agreement = agreement(draft, held[0], held[2])
    generated_agreement = agreement(draft, held_generated[0], held_generated[2], PREFIX)
    print(f"top-1 agreement of the float16 weights: held out {held_agreement:.3f}, on the target's greedy "
          f"continuations of held-out text {generated_agreement:.3f}")
    save_file({name: p.detach().half().contiguous() for name, p in draft.state_dict().items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float16"}, indent=2) + "\n")
    for name in TOKENIZER_FILES:  # the target's own: the plugin refuses a draft whose tokenizer differs
        if (weights / name).is_file():
            shutil.copyfile(weights / name, out / name)
    training = {"steps": steps, "batch_windows": BATCH, "seq_len": SEQ_LEN, "learning_rate": LEARNING_RATE,
                "train_positions": int(chosen.numel() - len(chosen)), "held_out_positions": int(held[0].shape[0] *
                                                                                                 SEQ_LEN),
                "target_top_k": TOP_K, "held_out_top1_agreement": round(held_agreement, 4),
                "generated_share": args.generated, "generated_prefix": PREFIX,
                "held_out_greedy_continuation_top1_agreement": round(generated_agreement, 4),
                "held_out_top1_agreement_fp32": round(held_agreement_fp32, 4), "stored_dtype": "float16",
                "train_top1_agreement": round(train_agreement, 4), "label_seconds": round(label_s),
                "train_seconds": round(time.perf_counter() - started), "train_cpu_seconds": round(elapsed),
                "parameters": sum(p.numel() for p in draft.parameters()), "torch": torch.__version__}
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
