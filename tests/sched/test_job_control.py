"""The hand's verbs alone (ember.sched.job_control.JobControl), without HTTP and without the
service's scheduler thread: a real ledger, queue, dispatcher and control folders in a temporary
folder; a verb's own scheduling pass is the only one. Each verb's transition, its preemption of a
live job (a `sleep` this test starts stands for the job's process; a PausePoint thread for its
training loop), and each refusal with its exact error class, changing nothing. Queued jobs here
ask for more memory than the simulated devices have, so no pass ever starts an `ember run`."""

import signal
import threading
import time
from pathlib import Path

import pytest

from ember.control import PausePoint
from ember.errors import BadInput, Conflict, EmberError, NotFound, Refused
from ember.events import Events
from ember.hardware import parse_devices
from ember.ledger import job_rows as rows
from ember.paths import home
from ember.sched import process
from ember.sched.dispatch import Dispatcher
from ember.sched.inference import Gate
from ember.sched.job_control import JobControl
from ember.sched.job_processes import JobProcesses
from ember.sched.job_queue import JobQueue
from ember.sched.owner_rules import OwnerRules
from ember.sched.owner_watch import OwnerWatch
from ember.sched.scheduler import Scheduler
from ember.sched.yield_hold import YieldHold
from tests.helpers import write_recipe

NEVER_FITS = {"memory": 4 << 30, "max_steps": 4}  # the devices below have 1 GiB: admission never starts it


class Hand:
    """A JobControl over real parts in `tmp`, the events it said, and the processes this test started."""

    def __init__(self, tmp: Path, devices: str = "sim:2x1GiB", jobs: JobQueue | None = None):
        self.tmp, self.said, self.sleepers = tmp, [], []
        rules = OwnerRules()
        rules.service.allowed = [str(tmp / "allowed")]
        events = Events(lambda e: self.said.append(e.message))
        self.jobs = jobs or JobQueue(tmp / "ledger.db")
        self.processes = JobProcesses(home(), tmp / "ledger.db")
        watch = OwnerWatch(rules, events)
        self.dispatch = Dispatcher(self.jobs, Scheduler(parse_devices(devices)), self.processes, watch,
                                   YieldHold(home().serve, events),
                                   Gate(rules.inference.device, rules.inference.idle_gap_seconds), events)
        self.control = JobControl(self.jobs, self.processes, self.dispatch, watch, threading.RLock(), events)

    def queued(self, name: str, recipe: Path | None = None, request: dict = NEVER_FITS):
        return self.jobs.add(name, recipe or self.tmp / "allowed" / "r.toml", self.tmp / "allowed" / "runs" / name, [], 0,
                             request)

    def running(self, name: str):
        """A job in state running whose process is a `sleep` this test started (and stops)."""
        s = process.spawn(["sleep", "60"], self.tmp / f"{name}.log", {})
        self.sleepers.append(s)
        job = self.jobs.move(self.queued(name), "starting", "admitted", pid=s.pid, pid_start=s.start, devices=[0],
                             started=time.time())
        return self.jobs.move(job, "running", "first step done"), s

    def finished(self, name: str, state: str):
        job = self.queued(name)
        if state == "cancelled":
            return self.jobs.move(job, "cancelled", "cancelled by hand")
        job = self.jobs.move(job, "starting", "admitted", pid=None)
        return self.jobs.move(job, state, "ended", **({"cause": "exit 1"} if state == "failed" else {}))

    def tick(self) -> None:
        with self.control.lock:
            self.dispatch.tick()

    def whys(self, job) -> list[str]:
        return [t["why"] for t in rows.transitions(self.jobs.con, job.id)]


@pytest.fixture
def hand(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "r.toml").write_text("")
    h = Hand(tmp_path)
    yield h
    for s in h.sleepers:
        if s.popen.poll() is None:
            s.popen.kill()
            s.popen.wait()


def refused(cls: type, match: str, verb, *args) -> None:
    """`verb(*args)` raises exactly `cls` (not a subclass, not its base), saying `match`."""
    with pytest.raises(EmberError, match=match) as e:
        verb(*args)
    assert type(e.value) is cls, (type(e.value).__name__, str(e.value))


