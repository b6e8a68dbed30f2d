"""Scale-out benchmarks and the loopback fleet they run on: nginx in front of chatsvc
replicas that share one Redis/Valkey (with Sentinel for failover). See docs/scale-out.md."""
