"""The service's jobs in a temporary ledger (ember.sched.job_queue.JobQueue): names and run folders
that belong to one job, what admission may start, state changes through the state machine,
requeue and purge refusing what they cannot do; the plan's request, planned once per content."""

import dataclasses
import os
from pathlib import Path

import pytest

from ember.errors import BadInput, Conflict, EmberError, NotFound, Refused
from ember.ledger import job_rows as rows
from ember.sched.job_queue import JobQueue
from tests.helpers import write_recipe

REQUEST = {"memory": 1 << 20, "max_steps": 4}


@pytest.fixture
def queue(tmp_path):
    return JobQueue(tmp_path / "ledger.db")


def add(queue: JobQueue, tmp_path: Path, name: str, folder: str | None = None, priority: int = 0):
    return queue.add(name, tmp_path / "r.toml", tmp_path / "runs" / (folder or name), [], priority, REQUEST)


def finish(queue: JobQueue, job, state: str, **fields):
    """Take a queued job to a final state the way the service does, through the state machine."""
    if state == "cancelled":
        return queue.move(job, "cancelled", "cancelled by hand")
    job = queue.move(job, "starting", "admitted", pid=None)
    return queue.move(job, state, "ended", **fields)


def test_a_job_is_found_by_name_or_number_and_a_name_or_folder_belongs_to_one(queue, tmp_path):
    a = add(queue, tmp_path, "a")
    assert queue.find("a") == queue.find(str(a.id)) == a and a.state == "queued"
    with pytest.raises(NotFound, match="no job 'b'"):
        queue.find("b")
    assert queue.name_for(None, tmp_path / "my recipe.toml") == f"my-recipe-{a.id + 1}"
    with pytest.raises(Conflict, match="job name 'a' is taken"):
        queue.name_for("a", tmp_path / "r.toml")
    with pytest.raises(Conflict, match=f"run folder {tmp_path / 'runs' / 'a'} belongs to job a \\(queued\\)"):
        add(queue, tmp_path, "b", folder="a")
    finish(queue, a, "failed", cause="exit 1")
    assert add(queue, tmp_path, "b", folder="a").out == a.out  # a finished job's folder is free again



def test_a_number_finds_the_job_with_that_id_before_a_job_named_so(queue, tmp_path):
    """A job named '2' (id 1) shadowed job 2: `ember cancel 2`, and the queue page's cancel button
    on job 2's row (it posts the id), found the first row matching by name or id and cancelled
    job 1 instead."""
    named, other = add(queue, tmp_path, "2"), add(queue, tmp_path, "x")
    assert (named.id, other.id) == (1, 2)
    assert queue.find("2") == other and queue.find("1") == named and queue.find("x") == other

def test_admission_sees_queued_jobs_without_a_hold_and_live_ones(queue, tmp_path):
    free, held, live = (add(queue, tmp_path, n) for n in ("free", "held", "live"))
    queue.move(held, "queued", "held by hand", hold="user")
    queue.move(live, "starting", "admitted", pid=None)
    assert [j.name for j in queue.queued()] == ["free"]
    assert [j.name for j in queue.live()] == ["live"]
    assert [j.name for j in queue.jobs(("queued",))] == ["free", "held"]


def test_a_move_goes_through_the_state_machine_and_loses_to_a_newer_change(queue, tmp_path):
    job = add(queue, tmp_path, "a")
    with pytest.raises(EmberError, match="cannot go from queued to running"):
        queue.move(job, "running", "skipped a state")
    started = queue.move(job, "starting", "admitted", devices=[1])
    assert (started.state, started.devices) == ("starting", [1])
    assert queue.move(job, "cancelled", "read before it started") is None  # stale row: nothing changed
    assert queue.get(job.id).state == "starting"
    assert [t["to_state"] for t in rows.transitions(queue.con, job.id)] == ["queued", "starting"]


