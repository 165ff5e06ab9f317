"""Two stdout lines, one stderr line, and a final stdout line without a newline."""
import os
import sys

rank = os.environ["HVDLITE_RANK"]
print(f"out one {rank}")
print(f"out two {rank}")
print(f"err one {rank}", file=sys.stderr)
sys.stdout.write(f"partial {rank}")
sys.stdout.flush()
