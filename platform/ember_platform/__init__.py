"""The Ember platform: engine, replica runtime, gateway, control plane, routing and KV tiers.

Needs the `serve` extra (torch and friends). The engine arrives with the engine issue.
"""
