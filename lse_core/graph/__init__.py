"""The op graph: ir (ops, nodes, the step), fuse (fused groups), plan (placement on the pool)."""
