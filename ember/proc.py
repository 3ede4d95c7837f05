"""When this process started: the start of an attempt's wall-clock, imports included."""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """Unix time at which the kernel started this process (Linux /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Age from two boot-relative clocks (10 ms resolution); btime would be whole seconds.
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()
