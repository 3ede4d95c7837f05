"""The scheduler's decisions over plain inputs (ember.sched.scheduler): which job starts where,
preemption by priority, the owner's holds, hand pauses and inference; how a job's progress and
exit move it. No processes, no files, no ledger."""

from ember.errors import EXIT_INTERRUPTED
from ember.ledger.job_rows import JobRow
from ember.sched.owner_rules import Hold, Observation, OwnerRules
from ember.hardware import Device
from ember.sched.scheduler import (PREEMPT_KILL_SECONDS, Act, Move, Scheduler, capacity, ended, follow,
                                   recovered)

GIB = 2**30
SIM = (Device(0, "sim:0", "sim", 8 * GIB, 8 * GIB), Device(1, "sim:1", "sim", 8 * GIB, 8 * GIB))
HOST = (Device(0, "host RAM", "cpu", 16 * GIB, 16 * GIB),)
NOW = 1_000_000.0


def job(id: int, state: str = "queued", priority: int = 0, memory: int = GIB, devices=(), **kw) -> JobRow:
    fields = dict(id=id, name=f"j{id}", recipe="/r.toml", out=f"/runs/j{id}", overrides=[], priority=priority,
                  state=state, submitted=NOW - 10, updated=NOW - 10, request={"memory": memory},
                  devices=list(devices))
    return JobRow(**{**fields, **kw})


def hold(kind: str, devices=None, accelerators_only: bool = False, rule: str = "rule.key") -> Hold:
    return Hold(rule, kind, devices, accelerators_only, "why it holds")


def steer(s: Scheduler, j: JobRow, holds=(), now: float = NOW, inference_on: int | None = None,
          hard_after_minutes: float = 10.0):
    return s.steer(j, list(holds), now, hard_after_minutes, inference_on)


def test_a_job_with_nothing_against_it_goes_on():
    s = Scheduler(SIM)
    assert steer(s, job(1, "running", devices=[0])).act == Act.GO


def test_a_hard_hold_preempts_naming_the_rule_and_keeps_no_hand_hold():
    got = steer(Scheduler(SIM), job(1, "running", devices=[0]), [hold("soft"), hold("hard", rule="schedule.mon")])
    assert (got.act, got.why, got.hold) == (Act.PREEMPT, "schedule.mon: why it holds", None)


def test_a_hold_on_another_device_or_for_accelerators_on_host_ram_does_not_apply():
    s = Scheduler(SIM)
    assert steer(s, job(1, "running", devices=[0]), [hold("hard", devices=(1,))]).act == Act.GO
    assert steer(s, job(1, "running", devices=[1]), [hold("hard", devices=(1,))]).act == Act.PREEMPT
    host = Scheduler(HOST)
    assert steer(host, job(2, "running", devices=[0]), [hold("soft", accelerators_only=True)]).act == Act.GO
    assert steer(s, job(2, "running", devices=[0]), [hold("soft", accelerators_only=True)]).act == Act.PAUSE


def test_soft_holds_a_hand_pause_and_inference_ask_for_a_soft_pause_in_that_order():
    s = Scheduler(SIM)
    assert steer(s, job(1, "running", devices=[0], pause="user"), [hold("soft")], inference_on=0).reason == "user"
    assert steer(s, job(2, "running", devices=[0]), [hold("soft")], inference_on=0).reason == "owner"
    assert steer(s, job(3, "running", devices=[0]), inference_on=0).reason == "inference"
    assert steer(s, job(4, "running", devices=[1]), inference_on=0).act == Act.GO  # inference is on device 0


