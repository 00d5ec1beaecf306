"""The gateway: OpenAI-compatible HTTP in front of the replicas (request models, error objects, response building)."""
