"""`python -m tierzero.cli ...` (what torchrun launches)."""

import sys

from tierzero.cli import main

sys.exit(main())
