"""Every rank starts a child process, reports both pids, and sleeps. With `ignore-term`,
rank 1 ignores SIGTERM so the launcher has to escalate to SIGKILL."""
import os
import signal
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
if "ignore-term" in sys.argv[1:] and os.environ["HVDLITE_RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"ready pid={os.getpid()} child={child.pid}", flush=True)
time.sleep(60)
