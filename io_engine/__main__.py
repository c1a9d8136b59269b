"""`python -m io_engine --dir DIR [--size 1GiB] [--json]`: the IO benchmark (see io_engine.bench)."""

import sys

from .bench import main

sys.exit(main(prog="python -m io_engine"))
