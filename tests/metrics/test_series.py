"""The dashboard's curves: min/max downsampling keeps every spike, reading follows a growing
metrics.jsonl, and the step-time histogram counts like numpy's."""

import json
import math
import random

import numpy as np
import pytest

from ember.errors import BadInput
from ember.metrics.series import curves, downsample, follow, read_records
from ember.metrics.stats import histogram


def test_short_series_come_back_unchanged_less_their_gaps():
    xs, ys = [1, 2, 3, 4], [0.5, None, float("nan"), 2.0]
    assert downsample(xs, ys, 10) == ([1, 4], [0.5, 2.0])


def test_each_bucket_keeps_its_lowest_and_highest_point_in_order():
    xs = list(range(100))
    ys = [float((i * 37) % 11) for i in xs]
    ox, oy = downsample(xs, ys, 10)
    assert len(ox) <= 20 and ox == sorted(ox)
    for b in range(10):  # buckets of 10 consecutive points
        chunk = ys[b * 10:(b + 1) * 10]
        got = [y for x, y in zip(ox, oy) if b * 10 <= x < (b + 1) * 10]
        assert min(got) == min(chunk) and max(got) == max(chunk)
        assert all(ys[x] == y for x, y in zip(ox, oy))  # real points, not averages


def test_a_one_step_spike_in_100000_steps_survives_any_reduction():
    rng = random.Random(0)
    xs = list(range(1, 100_001))
    ys = [2.0 + 0.01 * rng.random() for _ in xs]
    ys[73_519] = 40.0   # the spike
    ys[12_345] = -1.0   # and a dip
    for buckets in (1, 7, 500, 1000):
        ox, oy = downsample(xs, ys, buckets)
        assert len(ox) <= 2 * buckets
        assert (73_520, 40.0) in zip(ox, oy) and (12_346, -1.0) in zip(ox, oy)
        assert max(oy) == 40.0 and min(oy) == -1.0


def test_buckets_must_be_positive():
    with pytest.raises(ValueError):
        downsample([1], [1.0], 0)


def write_metrics(run, steps, start=1):
    with open(run / "metrics.jsonl", "a") as f:
        for s in range(start, start + steps):
            f.write(json.dumps({"step": s, "loss": 10.0 / s, "lr": 1e-3, "step_seconds": 0.01 * s, "tokens": 128,
                                "attempt": 1}) + "\n")


def test_curves_read_the_range_asked_and_say_where_reading_ended(tmp_path):
    write_metrics(tmp_path, 50)
    (tmp_path / "metrics.lost.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")
    c = curves(tmp_path, "r1", ("loss", "lr"), start=11, end=20, buckets=100)
    loss = next(x for x in c.curves if x.field == "loss")
    assert loss.steps == list(range(11, 21)) and loss.values == [10.0 / s for s in range(11, 21)]
    assert (c.points, c.first_step, c.last_step) == (10, 11, 20)
    assert c.offset == (tmp_path / "metrics.jsonl").stat().st_size and c.lost_steps == [7]
    with pytest.raises(BadInput, match="unknown curve"):
        curves(tmp_path, "r1", ("loss", "secret"))


def test_follow_returns_only_new_complete_lines_and_rereads_a_rewound_file(tmp_path):
    write_metrics(tmp_path, 3)
    steps, offset = follow(tmp_path, 0)
    assert [s["step"] for s in steps] == [1, 2, 3]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 2.5, "lr": 0.001}\n{"step": 5, "lo')  # the 5th is being written
    steps, offset2 = follow(tmp_path, offset)
    assert [(s["step"], s["loss"]) for s in steps] == [(4, 2.5)]
    assert follow(tmp_path, offset2) == ([], offset2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # rewound after a rollback
    steps, _ = follow(tmp_path, offset2)
    assert [(s["step"], s["loss"]) for s in steps] == [(1, 9.0)]
    assert read_records(tmp_path / "missing.jsonl", 5) == ([], 5)


def test_histogram_counts_as_numpy_does():
    rng = random.Random(1)
    values = [rng.lognormvariate(-3, 0.5) for _ in range(5000)]
    h = histogram(values, 40)
    counts, edges = np.histogram(values, bins=40)
    assert h.counts == counts.tolist()
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(h.edges, edges))
    one = histogram([0.25, 0.25], 40)
    assert one.counts == [2] and one.edges[0] < 0.25 < one.edges[1]


def test_curves_kept_as_columns_follow_appends_and_a_replaced_file(tmp_path):
    write_metrics(tmp_path, 10)
    assert curves(tmp_path, "r", ("loss",)).last_step == 10
    write_metrics(tmp_path, 5, start=11)  # appended: read from where the last read ended
    c = curves(tmp_path, "r", ("loss",))
    assert c.curves[0].steps == list(range(1, 16)) and c.curves[0].values == [10.0 / s for s in range(1, 16)]
    replaced = tmp_path / "new.jsonl"  # a rollback rewinds by replacing the file (a new inode)
    replaced.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4)))
    replaced.replace(tmp_path / "metrics.jsonl")
    c = curves(tmp_path, "r", ("loss",))
    assert c.curves[0].steps == [1, 2, 3] and c.curves[0].values == [1.0, 1.0, 1.0]
