"""The gate: one pure function, checked as tables. Every row states the request's difference from
an allowed one and the violations it must produce (all of them, and nothing else)."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from ember.policy.gate import Decision, LedgerView, Limits, Prediction, Request, check, month_of, wall_budget_seconds
from ember.policy.registry import Dataset
from ember.policy.targets import Target

FP = "sha256:" + "a" * 64
OTHER_FP = "sha256:" + "b" * 64
NOW = dt.datetime(2026, 12, 2, 12, tzinfo=dt.timezone.utc).timestamp()


def dataset(name: str, **kw) -> Dataset:
    base = dict(paths=[f"/data/{name}"], fingerprint=FP, owner="alice", licence="CC0-1.0",
                classification="public", allowed_targets=["hpc"], expires="", name=name, source="datasets.toml")
    return Dataset(**{**base, **kw})


def target(**kw) -> Target:
    base = dict(device_hour_price=2.0, max_nodes=2, max_wall_hours=10.0, max_device_hours=20.0,
                max_cost_per_job=40.0, max_cost_per_month=100.0, allowed_classifications=["public", "internal"],
                stage_dir="/scratch", name="hpc")
    return Target(**{**base, **kw})


REGISTRY = {"corpus": dataset("corpus"), "chats": dataset("chats", paths=["/data/chats/a.jsonl",
                                                                          "/data/chats/b.jsonl"])}
TARGETS = {"hpc": target()}
LIMITS = Limits(max_wall_hours=5, max_device_hours=10, max_cost=20, max_nodes=1)
PREDICTION = Prediction(device_hours=4.0, cost=8.0, wall_hours=4.0, how="plan")
REQUEST = Request("digest", ("/data/corpus/part-0.jsonl", "/data/chats/a.jsonl"), {"corpus": FP, "chats": FP},
                  "hpc", LIMITS, 1, PREDICTION, NOW)
VIEW = LedgerView("2026-12", 50.0)


def decide(request: Request = REQUEST, registry=REGISTRY, targets=TARGETS, view: LedgerView = VIEW) -> Decision:
    return check(request, registry, targets, view)


def change(obj, **kw):
    return dataclasses.replace(obj, **kw)


def test_a_request_within_every_rule_is_allowed_and_names_its_datasets():
    d = decide()
    assert d.allowed and d.reasons == ()
    assert [(u.name, u.fingerprint, u.observed) for u in d.datasets] == [("chats", FP, FP), ("corpus", FP, FP)]


SINGLE = [
    # (what differs, request, registry, targets, view, the one code it must produce)
    ("unknown target", change(REQUEST, target="nowhere"),
     {k: change(v, allowed_targets=["nowhere"]) for k, v in REGISTRY.items()}, TARGETS, VIEW, "unknown-target"),
    ("a file in no dataset", change(REQUEST, files=REQUEST.files + ("/home/me/notes.txt",)),
     REGISTRY, TARGETS, VIEW, "unregistered-file"),
    ("dataset not allowed for the target", REQUEST, {**REGISTRY, "chats": dataset("chats", paths=["/data/chats/a.jsonl"],
                                                                                  allowed_targets=[])},
     TARGETS, VIEW, "dataset-target"),
    ("classification forbidden there", REQUEST, {**REGISTRY, "corpus": dataset("corpus", classification="restricted")},
     TARGETS, VIEW, "classification"),
    ("fingerprint mismatch", change(REQUEST, observed={"corpus": OTHER_FP, "chats": FP}), REGISTRY, TARGETS, VIEW,
     "fingerprint"),
    ("a dataset not hashed", change(REQUEST, observed={"chats": FP}), REGISTRY, TARGETS, VIEW, "fingerprint"),
    ("expired permission", REQUEST, {**REGISTRY, "corpus": dataset("corpus", expires="2026-12-01")}, TARGETS, VIEW,
     "expired"),
    ("missing limit", change(REQUEST, limits=change(LIMITS, max_cost=None)), REGISTRY, TARGETS,
     VIEW, "missing-limit"),
    ("limit above a cap", change(REQUEST, limits=change(LIMITS, max_wall_hours=11)), REGISTRY, TARGETS, VIEW,
     "above-cap"),
    ("more nodes than the job's limit", change(REQUEST, nodes=2), REGISTRY, TARGETS, VIEW, "nodes"),
    ("predicted cost above the limit", change(REQUEST, prediction=change(PREDICTION, cost=21.0)), REGISTRY, TARGETS,
     VIEW, "predicted-over"),
    ("predicted device-hours above the limit", change(REQUEST, prediction=change(PREDICTION, device_hours=10.5)),
     REGISTRY, TARGETS, VIEW, "predicted-over"),
    ("predicted wall time above the limit", change(REQUEST, prediction=change(PREDICTION, wall_hours=6.0)),
     REGISTRY, TARGETS, VIEW, "predicted-over"),
    ("no prediction", change(REQUEST, prediction=Prediction(None, None, None, "unknown architecture")),
     REGISTRY, TARGETS, VIEW, "prediction-unknown"),
    ("monthly budget exceeded", REQUEST, REGISTRY, TARGETS, LedgerView("2026-12", 80.5), "monthly-budget"),
    ("a zero cost limit", change(REQUEST, limits=change(LIMITS, max_cost=0)), REGISTRY, TARGETS, VIEW,
     "invalid-limit"),
    ("a negative wall-time limit", change(REQUEST, limits=change(LIMITS, max_wall_hours=-1)), REGISTRY, TARGETS, VIEW,
     "invalid-limit"),
    ("a limit that is not a number", change(REQUEST, limits=change(LIMITS, max_device_hours=float("nan"))), REGISTRY,
     TARGETS, VIEW, "invalid-limit"),
    ("an infinite limit", change(REQUEST, limits=change(LIMITS, max_device_hours=float("inf"))), REGISTRY,
     TARGETS, VIEW, "invalid-limit"),
    ("a zero node limit", change(REQUEST, limits=change(LIMITS, max_nodes=0)), REGISTRY, TARGETS, VIEW,
     "invalid-limit"),
    ("zero nodes", change(REQUEST, nodes=0), REGISTRY, TARGETS, VIEW, "invalid-limit"),
    ("a continued job whose recipe changed", change(REQUEST, continues="other-digest"), REGISTRY, TARGETS, VIEW,
     "recipe-changed"),
]


@pytest.mark.parametrize("what,request_,registry,targets,view,code", SINGLE, ids=[row[0] for row in SINGLE])
def test_each_single_violation_is_refused_with_exactly_its_reason(what, request_, registry, targets, view, code):
    d = decide(request_, registry, targets, view)
    assert not d.allowed
    assert d.codes == [code], f"{what}: {d.reasons}"


def test_the_boundaries_are_inclusive_where_a_limit_equals_its_cap_or_prediction():
    at = change(REQUEST, limits=Limits(max_wall_hours=10, max_device_hours=20, max_cost=40, max_nodes=2),
                prediction=Prediction(20.0, 40.0, 10.0))
    assert decide(at, view=LedgerView("2026-12", 60.0)).allowed      # 60 + 40 = the monthly cap exactly
    assert decide(at, view=LedgerView("2026-12", 60.01)).codes == ["monthly-budget"]
    last_day = {**REGISTRY, "corpus": dataset("corpus", expires="2026-12-02")}
    assert decide(registry=last_day).allowed                          # the permission holds through its last day


def test_every_violation_is_listed_at_once():
    registry = {"corpus": dataset("corpus", classification="personal", allowed_targets=[], expires="2025-01-01")}
    request = Request("d", ("/data/corpus/x.jsonl", "/tmp/other.txt"), {"corpus": OTHER_FP}, "hpc",
                      Limits(max_wall_hours=None, max_device_hours=30, max_cost=50, max_nodes=1), 3,
                      Prediction(35.0, 55.0, 25.0), NOW)
    d = decide(request, registry, TARGETS, LedgerView("2026-12", 90.0))
    assert not d.allowed
    assert sorted(d.codes) == sorted([
        "unregistered-file", "dataset-target", "classification", "fingerprint", "expired", "missing-limit",
        "nodes", "above-cap", "above-cap", "predicted-over", "predicted-over", "predicted-over", "monthly-budget"])
    over = [v.message for v in d.reasons if v.code == "predicted-over"]
    assert any("cap max_wall_hours 10" in m for m in over)  # the missing limit: the cap stands in for it


def test_deny_by_default_no_targets_and_no_registry():
    d = check(REQUEST, {}, {}, VIEW)
    assert not d.allowed
    assert d.codes == ["unknown-target", "unregistered-file", "unregistered-file"]


def test_the_wall_budget_is_the_tightest_limit():
    lim = Limits(max_wall_hours=3, max_device_hours=8, max_cost=12, max_nodes=1)
    assert wall_budget_seconds(lim, devices=4, price=1.0) == 2 * 3600       # 8 device-h over 4 devices
    assert wall_budget_seconds(lim, devices=2, price=3.0) == 2 * 3600       # 12 / (3 x 2 per hour)
    assert wall_budget_seconds(lim, devices=1, price=0.0) == 3 * 3600       # free: wall time decides
    assert wall_budget_seconds(lim, devices=1, price=1.0) == 3 * 3600


def test_the_month_is_the_utc_calendar_month():
    name, start = month_of(NOW)
    assert name == "2026-12" and start == dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc).timestamp()


# A file registered twice: in a personal folder, and alone (or as a copy) in a public dataset
# allowed to 'hpc'. It counts as personal wherever it is read from.
CHATS = dataset("chats", paths=["/data/chats"], classification="personal", allowed_targets=[])
ALICE = dataset("alice-public", paths=["/data/chats/alice.jsonl"], allowed_targets=["hpc"])
ALICE_REQUEST = change(REQUEST, files=("/data/chats/alice.jsonl",), observed={"alice-public": FP})


def test_a_file_inside_a_personal_folder_registered_again_as_public_counts_as_personal():
    d = decide(ALICE_REQUEST, {"chats": CHATS, "alice-public": ALICE})
    for v in d.reasons:  # the figure for the note: the gate's decision
        print(f"{v.code}: {v.message}")
    assert not d.allowed
    assert sorted(d.codes) == ["classification", "dataset-target"]
    assert ("dataset 'chats' is personal; 'hpc' allows public, internal; /data/chats/alice.jsonl is also in "
            "'alice-public' (public)") in d.reasons[d.codes.index("classification")].message
    assert "dataset 'chats' (it holds /data/chats/alice.jsonl, which this job reads) may not go to 'hpc'" in \
        d.reasons[d.codes.index("dataset-target")].message
    # Staged from the dataset that lists it most closely; the personal one only constrains.
    assert [(u.name, u.staged, u.classification) for u in d.datasets] == [
        ("alice-public", True, "public"), ("chats", False, "personal")]


def test_the_same_path_in_a_personal_and_a_public_dataset_counts_as_personal():
    same = {"chats": dataset("chats", paths=["/data/chats/alice.jsonl"], classification="personal",
                             allowed_targets=["hpc"]), "alice-public": ALICE}
    d = decide(ALICE_REQUEST, same)
    assert d.codes == ["classification"]
    # A target that allows personal data takes it, from one of them: the other is a holder too.
    allowing = {"hpc": target(allowed_classifications=["public", "personal"])}
    d = decide(change(ALICE_REQUEST, observed={"alice-public": FP, "chats": FP}), same, allowing)
    assert d.allowed and sorted((u.name, u.staged) for u in d.datasets) == [("alice-public", True), ("chats", False)]


def test_a_copy_of_a_personal_file_counts_as_personal_by_its_content():
    copy = dataset("copy", paths=["/public/alice-copy.jsonl"])
    request = change(REQUEST, files=("/public/alice-copy.jsonl",), observed={"copy": FP},
                     contents={"/public/alice-copy.jsonl": frozenset({"c0ffee"})},
                     registered={"chats": frozenset({"c0ffee", "beef"}), "copy": frozenset({"c0ffee"})})
    d = decide(request, {"chats": CHATS, "copy": copy})
    assert sorted(d.codes) == ["classification", "dataset-target"]
    assert not decide(request, {"chats": CHATS, "copy": copy}).allowed
    other_content = change(request, contents={"/public/alice-copy.jsonl": frozenset({"d00d"})})
    assert decide(other_content, {"chats": CHATS, "copy": copy}).allowed


def test_a_folder_read_whole_holds_the_datasets_registered_inside_it():
    """The recipe reads /data/chats (registered public as a whole): a personal file registered
    inside it is sent with it, so it is held too."""
    folder = dataset("all-chats", paths=["/data/chats"], allowed_targets=["hpc"])
    alice = dataset("alice", paths=["/data/chats/alice.jsonl"], classification="personal", allowed_targets=[])
    d = decide(change(REQUEST, files=("/data/chats",), observed={"all-chats": FP}),
               {"all-chats": folder, "alice": alice})
    assert sorted(d.codes) == ["classification", "dataset-target"]


def test_a_staged_folder_holds_every_dataset_registered_inside_it_though_the_job_reads_one_file():
    """The job reads one file of /data/chats, registered as a whole and allowed to 'hpc': the
    whole folder is staged, so a file in it that a dataset not allowed there holds (by path, or
    as a copy by content) leaves the machine too, and refuses the job."""
    folder = dataset("all-chats", paths=["/data/chats"], allowed_targets=["hpc"])
    alice = dataset("alice", paths=["/data/chats/alice.jsonl"], allowed_targets=[])
    request = change(REQUEST, files=("/data/chats/bob.jsonl",), observed={"all-chats": FP})
    d = decide(request, {"all-chats": folder, "alice": alice})
    assert d.codes == ["dataset-target"]
    assert "dataset 'alice' (it holds a file of /data/chats, which this job stages with 'all-chats') may not " \
           "go to 'hpc'" in d.reasons[0].message
    assert [(u.name, u.staged) for u in d.datasets] == [("alice", False), ("all-chats", True)]
    personal = {"all-chats": folder, "alice": change(alice, classification="personal")}
    assert sorted(decide(request, personal).codes) == ["classification", "dataset-target"]
    copy = dataset("copy", paths=["/private/alice-copy.jsonl"], allowed_targets=[])
    by_content = change(request, contents={"/data/chats/bob.jsonl": frozenset({"b0b"}),
                                           "/data/chats": frozenset({"b0b", "c0ffee"})},
                        registered={"all-chats": frozenset({"b0b", "c0ffee"}), "copy": frozenset({"c0ffee"})})
    assert decide(by_content, {"all-chats": folder, "copy": copy}).codes == ["dataset-target"]
    assert decide(by_content, {"all-chats": folder}).allowed