def test_a_soft_pause_longer_than_hard_after_minutes_becomes_a_preemption():
    s = Scheduler(SIM)
    by_hand, by_rule = job(1, "soft-paused", devices=[0], pause="user"), job(2, "soft-paused", devices=[1])
    assert steer(s, by_hand, hard_after_minutes=1).act == Act.PAUSE  # the clock starts at the first ask
    assert steer(s, by_rule, [hold("soft")], hard_after_minutes=1).act == Act.PAUSE
    assert steer(s, by_hand, now=NOW + 60, hard_after_minutes=1).act == Act.PAUSE  # not longer yet
    late = steer(s, by_hand, now=NOW + 61, hard_after_minutes=1)
    assert (late.act, late.hold) == (Act.PREEMPT, "user")  # a hand's pause stays held once hard
    assert "hard_after_minutes = 1" in late.why
    late = steer(s, by_rule, [hold("soft")], now=NOW + 61, hard_after_minutes=1)
    assert (late.act, late.hold) == (Act.PREEMPT, None)  # the rule keeps it queued while it holds


def test_an_inference_pause_never_becomes_hard_and_going_on_restarts_the_clock():
    s = Scheduler(SIM)
    j = job(1, "soft-paused", devices=[0])
    assert steer(s, j, inference_on=0, hard_after_minutes=1).act == Act.PAUSE
    assert steer(s, j, now=NOW + 3600, inference_on=0, hard_after_minutes=1).act == Act.PAUSE
    assert steer(s, j, now=NOW + 3601, hard_after_minutes=1).act == Act.GO
    assert 1 not in s.soft_since
    assert steer(s, j, [hold("soft")], now=NOW + 3602, hard_after_minutes=1).act == Act.PAUSE
    assert steer(s, j, [hold("soft")], now=NOW + 3602 + 61, hard_after_minutes=1).act == Act.PREEMPT


def test_a_preempting_job_is_waited_for_then_killed():
    s = Scheduler(SIM)
    j = job(1, "preempting", devices=[0], updated=NOW)
    assert steer(s, j, [hold("hard")], now=NOW + PREEMPT_KILL_SECONDS).act == Act.WAIT
    assert steer(s, j, now=NOW + PREEMPT_KILL_SECONDS + 1).act == Act.KILL


def test_admission_starts_the_higher_priority_job_first_on_the_best_fitting_device():
    s = Scheduler(SIM)
    running = [job(1, "running", priority=0, memory=6 * GIB, devices=[0], started=NOW - 100)]
    queued = [job(2, priority=0, memory=5 * GIB), job(3, priority=5, memory=2 * GIB)]
    d = s.admit(queued, running, [], {0: 8 * GIB, 1: 8 * GIB}, NOW)
    # Job 3 (higher) fits best in device 0's 2 GiB left; job 2 then takes device 1.
    assert d.start == {3: (0,), 2: (1,)} and d.preempt == []


def test_a_higher_priority_job_that_does_not_fit_preempts_the_lowest_and_waits():
    s = Scheduler(SIM[:1])
    running = [job(1, "running", priority=0, memory=6 * GIB, devices=[0], started=NOW - 100),
               job(2, "running", priority=3, memory=2 * GIB, devices=[0], started=NOW - 50)]
    d = s.admit([job(3, priority=5, memory=5 * GIB)], running, [], {0: 8 * GIB}, NOW)
    assert (d.start, d.preempt) == ({}, [1])
    assert s.waiting == {3: "preempting job(s) 1 to make room"}
    d = s.admit([job(4, priority=0, memory=5 * GIB)], running, [], {0: 8 * GIB}, NOW)
    assert (d.start, d.preempt) == ({}, []) and s.waiting[4].startswith("priority:")  # equal priority: no


def test_admission_skips_held_jobs_and_devices_a_hold_blocks():
    s = Scheduler(SIM)
    queued = [job(1, hold="user"), job(2)]
    d = s.admit(queued, [], [hold("soft", devices=(0,))], {0: 8 * GIB, 1: 8 * GIB}, NOW)
    assert d.start == {2: (1,)}
    d = s.admit([job(2)], [], [hold("hard")], {0: 8 * GIB, 1: 8 * GIB}, NOW)
    assert d.start == {} and "the owner's rules hold every device" in s.waiting[2]
    assert s.admit([job(1, hold="user")], [], [], {0: 8 * GIB, 1: 8 * GIB}, NOW).start == {}
    assert s.waiting == {}  # nothing waits for admission: the old reasons are gone


