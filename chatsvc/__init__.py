"""chatsvc: a multi-turn chat service with a paged, prefix-caching KV cache."""

__version__ = "0.1.0"