def test_requeue_takes_back_failed_and_cancelled_jobs_only(queue, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("")
    allowed = Path  # every path allowed here

    failed = finish(queue, add(queue, tmp_path, "f"), "failed", cause="exit 1")
    again = queue.requeue(failed, allowed)
    assert (again.state, again.hold, again.cause) == ("queued", None, None)
    with pytest.raises(Conflict, match="job f is queued: only a failed or cancelled job is requeued.*ember resume"):
        queue.requeue(again, allowed)
    done = finish(queue, add(queue, tmp_path, "d"), "completed")
    with pytest.raises(Conflict, match="job d is completed: only a failed or cancelled job is requeued$"):
        queue.requeue(done, allowed)

    cancelled = finish(queue, add(queue, tmp_path, "c"), "cancelled")

    def refuse(path: str) -> Path:
        raise Refused(f"recipe {path} is outside the folders the owner allowed")
    with pytest.raises(Refused):
        queue.requeue(cancelled, refuse)
    recipe.unlink()
    with pytest.raises(NotFound, match="its recipe .* is gone"):
        queue.requeue(cancelled, allowed)
    recipe.write_text("")
    rival = add(queue, tmp_path, "rival", folder="c")
    with pytest.raises(Conflict, match="belongs to job rival \\(queued\\) now"):
        queue.requeue(cancelled, allowed)
    queue.move(rival, "cancelled", "cancelled by hand")
    assert queue.requeue(cancelled, allowed).state == "queued"



def test_a_requeued_job_ages_from_its_requeue_not_from_its_first_submit(queue, tmp_path):
    """A job cancelled a day ago and requeued counted that day as waiting: one priority level per
    ten minutes, +144, so it went before a job of priority 5 submitted now (and the queue turned
    strict behind it, no backfill, at once). Ageing counts from the requeue now."""
    import time
    from ember.sched.admission import Room, Want, decide
    (tmp_path / "r.toml").write_text("")
    cancelled = queue.move(add(queue, tmp_path, "old"), "cancelled", "cancelled by hand",
                           submitted=time.time() - 86400)
    again = queue.requeue(cancelled, Path)
    urgent = add(queue, tmp_path, "urgent", priority=5)
    wants = [Want(j.id, j.priority, j.submitted, j.request["memory"]) for j in (again, urgent)]
    assert decide(wants, [], [Room(0, REQUEST["memory"])], time.time()).start == {urgent.id: (0,)}

def test_a_job_back_from_preemption_ages_by_the_time_it_waited_not_the_time_it_ran(queue, tmp_path):
    """A job submitted an hour ago, started at once and preempted a minute ago counted the hour it
    ran as waiting: +6 priority levels, and the queue turned strict behind it at once, so a small
    job could not take the room left beside the job that preempted it. It ages by its time queued
    now: 10 s before it started and 50 s since it came back."""
    import time
    from ember.hardware import Device
    from ember.sched.scheduler import Scheduler
    now = time.time()
    job = add(queue, tmp_path, "long")
    for dst in ("starting", "running", "preempting", "queued"):
        job = queue.move(job, dst, "as the service moves it", **({"pid": None} if dst == "starting" else {}))
    con = queue.con
    con.execute("UPDATE jobs SET submitted = ? WHERE id = ?", (now - 3600, job.id))
    for to_state, at in (("queued", now - 3600), ("starting", now - 3590), ("running", now - 3580),
                         ("preempting", now - 60), ("queued", now - 50)):
        con.execute("UPDATE job_transitions SET time = ? WHERE rowid = (SELECT min(rowid) FROM job_transitions "
                    "WHERE job_id = ? AND to_state = ? AND time > ?)", (at, job.id, to_state, now - 1))
    con.commit()
    job = queue.get(job.id)
    assert queue.waited(job, now) == pytest.approx(60.0)
    # The job that preempted it holds 6 of 8 MiB; "long" needs 4, a small job 1.
    small = add(queue, tmp_path, "small")
    big = Device(0, "sim:0", "sim", 8 << 20, 8 << 20)
    running = queue.move(queue.move(add(queue, tmp_path, "urgent", priority=5), "starting", "admitted", pid=None,
                                    devices=[0]), "running", "started")
    long_job = dataclasses.replace(job, request={"memory": 4 << 20})
    waiting = [long_job, queue.get(small.id)]
    live = [dataclasses.replace(running, request={"memory": 6 << 20})]
    d = Scheduler((big,)).admit(waiting, live, [], {0: 8 << 20}, now,
                                {j.id: queue.waited(j, now) for j in waiting})
    assert d.start == {small.id: (0,)}, d.waiting  # backfilled beside the others
    assert "no backfill" not in d.waiting.get(small.id, "")


def test_a_job_held_by_hand_does_not_age_while_held(queue, tmp_path):
    """A job queued an hour ago and held by hand for 40 minutes of it counted the hold as waiting:
    +6 priority levels on release, so holding a job of priority 0 and releasing it put it before a
    job of priority 3 submitted a minute ago (the way to raise one's own job that Slurm's age
    factor closes: held jobs do not accrue it). It ages by the 20 minutes it could have started."""
    import time
    from ember.hardware import Device
    from ember.sched.scheduler import Scheduler
    now = time.time()
    job = add(queue, tmp_path, "held")
    job = queue.move(job, "queued", "held by hand", hold="user")
    job = queue.move(job, "queued", "resumed by hand", hold=None)
    assert job.hold is None
    con = queue.con
    con.execute("UPDATE jobs SET submitted = ? WHERE id = ?", (now - 3600, job.id))
    for why, at in (("submitted", now - 3600), ("held by hand", now - 3000), ("resumed by hand", now - 600)):
        con.execute("UPDATE job_transitions SET time = ? WHERE job_id = ? AND why = ?", (at, job.id, why))
    con.commit()
    job = queue.get(job.id)
    assert queue.waited(job, now) == pytest.approx(1200.0)
    urgent = add(queue, tmp_path, "urgent", priority=3)
    con.execute("UPDATE jobs SET submitted = ? WHERE id = ?", (now - 60, urgent.id))
    con.execute("UPDATE job_transitions SET time = ? WHERE job_id = ?", (now - 60, urgent.id))
    con.commit()
    waiting = [job, queue.get(urgent.id)]
    one = Device(0, "sim:0", "sim", 1 << 20, 1 << 20)  # room for one of them
    d = Scheduler((one,)).admit(waiting, [], [], {0: 1 << 20}, now, {j.id: queue.waited(j, now) for j in waiting})
    assert d.start == {urgent.id: (0,)}, d.waiting
    # Held again now: it waits no longer, whatever the time.
    held = queue.move(job, "queued", "held by hand", hold="user")
    assert queue.waited(held, now + 3600) == pytest.approx(queue.waited(held, now + 1), abs=2.0)


def test_every_queued_jobs_wait_is_read_in_one_query_and_is_each_ones_own(queue, tmp_path):
    """The service asks how long each queued job waited at every tick, ten a second: a query per
    job cost a core 13% with 100 jobs queued (bench/queue_tick.py). One query answers for all,
    the same seconds as each job's own, whatever its history (plain, back from a preemption,
    held and released, held now), and the same after its row changes."""
    import time
    now = time.time()
    plain = add(queue, tmp_path, "plain")
    back = add(queue, tmp_path, "back")
    for dst in ("starting", "running", "preempting", "queued"):
        back = queue.move(back, dst, "as the service moves it", **({"pid": None} if dst == "starting" else {}))
    released = queue.move(queue.move(add(queue, tmp_path, "released"), "queued", "held by hand", hold="user"),
                          "queued", "resumed by hand", hold=None)
    held = queue.move(add(queue, tmp_path, "held"), "queued", "held by hand", hold="user")
    jobs = [plain, back, released, held]
    statements = []
    queue.con.set_trace_callback(statements.append)
    try:
        together = queue.waited_all(jobs, now + 30)
    finally:
        queue.con.set_trace_callback(None)
    assert len([q for q in statements if "job_transitions" in q]) == 1, statements
    assert together == {j.id: queue.waited(j, now + 30) for j in jobs}
    assert together[held.id] < together[plain.id] and together[plain.id] == pytest.approx(30, abs=5)
    again = queue.move(plain, "queued", "held by hand", hold="user")  # a changed row is read as changed
    assert queue.get(plain.id) == again and again.hold == "user" and queue.get(plain.id) is not plain


def test_a_job_that_kept_its_admitted_recipe_is_requeued_without_the_file(queue, tmp_path):
    """The job trains the recipe as admitted (its request keeps it, ember.launchspec): a requeue
    does not need the file, which may since have been moved or edited."""
    recipe = write_recipe(tmp_path / "recipe", train={"max_steps": 5})
    job = queue.add("kept", recipe, tmp_path / "runs" / "kept", [], 0, queue.request(recipe, []))
    failed = finish(queue, job, "failed", cause="exit 1")
    recipe.unlink()
    again = queue.requeue(failed, Path)
    assert again.state == "queued" and again.request["recipe"]["train"]["max_steps"] == 5


def test_purge_chooses_finished_jobs_and_refuses_anything_else(queue, tmp_path):
    done = finish(queue, add(queue, tmp_path, "done"), "completed")
    broke = finish(queue, add(queue, tmp_path, "broke"), "failed", cause="exit 1")
    add(queue, tmp_path, "waiting")
    assert {j.name for j in queue.finished([], None, None)} == {"done", "broke"}
    assert [j.name for j in queue.finished([], ["failed"], None)] == ["broke"]
    assert queue.finished([], None, 3600) == []  # none ended an hour ago
    assert [j.name for j in queue.finished(["done", "done"], None, None)] == ["done"]
    with pytest.raises(Conflict, match="job waiting is queued: only finished jobs"):
        queue.finished(["done", "waiting"], None, None)
    with pytest.raises(BadInput, match="state 'running'"):
        queue.finished([], ["running"], None)
    with pytest.raises(BadInput, match="must be 0 or more"):
        queue.finished([], None, -1)
    assert queue.remove(done) and queue.get(done.id) is None
    assert not queue.remove(done)  # gone already
    assert rows.transitions(queue.con, done.id)[-1]["to_state"] == "purged"
    assert queue.get(broke.id).state == "failed"


def test_a_recipe_is_planned_once_per_content_and_overrides(queue, tmp_path):
    recipe = write_recipe(tmp_path / "recipe", train={"max_steps": 5})
    first = queue.request(recipe, [])
    assert first["max_steps"] == 5 and first["memory"] > 0 and first["count"] == 1
    assert queue.request(recipe, []) == first and len(queue.plans) == 1  # not planned again
    changed = queue.request(recipe, ["train.max_steps=7"])
    assert changed["max_steps"] == 7 and len(queue.plans) == 2
    # What the job will train is the recipe as submitted, resolved, overrides applied.
    assert first["recipe"]["train"]["max_steps"] == 5 and changed["recipe"]["train"]["max_steps"] == 7


def test_the_plans_remembered_are_the_newest_few(queue, tmp_path, monkeypatch):
    """Every submit with another `--set` is a recipe of its own, and its plan was kept for the
    service's life: a client trying values grew the service without bound."""
    monkeypatch.setattr("ember.sched.job_queue.PLANS_KEPT", 2, raising=False)
    recipe = write_recipe(tmp_path / "recipe", train={"max_steps": 5})
    for steps in (6, 7, 8):
        assert queue.request(recipe, [f"train.max_steps={steps}"])["max_steps"] == steps
    assert len(queue.plans) == 2
    assert queue.request(recipe, ["train.max_steps=8"])["max_steps"] == 8 and len(queue.plans) == 2


def test_two_submits_of_one_recipe_at_once_both_get_their_request(queue, tmp_path, monkeypatch):
    """Two `ember submit r.toml` at once (the service answers each on its own thread) wrote the
    recipe's snapshot through the same temporary file, named by the process alone: one thread's
    rename took the other's file away, and that submit failed with FileNotFoundError (a 500).
    Here both threads are held after writing their temporary file, before renaming it."""
    import threading
    from ember import durable
    from ember.sched import job_queue
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    plan = {"memory": {"with_margin": 1 << 20}, "verdict": "local", "reasons": [],
            "recipe": {"max_steps": 24}, "time": {"step_seconds": None}}
    monkeypatch.setattr(job_queue, "plan_json", lambda *args: plan)  # no child: the race is in the snapshot
    both_written = threading.Barrier(2, timeout=30)
    real_fsync = durable.os.fsync

    def fsync(fd: int) -> None:  # the file's fsync: each thread has written its temporary file
        real_fsync(fd)
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            both_written.wait()
    monkeypatch.setattr(durable.os, "fsync", fsync)
    recipe = write_recipe(tmp_path / "recipe")
    answers, errors = [], []

    def submit() -> None:
        try:
            answers.append(queue.request(recipe, []))
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=submit) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(answers) == 2 and answers[0] == answers[1]
    (snapshot,) = (tmp_path / "home").glob("serve/recipes/*.toml")
    assert "max_steps = 24" in snapshot.read_text()
