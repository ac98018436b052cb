"""Drafter heads trained by eyas and shipped with the package (recipes: docs/heads.md)."""
