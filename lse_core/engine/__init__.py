"""The engine: sequences, KV slots, the scheduler (continuous batching), the runner and the step loop."""
