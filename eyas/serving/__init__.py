"""HTTP serving: OpenAI- and Triton-compatible endpoints around a Speculator (public API only)."""
