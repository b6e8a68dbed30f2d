"""The live-server helpers moved to ``bench.live_server`` (benchmarks use them too);
this name stays for tests written against the old path."""

from bench.live_server import ProcessServer, ThreadServer, free_port, wait_until

__all__ = ["ProcessServer", "ThreadServer", "free_port", "wait_until"]