def test_a_queued_job_paused_is_held_and_resume_lifts_the_hold(hand):
    job = hand.queued("a")
    held = hand.control.pause("a", False)  # a queued job has nothing to soft-pause: held at once
    assert (held.state, held.hold, held.pause) == ("queued", "user", None)
    assert hand.control.find(str(job.id)) == held
    back = hand.control.resume("a")
    assert (back.state, back.hold, back.pause) == ("queued", None, None)
    again = hand.control.resume("a")  # nobody holds it: nothing changes (not even the row's time)
    # Queued all along, but the hold and its lifting are transitions (ageing skips the time held).
    assert again == back and hand.whys(job) == ["submitted", "held by hand", "resumed by hand"]


def test_a_soft_pause_is_answered_once_the_loop_acknowledged_it_and_resume_once_it_went_on(hand):
    job, sleeper = hand.running("a")
    stop = threading.Event()
    point = PausePoint(hand.processes.ctl(job), stop.is_set, lambda: None)  # the job's training loop

    def loop() -> None:
        while not stop.is_set():
            point.check()
            time.sleep(0.01)
    threading.Thread(target=loop, daemon=True).start()
    try:
        paused = hand.control.pause("a", False)
        assert (paused.state, paused.pause) == ("soft-paused", "user"), paused
        assert hand.processes.acknowledged(job)["state"] == "paused"
        resumed = hand.control.resume("a")
        assert (resumed.state, resumed.pause) == ("running", None), resumed
        assert hand.processes.acknowledged(job)["state"] == "running"
    finally:
        stop.set()
    assert sleeper.popen.poll() is None  # a soft pause keeps the process
    assert hand.whys(job)[-2:] == ["paused (user)", "pause lifted"]  # its acknowledgements, followed


def test_a_hard_pause_preempts_a_live_job_which_stays_queued_and_held_once_it_exited(hand):
    job, sleeper = hand.running("a")
    answered = hand.control.pause("a", True)
    assert answered.hold == "user" and answered.state in ("preempting", "queued"), answered  # queued: it exited
    assert sleeper.popen.wait(timeout=30) == -signal.SIGTERM
    hand.tick()  # the scheduler thread's next pass reaps it
    now = hand.control.find("a")
    assert (now.state, now.hold, now.preemptions, now.pid) == ("queued", "user", 1, None)
    assert "paused by hand (hard)" in hand.whys(job)
    assert "job a: preempting (paused by hand (hard))" in hand.said


def test_cancel_is_at_once_when_queued_and_after_the_checkpoint_when_live(hand):
    queued = hand.queued("q")
    assert hand.control.cancel("q").state == "cancelled" and hand.whys(queued)[-1] == "cancelled by hand"

    job, sleeper = hand.running("live")
    going = hand.control.cancel("live")  # no scheduling pass: answered as it is being cancelled
    assert (going.state, going.hold) == ("preempting", "cancel")
    assert sleeper.popen.wait(timeout=30) == -signal.SIGTERM
    hand.tick()
    assert hand.control.find("live").state == "cancelled"
    assert hand.whys(job)[-1] == "cancelled: checkpointed and exited"

    # One already preempting (for another reason) keeps going, now to be cancelled.
    other = hand.jobs.move(hand.jobs.move(hand.queued("p"), "starting", "admitted", pid=None), "preempting",
                           "preempted by a job of higher priority")
    going = hand.control.cancel("p")
    assert (going.state, going.hold, going.cause) == ("preempting", "cancel", None)
    hand.tick()  # its process is gone: cancelled, not queued again
    assert hand.control.find("p").state == "cancelled"


