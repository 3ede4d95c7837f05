"""Young/Daly checkpoint intervals against hand computation, and M from the ledger."""

from __future__ import annotations

import math

import pytest

from ember.ckpt.interval import daly, recommend, young
from ember.errors import EmberError
from ember.ledger import database as store
from ember.ledger.history import attempt_times, mtbf_seconds
from ember.ledger.mtbf import mtbf
from ember.plan.planner import make_plan
from ember.recipe import load_recipe
from tests.helpers import write_recipe


def test_young_and_daly_by_hand():
    # δ = 60 s, M = 24 h: Young sqrt(2 * 60 * 86400) = 3219.94 s; Daly with x = δ/2M = 1/2880:
    # 3219.94 * (1 + sqrt(x)/3 + x/9) - 60 = 3180.06 s.
    assert young(60, 86400) == pytest.approx(3219.938, abs=1e-3)
    assert daly(60, 86400) == pytest.approx(3180.06, abs=0.01)
    assert daly(100, 40) == 40  # δ >= 2M: checkpoint every M


def test_recommendation_shares():
    iv = recommend(delta=2.0, mtbf=3600, restart=5.0)
    assert iv.checkpoint_share == pytest.approx(2.0 / (iv.seconds + 2.0))
    assert iv.lost_share == pytest.approx(((iv.seconds + 2.0) / 2 + 5.0) / 3600)
    # The optimum: a 20% longer or shorter interval wastes more.
    def waste(tau):
        return 2.0 / (tau + 2.0) + ((tau + 2.0) / 2 + 5.0) / 3600
    assert waste(iv.seconds) < waste(iv.seconds * 1.2) and waste(iv.seconds) < waste(iv.seconds / 1.2)


def test_mtbf_from_the_ledger_counts_only_interruptions(tmp_path):
    """Only attempts that died without saying are interruptions: an error (failed, crashed) says
    nothing about the machine, and a stop on request checkpointed first. The attempts go through
    the ledger's own functions, as runs write them."""
    con = store.connect(tmp_path / "ledger.db")
    store.register_run(con, "r1", tmp_path, "r1", "digest", {}, 10)
    store.register_run(con, "r2", tmp_path / "other", "r2", "digest", {}, 10)
    attempts = [("r1", "box", 0, 3600, "killed"), ("r1", "box", 4000, 7600, "completed"),
                ("r1", "box", 8000, 11600, "crashed"), ("r1", "box", 12000, 12100, "interrupted"),
                ("r1", "box", 13000, 13010, "failed"), ("r2", "other", 0, 99999, "killed")]
    for n, (run, host, start, end, outcome) in enumerate(attempts, 1):
        store.start_attempt(con, run, n, start, host, 100 + n, "cpu x1", None)
        store.Ledger(con, run, n, print).finish(outcome)
        con.execute("UPDATE attempts SET end = ? WHERE run_id = ? AND attempt = ?", (end, run, n))
    seconds, why = mtbf(0.0, attempt_times(con, "box"), "box")
    assert seconds == 10910  # 3600 + 3600 + 3600 + 100 + 10 seconds of attempts, 1 interruption
    assert "1 interruption in" in why
    assert attempt_times(con, "nowhere") == []
    assert "no interruption on record" in mtbf_seconds(0.0, con, "nowhere").source
    assert mtbf_seconds(2.0, con, "box")[0] == 7200  # the recipe's setting wins
    assert mtbf_seconds(0.0, con, "nowhere")[0] == 24 * 3600


def test_interruption_hours_beyond_a_century_are_refused_and_a_century_plans_finite(tmp_path):
    """[checkpoint] interruption_hours = 1e305 made M = inf: `ember plan` printed "M = inf h",
    "every inf s", "100.00% expected lost work", 19,356 h of wall-clock for seconds of compute, and
    sent the run `remote`."""
    with pytest.raises(EmberError, match=r"interruption_hours = 1e\+305: must be <= 1000000"):
        load_recipe(write_recipe(tmp_path, checkpoint={"interruption_hours": 1e305}))
    plan = make_plan(load_recipe(write_recipe(tmp_path, checkpoint={"interruption_hours": 1e6})))
    iv = plan.checkpoint.interval
    assert math.isfinite(iv.seconds) and iv.lost_share < 1e-3 and plan.verdict == "local"
