"""Admission and packing: one pure function, checked against hand-worked cases."""

from ember.sched.admission import AGEING_SECONDS, Holding, Room, Want, decide

MiB = 1 << 20
TWO = [Room(0, 8 * MiB), Room(1, 8 * MiB)]


def test_small_jobs_share_a_device_and_a_large_one_keeps_a_whole_device():
    d = decide([Want(1, 0, 0, 3 * MiB), Want(2, 0, 1, 3 * MiB), Want(3, 0, 2, 8 * MiB)], [], TWO, 10)
    assert d.start[1] == d.start[2] == (0,)  # best fit: the second small job joins the first
    assert d.start[3] == (1,)


def test_a_job_that_does_not_fit_waits_and_says_why():
    d = decide([Want(1, 0, 0, 6 * MiB)], [Holding(9, 0, 0, 4 * MiB, (0,)), Holding(8, 0, 0, 4 * MiB, (1,))], TWO, 10)
    assert d.start == {} and d.preempt == []
    assert "equal or higher priority" in d.waiting[1]


def test_higher_priority_preempts_the_lowest_most_recent_and_only_as_many_as_needed():
    running = [Holding(7, 1, 0, 6 * MiB, (0,)), Holding(8, 0, 5, 6 * MiB, (1,)), Holding(9, 0, 1, 1 * MiB, (0,))]
    d = decide([Want(1, 5, 100, 6 * MiB)], running, TWO, 110)
    # priority 0 first; of those, 8 started last (t=5) and frees device 1 alone
    assert d.preempt == [8]
    assert d.start == {}
    assert "preempting" in d.waiting[1]


def test_equal_priority_never_preempts():
    d = decide([Want(1, 0, 100, 6 * MiB)], [Holding(8, 0, 5, 6 * MiB, (0,)), Holding(9, 0, 5, 6 * MiB, (1,))], TWO, 110)
    assert d.preempt == []


def test_room_freed_by_preemption_is_reserved_for_the_preemptor():
    running = [Holding(8, 0, 5, 8 * MiB, (0,)), Holding(9, 9, 5, 8 * MiB, (1,))]
    d = decide([Want(1, 5, 100, 8 * MiB), Want(2, 0, 50, 1 * MiB)], running, TWO, 110)
    assert d.preempt == [8] and 2 not in d.start  # job 2 must not take device 0 from job 1


def test_ageing_lifts_a_long_waiting_job_over_newer_higher_ones():
    old = Want(1, 0, 0, 8 * MiB)
    new = Want(2, 2, 3 * AGEING_SECONDS - 1, 8 * MiB)
    d = decide([new, old], [], [Room(0, 8 * MiB)], 3 * AGEING_SECONDS)
    assert d.start == {1: (0,)}


def test_backfill_stops_behind_a_job_waiting_longer_than_the_ageing_period():
    big = Want(1, 0, 0, 8 * MiB)  # waited 2 ageing periods and cannot fit
    small = Want(2, 0, 1, 1 * MiB)
    running = [Holding(9, 5, 0, 4 * MiB, (0,))]
    d = decide([big, small], running, [Room(0, 8 * MiB)], 2 * AGEING_SECONDS)
    assert d.start == {} and "no backfill" in d.waiting[2]
    # a fresh blocker does not stop backfill
    d = decide([Want(1, 0, 100, 8 * MiB), Want(2, 0, 101, 1 * MiB)], running, [Room(0, 8 * MiB)], 110)
    assert d.start == {2: (0,)}


def test_multi_device_request():
    d = decide([Want(1, 0, 0, 4 * MiB, count=2)], [Holding(9, 0, 0, 6 * MiB, (0,))],
               TWO + [Room(2, 8 * MiB)], 1)
    assert d.start == {1: (1, 2)}
