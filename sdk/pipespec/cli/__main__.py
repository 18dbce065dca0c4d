"""``python -m pipespec.cli ...`` = the ``pipespec`` console script (for environments without it on PATH)."""

import sys

from pipespec.cli import main

sys.exit(main())
