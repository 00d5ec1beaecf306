"""The serving engine: scheduler, paged KV cache, model runner, attention API and model code."""
