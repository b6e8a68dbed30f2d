"""Multi-turn chat benchmark: one workload, one client, several OpenAI-compatible servers."""
