"""The inference gate's pause-latency samples (ember.sched.inference)."""

import time

from ember.sched.inference import Gate


def test_a_pause_acknowledged_before_the_next_request_is_sampled_once():
    """CI saw 6 requests and 0 pauses: the job acknowledged between two requests and the next
    request cleared the pending sample before the scheduler's tick could take it."""
    g = Gate(device=0, idle_gap=1.0)
    g.begin(training=True)
    t0 = g.pending
    g.end()
    acked = t0 + 0.25
    g.begin(training=False, paused_at=acked)  # the next request finds training paused already
    g.paused(acked + 1.0)                     # the scheduler's tick, later: nothing left to sample
    s = g.stats()
    assert s["requests"] == 2 and s["pauses"] == 1
    assert abs(s["pause_latency_p50"] - 0.25) < 1e-9


def test_a_request_that_finds_training_paused_or_absent_takes_no_sample():
    g = Gate(device=0, idle_gap=1.0)
    g.begin(training=False, paused_at=time.time())  # paused by its owner, nothing pending
    g.begin(training=False)                          # no job on the device
    g.paused(time.time())
    assert g.stats()["pauses"] == 0 and g.stats()["in_flight"] == 2


def test_one_busy_period_is_one_sample_from_its_first_request():
    g = Gate(device=0, idle_gap=1.0)
    g.begin(training=True)
    first = g.pending
    g.begin(training=True)  # still training: the sample keeps the first request's time
    assert g.pending == first
    g.paused(first + 0.5)
    assert g.stats()["pauses"] == 1 and g.stats()["pause_latency_p99"] == 0.5


def test_a_request_starts_a_sample_only_while_training_and_all_acknowledgements_close_it():
    """What the service hands the gate: each job's last acknowledgement on the device."""
    g = Gate(device=0, idle_gap=1.0)
    g.arrive([{"state": "paused", "time": 5.0}, {"state": "running", "time": 4.0}])  # one still trains
    assert g.pending is not None
    g.acknowledged([{"state": "paused", "time": g.pending + 0.5}, {"state": "running"}], g.pending + 0.5)
    assert g.stats()["pauses"] == 0  # not all of them yet
    t0 = g.pending
    g.acknowledged([{"state": "paused", "time": t0 + 0.5}, {"state": "paused", "time": t0 + 0.75}], t0 + 0.5)
    assert g.stats()["pauses"] == 1 and abs(g.stats()["pause_latency_p50"] - 0.75) < 1e-9
    g.arrive([])  # nobody on the device: no sample to start
    assert g.pending is None and g.stats()["requests"] == 2
