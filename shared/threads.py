"""CPU seconds by thread of this process, for a server's /stats (step26 on: the front end's and the engine core's)."""
from __future__ import annotations

import os
import threading


def threads_cpu_s() -> dict[str, float]:
    """This process's CPU seconds by thread (Linux: /proc/self/task): a Python thread by its name, the others (torch's
    and OpenMP's pools, ZMQ's, CUDA's) by the kernel's name for them, those of one name added up. {} elsewhere."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick, seconds = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid), comm)
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return seconds