@pytest.mark.parametrize("state", ["completed", "failed", "cancelled"])
def test_pause_resume_and_cancel_refuse_a_finished_job_and_change_nothing(hand, state):
    job = hand.finished("done", state)
    before = hand.whys(job)
    refused(Conflict, f"^job done is {state}: nothing to pause$", hand.control.pause, "done", False)
    refused(Conflict, f"^job done is {state}: nothing to pause$", hand.control.pause, "done", True)
    hint = "" if state == "completed" else "; `ember requeue done` queues it again"
    refused(Conflict, f"^job done is {state}: nothing to resume{hint}$", hand.control.resume, "done")
    refused(Conflict, f"^job done is already {state}$", hand.control.cancel, "done")
    assert hand.whys(job) == before and hand.control.find("done") == job


def test_every_verb_refuses_a_job_that_does_not_exist(hand):
    for verb, args in ((hand.control.find, ()), (hand.control.pause, (True,)), (hand.control.resume, ()),
                       (hand.control.cancel, ()), (hand.control.requeue, ())):
        refused(NotFound, "no job 'nope'; `ember queue` lists them", verb, "nope", *args)
    refused(NotFound, "no job 'nope'", hand.control.purge, ["nope"], None, None, False)


def test_requeue_queues_a_failed_job_again_and_refuses_what_it_cannot_take_back(hand, tmp_path):
    broke = hand.finished("broke", "failed")
    again = hand.control.requeue("broke")
    assert (again.state, again.hold, again.cause) == ("queued", None, None)
    assert hand.whys(broke)[-1] == "requeued by hand" and "job broke: requeued by hand (queued)" in hand.said
    refused(Conflict, "job broke is queued: only a failed or cancelled job is requeued; `ember resume broke`",
            hand.control.requeue, "broke")
    hand.finished("done", "completed")
    refused(Conflict, "^job done is completed: only a failed or cancelled job is requeued$",
            hand.control.requeue, "done")
    outside = hand.jobs.add("outside", tmp_path / "elsewhere.toml", tmp_path / "allowed" / "runs" / "outside", [], 0,
                            NEVER_FITS)
    hand.jobs.move(outside, "cancelled", "cancelled by hand")
    # The owner may have narrowed [service] allowed since it was queued: checked again.
    refused(Refused, f"recipe {tmp_path / 'elsewhere.toml'} is outside the folders the owner allowed",
            hand.control.requeue, "outside")
    assert hand.control.find("outside").state == "cancelled"


def test_purge_removes_finished_jobs_and_their_files_and_refuses_an_unfinished_one(hand, tmp_path):
    done, broke = hand.finished("done", "completed"), hand.finished("broke", "failed")
    training, _ = hand.running("training")
    for job in (done, broke):
        hand.processes.log_path(job).parent.mkdir(parents=True, exist_ok=True)
        hand.processes.log_path(job).write_text("its output\n")
        hand.processes.ask(job, "user", None)  # its control folder
    (tmp_path / "allowed" / "runs" / "done").mkdir(parents=True)

    assert {j.name for j in hand.control.purge([], None, None, True)} == {"done", "broke"}  # a dry run
    refused(Conflict, "^job training is running: only finished jobs .* nothing was removed. `ember cancel training`",
            hand.control.purge, ["done", "training"], None, None, False)
    refused(BadInput, "^state 'running': only finished jobs", hand.control.purge, [], ["running"], None, False)
    refused(BadInput, "^older than -1 s: must be 0 or more$", hand.control.purge, [], None, -1, False)
    assert {j.name for j in hand.jobs.jobs()} == {"done", "broke", "training"}  # nothing removed yet
    assert hand.said == []

    gone = hand.control.purge([], ["completed"], None, False)
    assert [j.name for j in gone] == ["done"] and hand.said == ["purged 1 finished job(s): done"]
    assert not hand.processes.log_path(done).exists() and not home().job_control(done.id).exists()
    assert (tmp_path / "allowed" / "runs" / "done").is_dir()  # its run folder stays
    assert hand.processes.log_path(broke).exists() and home().job_control(broke.id).is_dir()
    assert [j.name for j in hand.control.purge(["broke"], None, None, False)] == ["broke"]
    assert [j.name for j in hand.jobs.jobs()] == ["training"]
    assert hand.control.purge([], None, None, False) == []


