"""Speculative-decoding proposers."""

from ember import hookimpl


@hookimpl
def ember_speculators(register) -> None:
    register("ngram", "ember_plugins.speculators.ngram:NgramSpeculator",
             summary="prompt lookup: drafts the tokens that followed the last n tokens' latest earlier occurrence",
             options=("min_ngram", "max_ngram", "adaptive"))
