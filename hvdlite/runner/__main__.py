"""`python -m hvdlite.runner ...` is `hvdlite-run ...`: for a Python whose bin folder holds no
console scripts (hvdlite on PYTHONPATH, not installed)."""
import sys

from hvdlite.runner.launch import main

sys.exit(main())