def test_holds_on_a_job_not_yet_placed_count_every_device():
    s = Scheduler(SIM)
    on_one = hold("soft", devices=(1,))
    assert s.holds_on(job(1), [on_one]) == [on_one]
    assert s.holds_on(job(1, "running", devices=[0]), [on_one]) == []


def test_capacity_is_the_owners_ram_share_on_host_ram_and_the_free_memory_of_an_accelerator():
    rules = OwnerRules()
    active = Observation(idle_seconds=5.0, idle_source="test", other_cpu_share=0.0, on_battery=False)
    idle = Observation(idle_seconds=3600.0, idle_source="test", other_cpu_share=0.0, on_battery=False)
    assert capacity(HOST[0], rules, None) == int(16 * GIB * 0.9)
    assert capacity(HOST[0], rules, active) == int(16 * GIB * 0.5)
    assert capacity(HOST[0], rules, idle) == int(16 * GIB * 0.9)
    assert capacity(Device(0, "gpu", "cuda", 24 * GIB, 20 * GIB, foreign=4 * GIB), rules, active) == 20 * GIB


def test_follow_moves_a_job_by_its_first_step_and_its_acknowledgements():
    starting = job(1, "starting", started=NOW)
    assert follow(starting, NOW - 1, None, None) is None  # a step from before it started
    assert follow(starting, NOW + 1, None, None) == Move("running", "first step done")
    running, paused = job(2, "running"), job(3, "soft-paused")
    assert follow(running, NOW, {"state": "running"}, "owner") is None  # asked, not yet taken
    assert follow(running, NOW, {"state": "paused"}, "owner") == Move("soft-paused", "paused (owner)")
    assert follow(paused, NOW, {"state": "paused"}, None) is None
    assert follow(paused, NOW, {"state": "running"}, None) == Move("running", "pause lifted")
    assert follow(job(4, "preempting"), NOW, {"state": "paused"}, "owner") is None


def test_an_exited_job_goes_where_its_exit_says():
    def never() -> str:
        raise AssertionError("a job that did not fail has no failure cause")

    preempting = job(1, "preempting", cause="preempted by a job of higher priority", preemptions=2)
    assert ended(job(1, "running"), 0, True, None, never) == Move("completed", "finished", {"pid": None, "cause": None})
    assert ended(preempting, 75, False, "preempted", never) == \
        Move("queued", "preempted by a job of higher priority", {"pid": None, "preemptions": 3})
    assert ended(job(1, "preempting", hold="cancel"), 75, False, None, never).dst == "cancelled"
    interrupted = ended(job(1, "running"), EXIT_INTERRUPTED, False, None, never)
    assert (interrupted.dst, interrupted.fields["hold"]) == ("queued", "interrupted")
    assert ended(job(1, "running"), -1, False, "interrupted", never).fields["hold"] == "interrupted"
    assert ended(job(1, "running"), -1, False, None, never).dst == "queued"   # adopted, died unseen
    assert ended(job(1, "running"), -1, False, "killed", never).dst == "queued"
    failed = ended(job(1, "running"), 1, False, "crashed", lambda: "error: out of memory")
    assert failed == Move("failed", "error: out of memory", {"pid": None, "cause": "error: out of memory"})


def test_a_job_found_dead_at_start_is_queued_again_completed_or_cancelled():
    assert recovered(job(1, "running"), completed=False).dst == "queued"
    assert "resumes from its last checkpoint" in recovered(job(1, "running"), completed=False).why
    assert recovered(job(1, "running"), completed=True).dst == "completed"
    assert recovered(job(1, "preempting", hold="cancel"), completed=False).dst == "cancelled"
    assert recovered(job(1, "running", hold="cancel"), completed=True).dst == "queued"
