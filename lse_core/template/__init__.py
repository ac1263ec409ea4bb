"""Chat templates: sandboxed rendering, the thinking-level probe, request resolution and the reasoning split."""
