"""The engine that runs inside every replica: continuous batching over a paged KV cache."""
