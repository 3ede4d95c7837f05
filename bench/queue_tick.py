"""What the service's scheduling pass costs with many jobs queued: the CPU of one `tick()`.

`ember serve` runs its scheduler's tick 10 times a second (ember.sched.service.TICK_SECONDS): it
reads the queued and live jobs from the ledger, how long each has waited, the owner's rules and
holds, and decides what starts. That CPU is taken from the training on the same machine, queue
or no queue. This builds the service's real parts in a temporary folder (ledger, queue,
dispatcher, as tests/sched/test_job_control.py does), queues N jobs whose request holds a real
resolved recipe (examples/smollm2-lora.toml: ~2 KB of JSON, as `ember submit` stores it) and
that never fit the simulated devices (so nothing starts), a third of them back from a preemption,
and times `tick()`: CPU ms a tick, and the share of one core at 10 ticks a second.

usage: python bench/queue_tick.py [--jobs 10 100 300] [--ticks 50] [--root PATH]
  --root: the ember checkout to measure (default: this one), e.g. a `git worktree` of an older
          commit, for a before/after in one sitting
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--jobs", type=int, nargs="+", default=[10, 100, 300])
parser.add_argument("--ticks", type=int, default=50)
parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
args = parser.parse_args()
sys.path.insert(0, str(args.root.resolve()))
os.environ["EMBER_HOME"] = tempfile.mkdtemp(prefix="queue-tick-home-")

from ember.events import Events  # noqa: E402
from ember.hardware import parse_devices  # noqa: E402
from ember.paths import home  # noqa: E402
from ember.recipe import load_recipe  # noqa: E402
from ember.sched.dispatch import Dispatcher  # noqa: E402
from ember.sched.inference import Gate  # noqa: E402
from ember.sched.job_processes import JobProcesses  # noqa: E402
from ember.sched.job_queue import JobQueue  # noqa: E402
from ember.sched.owner_rules import OwnerRules  # noqa: E402
from ember.sched.owner_watch import OwnerWatch  # noqa: E402
from ember.sched.scheduler import Scheduler  # noqa: E402
from ember.sched.yield_hold import YieldHold  # noqa: E402
from ember.sched.service import TICK_SECONDS  # noqa: E402


def dispatcher(folder: Path, n: int) -> Dispatcher:
    """The service's dispatcher over a fresh ledger with `n` queued jobs that never fit."""
    rules = OwnerRules()
    events = Events(lambda e: None)
    jobs = JobQueue(folder / "ledger.db")
    recipe = args.root / "examples" / "smollm2-lora.toml"
    request = {"memory": 1 << 40, "count": 1, "verdict": "fits", "reasons": [], "max_steps": 60,
               "step_seconds": 1.0, "recipe": load_recipe(recipe, []).to_dict(), "recipe_digest": "0" * 64}
    for i in range(n):
        job = jobs.add(f"sweep-{i}", recipe, folder / "runs" / f"sweep-{i}", [f"optimizer.lr={i}e-5"], i % 3,
                       request)
        if i % 3 == 0:  # back from a preemption: a longer history to read
            for dst in ("starting", "running", "preempting", "queued"):
                job = jobs.move(job, dst, "as the service moves it", **({"pid": None} if dst == "starting" else {}))
    watch = OwnerWatch(rules, events)
    return Dispatcher(jobs, Scheduler(parse_devices("sim:2x1GiB")), JobProcesses(home(), folder / "ledger.db"),
                      watch, YieldHold(home().serve, events), Gate(rules.inference.device,
                                                                   rules.inference.idle_gap_seconds), events)


def main() -> None:
    print(f"ember at {args.root.resolve()}; {args.ticks} ticks per case after 5 warm-up ticks")
    print("| jobs queued | CPU a tick | wall a tick | one core's share at 10 ticks/s |")
    print("| ---: | ---: | ---: | ---: |")
    lock = threading.RLock()
    for n in args.jobs:
        with tempfile.TemporaryDirectory() as tmp:
            d = dispatcher(Path(tmp), n)
            for _ in range(5):
                with lock:
                    d.tick()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.ticks):
                with lock:
                    d.tick()
            cpu = (time.process_time() - c0) / args.ticks
            wall = (time.perf_counter() - t0) / args.ticks
            assert not d.jobs.live(), "a job started: the bench's jobs must never fit"
            print(f"| {n} | {cpu * 1e3:.2f} ms | {wall * 1e3:.2f} ms | {cpu / TICK_SECONDS:.1%} |")


if __name__ == "__main__":
    main()
