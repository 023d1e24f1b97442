"""``python -m tools.bench``: the harness's command line (``tools.bench.harness``)."""

import sys

from tools.bench.harness import main

sys.exit(main())
