"""Run every benchmark in turn and print its figures (nothing is asserted)."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in ("loop_overhead.py", "accounting.py", "breakdown_overhead.py", "checkpoint.py",
               "async_checkpoint.py", "stop_latency.py", "resume.py", "plan_accuracy.py", "fit_check.py", "chunked_loss.py",
               "optimizer_state.py",
               "doctor_accuracy.py", "fault_goodput.py", "serve_colocation.py", "coserve_light.py", "coserve.py",
               "distributed.py", "pipeline_memory.py", "dashboard.py",
               "remote.py", "startup.py", "restart.py", "crash_soak.py"):
    print(f"\n=== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
