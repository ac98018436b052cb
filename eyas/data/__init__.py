"""Self-distillation data: the target regenerates answers for prompt sets."""
