"""Drafters: the ABC and registry (base), one module per method; ``loading`` builds one from --drafter."""

# importing a drafter module registers its name; the others are imported by eyas.drafters.loading
from eyas.drafters import hybrid  # noqa: F401
