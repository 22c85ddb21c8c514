"""``python -m mpar.launch ...``: the same as ``mpar launch ...``."""

import sys

from mpar.launch import main

sys.exit(main(prog="python -m mpar.launch"))
