"""What a model family tells weight-transforming techniques (rotations, smoothing) about its wiring.

A rotation folds an orthogonal Q into the weights: every linear that reads the residual stream through a norm
gets W Q (after the norm's scale is folded into it), every linear that writes into the residual stream gets
Q^T W, the embeddings E Q. Doing that needs to know which norm feeds which linears, which linears write the
residual stream, whether the embeddings are tied to the LM head, and where rotary embeddings apply (a rotation
inside the heads must commute with them). Names are module names of the built model (`model.named_modules()`)
or, for stacked expert tensors that are not `Linear` layers, parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NormFeed:
    """A norm and the linears that read its output (their inputs are the normed residual stream)."""

    norm: str
    linears: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AttentionBlock:
    """One attention layer: its fused q/k/v linear (shards "q", "k", "v"), its output linear, and the rotary
    embedding applied to q and k between them (so a transform of q/k's head dimension must commute with it;
    v -> o carries none)."""

    qkv: str
    output: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: bool = True


@dataclass(frozen=True, slots=True)
class ModelStructure:
    """A decoder's wiring, from `model.structure()`."""

    embeddings: str  # the token embedding module, which writes the residual stream
    lm_head: str
    tied_embeddings: bool  # the LM head shares the embedding's weight: a transform of one transforms both
    norm_feeds: tuple[NormFeed, ...]  # in model order; the final norm feeds the LM head
    residual_writers: tuple[str, ...]  # linears whose output is added to the residual stream
    attention: tuple[AttentionBlock, ...]
    hidden_size: int
