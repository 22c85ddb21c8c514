import sys

from mpar.cli import main

sys.exit(main())
