"""``python -m gc_moe_compat.ab``: the same as the ``gc-moe-ab`` console script."""

import sys

from gc_moe_compat.ab.cli import main

sys.exit(main())
