"""python -m eyas ... (also what `accelerate launch -m eyas train ...` runs)."""

import sys

from eyas.cli import main

sys.exit(main())
