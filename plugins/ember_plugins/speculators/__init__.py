"""Speculative-decoding proposers."""

from ember import hookimpl


@hookimpl
def ember_speculators(register) -> None:
    register("ngram", "ember_plugins.speculators.ngram:NgramSpeculator",
             summary="prompt lookup: drafts the tokens that followed the last n tokens' latest earlier occurrence",
             options=("min_ngram", "max_ngram", "adaptive"))
    register("medusa", "ember_plugins.speculators.medusa:MedusaSpeculator",
             summary="Medusa heads on the target's last hidden state draft k tokens at once through its LM head "
                     "(chain verification, or a top-k-per-head tree with options.tree); the heads come from "
                     "[speculator] model",
             options=("model", "tree", "draft_vocab", "native_draft", "native_draft_weights"))
    register("eagle3", "ember_plugins.speculators.eagle3:Eagle3Speculator",
             summary="EAGLE-3: a one-layer draft transformer on the fusion of the target's low, middle and high "
                     "hidden states drafts k tokens autoregressively with its own paged KV cache (a chain, or a "
                     "dynamic tree with options.tree_top_k); the head comes from [speculator] model",
             options=("model", "tree_top_k", "tree_depth", "native_draft", "native_draft_weights"))
    register("draft", "ember_plugins.speculators.draft:DraftSpeculator",
             summary="a small draft model of the target's tokenizer ([speculator] model, a Hugging Face checkpoint) "
                     "drafts k tokens autoregressively with its own paged KV cache, batched across requests",
             options=("model", "native_draft", "native_draft_weights"))
