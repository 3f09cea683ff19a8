"""``python -m orchestrator.cli`` is ``dtrun``."""

import sys

from orchestrator.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
