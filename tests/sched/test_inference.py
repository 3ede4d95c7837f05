"""The inference gate's pause-latency samples (ember.sched.inference), taken from what a real
PausePoint (ember.control, the training loop's side) acknowledges."""

import threading
import time

from ember import control
from ember.control import PausePoint
from ember.sched.inference import Gate
from tests.helpers import wait_until


def test_each_inference_pause_is_one_sample_the_jobs_own_latency(tmp_path):
    g = Gate(device=0, idle_gap=1.0)
    point = PausePoint(tmp_path, lambda: False, lambda: None)
    for _ in range(3):
        control.request(tmp_path, "inference", lease=60)
        threading.Timer(0.1, control.request, (tmp_path, None)).start()
        held = point.check()
        g.observe(control.acknowledged(tmp_path))  # a short pause: the service sees only "running" after it
        g.observe(control.acknowledged(tmp_path))  # and again at its next tick: no second sample
        assert held.latency == g.latencies[-1] and held.asked <= held.start
        time.sleep(0.05)  # training goes on before the next request
    assert g.stats()["pauses"] == 3


def test_a_lapsed_lease_takes_no_sample_and_leaves_none_open(tmp_path):
    """Before, a request that found training running opened a sample that a lapsed pause never
    closed; the next pause, seconds later, closed it with those seconds."""
    g = Gate(device=0, idle_gap=1.0)
    point = PausePoint(tmp_path, lambda: False, lambda: None)
    control.request(tmp_path, "inference", lease=0.05)
    time.sleep(0.3)  # the job is mid-step past the lease: it goes on, never pauses
    assert point.check() is None
    g.observe(control.acknowledged(tmp_path))
    assert g.stats()["pauses"] == 0
    control.request(tmp_path, None)
    point.check()
    time.sleep(0.3)
    control.request(tmp_path, "inference", lease=60)
    threading.Timer(0.1, control.request, (tmp_path, None)).start()
    held = point.check()
    g.observe(control.acknowledged(tmp_path))
    assert g.stats()["pauses"] == 1 and g.latencies[0] == held.latency < 0.3


def test_a_job_paused_already_for_its_owner_takes_no_sample(tmp_path):
    g = Gate(device=0, idle_gap=1.0)
    point = PausePoint(tmp_path, lambda: False, lambda: None)
    control.request(tmp_path, "owner")
    waiter = threading.Thread(target=point.check, daemon=True)
    waiter.start()
    wait_until("paused", lambda: (control.acknowledged(tmp_path) or {}).get("state") == "paused", 60, every=0.01)
    control.request(tmp_path, "inference", lease=60)  # a request arrives while it is paused
    wait_until("answered", lambda: control.acknowledged(tmp_path)["seq"] == 2, 60, every=0.01)
    g.observe(control.acknowledged(tmp_path))
    control.request(tmp_path, None)
    waiter.join(timeout=60)
    g.observe(control.acknowledged(tmp_path))
    assert g.stats()["pauses"] == 0


def test_the_quantiles_interpolate_between_few_samples():
    g = Gate(device=0, idle_gap=1.0)
    for n, latency in enumerate([0.4, 0.1, 0.3, 0.2], 1):
        g.observe({"pid": 1, "last": {"n": n, "reason": "inference", "asked": 10.0, "at": 10.0 + latency}})
    s = g.stats()
    assert s["pauses"] == 4 and abs(s["pause_latency_p50"] - 0.25) < 1e-9
    assert abs(s["pause_latency_p99"] - 0.397) < 1e-9  # 0.3 + 0.97 x (0.4 - 0.3), not the largest
    g.begin()
    assert g.stats()["requests"] == 1 and g.stats()["in_flight"] == 1


def test_stats_show_the_gap_in_use_and_busy_follows_it():
    fixed = Gate(device=0, idle_gap=2.0)
    assert (fixed.stats()["idle_gap_seconds"], fixed.stats()["idle_gap_rule"]) == (2.0, "fixed")
    g = Gate(device=0, idle_gap="auto")
    g.observe({"pid": 1, "last": {"n": 1, "reason": "inference", "asked": 10.0, "at": 10.15}})
    t = 100.0
    for n in range(9):  # requests of 0.1 s, 0.4 s of quiet between them: worth holding for
        g.begin(t)
        g.end(t + 0.1)
        t += 0.5
    s = g.stats()
    assert s["idle_periods"] == 8 and s["idle_gap_rule"] == "auto (8 periods)", s
    assert abs(s["idle_gap_seconds"] - 0.4) < 1e-9, s
    assert g.busy(g.last_end + 0.3) and not g.busy(g.last_end + 0.5)
    g.idle_gap = 0.1  # owner.toml changed to a fixed gap: it holds at once
    assert g.stats()["idle_gap_rule"] == "fixed" and not g.busy(g.last_end + 0.3)
