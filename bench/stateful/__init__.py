"""Benchmarks of the stateful OpenAI APIs (Responses) against resending history."""
