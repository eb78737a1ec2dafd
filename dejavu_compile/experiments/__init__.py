"""Quality experiments behind benchmarks/: hook-based selection policies, the SmolLM2 harness."""
