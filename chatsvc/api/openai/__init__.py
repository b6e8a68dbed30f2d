"""The OpenAI-compatible API under ``/v1``: chat completions, completions, Responses,
Conversations, models, and vLLM's tokenizer routes; their schemas and views."""
