"""`python -m cgpu_km.daemon`: the daemon (how a hot update re-executes it)."""

import sys

from cgpu_km.daemon.cli import main

sys.exit(main())
