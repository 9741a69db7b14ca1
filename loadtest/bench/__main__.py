"""``python -m loadtest.bench`` (see ``loadtest.bench.cli``)."""

import sys

from loadtest.bench.cli import main

sys.exit(main())
