"""Drafter training by self-distillation (EAGLE-3, EAGLE-1, Medusa)."""
