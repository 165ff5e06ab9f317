"""A fake tqdm bar: each update starts with \\r and has no newline; before the next update the
rank waits until the test, reading the launcher's output live, acknowledges this one (a file)."""
import os
import sys
import time

ack_dir = sys.argv[1]
for i in range(3):
    sys.stdout.write(f"\rprogress {i}/3")
    sys.stdout.flush()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(ack_dir, f"ack{i}")):
        if time.monotonic() > deadline:
            sys.exit(f"update {i} was not seen by the test within 60 s")
        time.sleep(0.02)
sys.stdout.write("\rprogress 3/3\n")
sys.stdout.flush()
