"""Young/Daly checkpoint intervals against hand computation, and M from the ledger."""

from __future__ import annotations

import math
import sqlite3

import pytest

from ember.plan.interval import daly, mtbf_from_ledger, mtbf_seconds, recommend, young


def test_young_and_daly_by_hand():
    # δ = 60 s, M = 24 h: Young sqrt(2 * 60 * 86400) = 3219.94 s; Daly with x = δ/2M = 1/2880:
    # 3219.94 * (1 + sqrt(x)/3 + x/9) - 60 = 3180.06 s.
    assert young(60, 86400) == pytest.approx(3219.938, abs=1e-3)
    x = 60 / (2 * 86400)
    assert daly(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400) * (1 + math.sqrt(x) / 3 + x / 9) - 60)
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


def test_mtbf_from_the_ledger_counts_only_interruptions():
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE attempts (host TEXT, start REAL, end REAL, last_seen REAL, outcome TEXT)")
    rows = [("box", 0, 3600, None, "killed"), ("box", 4000, 7600, None, "completed"),
            ("box", 8000, None, 11600, "crashed"), ("box", 12000, 12100, None, "interrupted"),
            ("other", 0, 99999, None, "killed")]
    con.executemany("INSERT INTO attempts VALUES (?, ?, ?, ?, ?)", rows)
    seconds, why = mtbf_from_ledger(con, "box")
    assert seconds == pytest.approx((3600 + 3600 + 3600 + 100) / 2)
    assert "2 interruptions" in why
    assert mtbf_from_ledger(con, "nowhere") is None
    assert mtbf_seconds(2.0, con, "box")[0] == 7200  # the recipe's setting wins
    assert mtbf_seconds(0.0, con, "nowhere")[0] == 24 * 3600
