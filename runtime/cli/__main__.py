"""`python -m ortspec.runtime.cli`: the same as the `ortspec` command."""

import sys

from .main import main

sys.exit(main())
