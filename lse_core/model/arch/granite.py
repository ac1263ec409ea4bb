"""IBM Granite 3.x: llama's decoder with four multipliers from config.json (embedding, attention scale,
residual, logits), which llama.ModelArgs reads."""

from lse_core.model.arch.llama import build

__all__ = ["build"]
