"""Router scorers: KV-prefix overlap, replica load, LoRA adapter residency."""

from ember import hookimpl


@hookimpl
def ember_routing_scorers(register) -> None:
    register("prefix", "ember_plugins.routing.scorers:PrefixScorer",
             summary="cost = prompt tokens the replica must prefill: those past its longest cached block prefix")
    register("load", "ember_plugins.routing.scorers:LoadScorer",
             summary="cost per request in flight, far more per request that would queue, and for missing KV blocks")
    register("lora", "ember_plugins.routing.scorers:LoraScorer",
             summary="no cost where the request's adapter is resident, its load time where it must be loaded")
