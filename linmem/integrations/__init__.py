"""Bridges to interpretability libraries that need to be told a model's layout (optional; each imports its library
only when used)."""
