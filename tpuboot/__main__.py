"""Allow ``python -m tpuboot``."""

import sys

from tpuboot.cli import main

sys.exit(main())