def test_submit_refuses_before_planning_then_queues_once_planned(hand, tmp_path):
    allowed = tmp_path / "allowed"
    recipe = str(write_recipe(allowed / "r", train={"max_steps": 5}))
    refused(BadInput, "^job name '../x': use 1 to 64", hand.control.submit, recipe, "../x", 0, None, [])
    refused(Refused, "is outside the folders the owner allowed", hand.control.submit,
            str(tmp_path / "elsewhere.toml"), None, 0, None, [])
    refused(BadInput, f"^recipe {allowed / 'none.toml'}: no such file$", hand.control.submit,
            str(allowed / "none.toml"), None, 0, None, [])
    refused(BadInput, "^priority 1001: must be between -1000 and 1000$", hand.control.submit,
            recipe, None, 1001, None, [])
    assert hand.jobs.jobs() == [] and hand.jobs.plans == {}  # refused before the plan's child ran

    job = hand.control.submit(recipe, "first", 3, None, [])  # planned in a child, once
    assert (job.state, job.priority, job.out) == ("queued", 3, str(home().runs.resolve() / "first"))
    assert job.request["max_steps"] == 5 and job.request["recipe"]["train"]["max_steps"] == 5
    assert hand.said[0].startswith(f"job {job.id} first: queued (priority 3, ")
    refused(Conflict, "^job name 'first' is taken", hand.control.submit, recipe, "first", 0, None, [])
    second = hand.control.submit(recipe, "second", 0, str(allowed / "runs" / ".." / "runs" / "two"), [])
    assert second.out == str(allowed / "runs" / "two")  # resolved
    refused(Conflict, f"^run folder {second.out} belongs to job second \\(queued\\)", hand.control.submit,
            recipe, "third", 0, second.out, [])
    # The same queue on a machine whose largest device is too small for the plan: never queued.
    tiny = Hand(tmp_path, "sim:1x1MiB", jobs=hand.jobs)
    refused(EmberError, "can never fit here: .* the largest device offers 0.00 GiB; `ember plan` says",
            tiny.control.submit, recipe, "third", 0, None, [])
    assert [j.name for j in hand.jobs.jobs()] == ["first", "second"] and len(hand.jobs.plans) == 1


def test_a_job_name_of_digits_alone_is_refused_before_planning(hand, tmp_path):
    """A job is named by its name or its id, and `--name 2` was queued: `ember cancel 2` then meant
    two jobs (job 2 and the job named '2'), and whichever row came first was cancelled. A name of
    digits alone is refused now, by the service and by `ember submit`'s parser alike."""
    import argparse
    from ember.cli.serve import job_name
    recipe = str(write_recipe(tmp_path / "allowed" / "r", train={"max_steps": 5}))
    refused(BadInput, "^job name '2': digits alone would be read as a job's id", hand.control.submit,
            recipe, "2", 0, None, [])
    assert hand.jobs.jobs() == [] and hand.jobs.plans == {}  # refused before the plan's child ran
    with pytest.raises(argparse.ArgumentTypeError, match="digits alone"):
        job_name("0042")
    assert job_name("run2") == "run2" and job_name("2a") == "2a"


def test_a_job_being_cancelled_is_not_paused_so_the_cancel_holds(hand):
    """`ember cancel a` then `ember pause a --hard` (or a soft pause) while it checkpointed turned the
    cancel into a hand's hold: the job ended queued and held, and the next `ember resume` trained it
    again. A pause of a job being cancelled is refused now, changing nothing, and it ends cancelled."""
    job, sleeper = hand.running("a")
    assert hand.control.cancel("a").hold == "cancel"
    for hard in (True, False):
        refused(Conflict, "^job a is being cancelled", hand.control.pause, "a", hard)
    assert hand.control.find("a").hold == "cancel"
    assert sleeper.popen.wait(timeout=30) == -signal.SIGTERM
    hand.tick()
    assert (hand.control.find("a").state, hand.whys(job)[-1]) == ("cancelled", "cancelled: checkpointed and exited")
