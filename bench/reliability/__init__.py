"""Reliability scripts: crash loop (SIGKILL during streams) and soak (leaks, stability)."""
