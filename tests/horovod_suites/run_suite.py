"""One rank of a Horovod suite: `python run_suite.py <pytest arguments>` (pytest's own main, run
as a script because the launcher starts scripts)."""
import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[1:]))
