"""`ember serve` for real: a service process, job processes, SIGKILLs, the owner's rules.

Devices are simulated (`--devices sim:NxSIZE`, the documented way to declare devices for tests)
and sized so that one tiny job fits a device: the job's plan asks about 3 MiB with its margin.
Jobs are slowed by a data delay (EMBER_FAULT_DATA_DELAY, which does not change what they compute),
so there is time to act while they run; every result is compared bit-for-bit with an
uninterrupted `ember run` of the same recipe."""

from __future__ import annotations

import datetime as dt
import json
import re
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest

from ember.cgroup import join
from ember.ledger.database import connect, events as ledger_events, find_run
from ember.metrics.stats import percentile
from tests.artifacts import shared
from tests.helpers import assert_same_result, losses, run_ember, wait_until, write_recipe
from tests.serve_harness import Serve

pytestmark = pytest.mark.e2e
DELAY = {"EMBER_FAULT_DATA_DELAY": "0.15"}
OWNER = """
[service]
allowed = ["{root}"]
[inference]
enabled = false
"""


RECIPE = {"train": {"max_steps": 40}, "checkpoint": {"every_steps": 10}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The recipe every job here trains, and its uninterrupted run (built once for every worker:
    each test of this file is a unit of work of its own, conftest.py)."""
    def build(folder):
        r = run_ember("run", write_recipe(folder / "recipe", **RECIPE), "--out", folder / "reference", "--no-ledger")
        assert r.returncode == 0, r.stderr
    root = tmp_path_factory.mktemp("serve")
    recipe = write_recipe(root / "recipe", **RECIPE)
    (root / "reference").symlink_to(shared("serve-reference", RECIPE, build) / "reference")
    return root, recipe


def serve(root, name, devices, owner_extra="", env=DELAY) -> Serve:
    return Serve(root / name, OWNER.format(root=root) + owner_extra, devices, env)


def step(s: Serve, name: str) -> int:
    return s.jobs()[name]["step"]


def attempts_never_overlap(home, out) -> None:
    """No job ever ran twice at once: its run's attempts follow one another."""
    con = sqlite3.connect(home / "ledger.db")
    rows = con.execute("SELECT a.start, a.end FROM attempts a JOIN runs r ON r.id = a.run_id WHERE r.path = ? "
                       "ORDER BY a.start", (str(out),)).fetchall()
    con.close()
    assert rows
    for (s1, e1), (s2, _) in zip(rows, rows[1:]):
        assert e1 is not None and e1 <= s2, rows


def test_priorities_preempt_and_every_job_ends_bit_identical(reference):
    root, recipe = reference
    s = serve(root, "prio", "sim:2x4MiB").start()
    try:
        # Hold everything while three jobs queue; keep the high one back by hand.
        assert s.cli("yield", "--for", "1h").returncode == 0
        for name, prio in (("high", 5), ("low-a", 0), ("low-b", 0)):
            r = s.cli("submit", str(recipe), "--name", name, "--priority", str(prio))
            assert r.returncode == 0, r.stderr
        assert s.cli("pause", "high", "--hard").returncode == 0
        assert s.cli("yield", "--release").returncode == 0
        s.wait(lambda j: all(j[n]["state"] == "running" and j[n]["step"] >= 3 for n in ("low-a", "low-b")))
        jobs = s.jobs()
        assert {tuple(jobs[n]["devices"]) for n in ("low-a", "low-b")} == {(0,), (1,)}  # one per device
        assert s.cli("resume", "high").returncode == 0
        # high cannot fit: it preempts the lower job that started last, which checkpoints and requeues.
        victim = s.wait(lambda j: next((n for n in ("low-a", "low-b") if j[n]["preemptions"]), None))
        s.wait(lambda j: j["high"]["state"] in ("starting", "running", "completed"))
        assert s.jobs()[victim]["state"] in ("queued", "preempting")
        s.wait(lambda j: all(x["state"] == "completed" for x in j.values()), timeout=400)
        jobs = s.jobs()
        assert jobs[victim]["preemptions"] == 1
        q = s.cli("queue")
        assert q.returncode == 0 and "completed" in q.stdout
        cap = s.cli("capacity")  # the jobs' attempts are on the simulated devices they were given
        assert cap.returncode == 0 and "sim:0" in cap.stdout and "sim:1" in cap.stdout, cap.stdout
        for name in jobs:
            # the service's control files live in its own folder, never in a run folder
            assert not list((root / "prio" / "runs" / name).glob("control*"))
            assert_same_result(root / "prio" / "runs" / name, root / "reference")
            attempts_never_overlap(s.home, root / "prio" / "runs" / name)
    finally:
        s.stop()


def test_sigkilled_service_finds_every_job_in_every_state(reference):
    """SIGKILL the service with jobs queued, running and soft-paused, then with one starting and
    one preempting; each restart adopts what still runs and requeues what died; all end exact."""
    root, recipe = reference
    s = serve(root, "kill", "sim:3x4MiB", env={"EMBER_FAULT_DATA_DELAY": "0.3"}).start()
    try:
        assert s.cli("yield", "--for", "1h").returncode == 0  # hold while the jobs queue
        for name in ("run", "soft", "held"):
            assert s.cli("submit", str(recipe), "--name", name).returncode == 0
        assert s.cli("pause", "held", "--hard").returncode == 0
        assert s.cli("yield", "--release").returncode == 0
        s.wait(lambda j: j["run"]["state"] == "running" and j["soft"]["state"] == "running")
        assert s.cli("pause", "soft").returncode == 0
        s.wait(lambda j: j["soft"]["state"] == "soft-paused")
        explained = s.cli("queue", "--explain").stdout  # a hand's pause and hold, which it did not see
        assert "soft (soft-paused, pause user): paused by hand" in explained, explained
        assert "held (queued, hold user): held by hand" in explained, explained
        before = {n: s.job_pid(n) for n in ("run", "soft")}
        # Stopped while no service watches, the running job is still running when one starts again
        # (on a loaded machine it once completed meanwhile: 'completed' != 'running').
        running = s.trainer("run")
        running.suspend()
        try:
            s.kill()
            s.start()  # adopts both live processes; the held job stays held
            jobs = s.jobs()
        finally:
            running.resume()
        assert (jobs["run"]["state"], jobs["soft"]["state"], jobs["held"]["state"]) == ("running", "soft-paused", "queued")
        assert {n: s.job_pid(n) for n in ("run", "soft")} == before
        assert jobs["held"]["hold"] == "user"
        paused_at = jobs["soft"]["step"]
        time.sleep(1.0)
        assert step(s, "soft") == paused_at  # a soft pause holds across the restart

        assert s.cli("resume", "held").returncode == 0  # -> starting
        s.wait(lambda j: j["held"]["state"] == "starting", every=0.02)
        s.wait(lambda j: j["run"]["step"] >= 3)
        supervisor = psutil.Process(s.job_pid("run"))
        trainer = s.trainer("run")
        # Stopped, it takes the preemption only once continued: the service dies while the job is
        # preempting (its supervisor, torch-free, exits at once after the trainer; no race).
        trainer.suspend()
        try:
            assert s.cli("pause", "run", "--hard").returncode == 0  # -> preempting
            assert s.jobs()["run"]["state"] == "preempting"
            s.kill()
        finally:
            trainer.resume()
        supervisor.wait(timeout=120)  # the preempted job checkpoints and exits while no service watches

        s.start()
        jobs = s.jobs()
        assert jobs["run"]["state"] == "queued" and jobs["run"]["hold"] == "user"
        assert jobs["held"]["state"] in ("starting", "running", "completed")
        for name in ("run", "soft"):
            assert s.cli("resume", name).returncode == 0
        s.wait(lambda j: all(x["state"] == "completed" for x in j.values()), timeout=400)
        con = connect(s.home / "ledger.db")
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        for name in ("run", "soft", "held"):
            out = root / "kill" / "runs" / name
            assert_same_result(out, root / "reference")
            attempts_never_overlap(s.home, out)
        soft = find_run(con, str(root / "kill" / "runs" / "soft"))
        paused = [e for e in ledger_events(con, soft["id"]) if e["kind"] == "pause"]
        assert paused and paused[0]["end"] - paused[0]["start"] >= 1.0
        report = json.loads(run_ember("report", root / "kill" / "runs" / "soft", "--json",
                                      "--ledger", s.home / "ledger.db").stdout)
        assert report["goodput"]["buckets"]["paused"] >= 1.0
    finally:
        s.stop()


def test_a_pause_for_inference_lapses_when_its_service_dies(reference):
    """A job soft-paused for inference stayed paused for as long as its dead service stayed dead
    (issue 24, item 7). The pause is a lease the service renews while requests run: SIGKILL the
    service during one (idle_gap_seconds holds it for minutes) and the job trains on by itself
    once [inference] pause_lease_seconds (3 s here) pass; a service that starts again settles the
    lease and adopts the job, which ends bit-identical."""
    root, recipe = reference
    owner = OWNER.format(root=root).replace("enabled = false", "seed = 7\nidle_gap_seconds = 600\n"
                                                                 "pause_lease_seconds = 3")
    s = Serve(root / "lease", owner, None, DELAY).start()
    try:
        assert s.cli("submit", str(recipe), "--name", "t").returncode == 0
        s.wait(lambda j: j["t"]["state"] == "running" and j["t"]["step"] >= 2)
        deadline = time.monotonic() + 120
        while (r := s.http.post("/v1/completions", headers=s.auth, timeout=60,
                                json={"prompt": "In the beginning", "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, f"the engine did not load in 120 s: {r.text}"
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        s.wait(lambda j: j["t"]["state"] == "soft-paused")
        control = json.loads((s.home / "serve" / "control" / str(s.jobs()["t"]["id"]) / "control.json").read_text())
        assert control["pause"] == "inference" and control["until"] > time.time()
        out = s.home / "runs" / "t"
        paused_at = len((out / "metrics.jsonl").read_text().splitlines())
        time.sleep(1.0)
        assert len((out / "metrics.jsonl").read_text().splitlines()) == paused_at  # paused while renewed
        s.kill()
        deadline = time.monotonic() + 60  # the lease is 3 s
        while len((out / "metrics.jsonl").read_text().splitlines()) < paused_at + 2:
            assert time.monotonic() < deadline, (f"the job is still paused 60 s after its service died "
                                                 f"(step {paused_at}); control.json: {control}")
            time.sleep(0.1)
        s.start()  # settles the lease it finds and adopts the job, at its first scheduling pass
        s.wait(lambda j: j["t"]["state"] in ("running", "completed"), timeout=60)
        s.wait(lambda j: j["t"]["state"] == "completed", timeout=300)
        assert_same_result(out, root / "reference")
    finally:
        s.stop()


def test_a_failed_job_requeued_resumes_its_run_ends_bit_identical_and_purge_keeps_the_run(reference):
    """A failed job could only be submitted again, as a new run from step 0, and finished jobs
    piled up in the queue (issue 24, item 12). Here a job trains, is paused (a checkpoint), then
    fails: its run folder's record became unreadable (the recipe itself cannot break it: the job
    trains the recipe as admitted, ember.launchspec). Put back, `ember requeue` resumes the same run from that
    checkpoint and it ends bit-identical to an uninterrupted run; `ember queue` names its run
    folder and run; `ember queue purge` removes the job, never its run folder or ledger rows."""
    root, recipe = reference
    mine = root / "requeue-recipe" / "recipe.toml"  # the module's recipe is shared: this job's own copy
    mine.parent.mkdir(exist_ok=True)
    mine.write_bytes(recipe.read_bytes())
    s = serve(root, "requeue", None).start()
    out = root / "requeue" / "runs" / "j"
    try:
        assert s.cli("submit", str(mine), "--name", "j").returncode == 0
        s.wait(lambda j: j["j"]["state"] == "running" and j["j"]["step"] >= 3)
        assert s.cli("pause", "j", "--hard").returncode == 0
        s.wait(lambda j: j["j"]["state"] == "queued")
        record = (out / "run.json").read_bytes()
        (out / "run.json").write_text("{")  # `ember run` refuses it: the job fails, its checkpoints intact
        assert s.cli("resume", "j").returncode == 0
        failed = s.wait(lambda j: j["j"]["state"] == "failed" and j["j"])
        assert failed["cause"].startswith("error:") and str(out / "run.json") in failed["cause"], failed
        r = s.cli("resume", "j")  # resume lifts holds; it points to requeue
        assert r.returncode == 1 and "`ember requeue j`" in r.stderr, r.stderr
        (out / "run.json").write_bytes(record)
        r = s.cli("requeue", "j")
        assert r.returncode == 0 and "j: queued" in r.stdout and str(out) in r.stdout, (r.stdout, r.stderr)
        s.wait(lambda j: j["j"]["state"] == "completed", timeout=300)
        assert_same_result(out, root / "reference")
        con = connect(s.home / "ledger.db")
        run = find_run(con, str(out))["id"]
        attempts = con.execute("SELECT attempt, resumed_from FROM attempts WHERE run_id = ?", (run,)).fetchall()
        assert len(attempts) == 2 and attempts[-1][1] >= 3, attempts  # one run, resumed from the pause's checkpoint
        assert s.jobs()["j"]["run"] == run
        q = s.cli("queue")
        assert q.returncode == 0 and f"  j: {out} (run {run})" in q.stdout, q.stdout

        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        rows = [con.execute(f"SELECT * FROM {t} WHERE run_id = ?", (run,)).fetchall()
                for t in ("attempts", "events", "checkpoints", "summaries")]
        dry = s.cli("queue", "purge", "--dry-run")
        assert dry.returncode == 0 and "would remove 1 finished job(s)" in dry.stdout and "j (completed)" in dry.stdout
        assert "j" in s.jobs()
        r = s.cli("queue", "purge", "--state", "completed")
        assert r.returncode == 0 and "removed 1 finished job(s)" in r.stdout and f"(run {run})" in r.stdout, r.stdout
        assert "j" not in s.jobs() and "  j: " not in s.cli("queue").stdout
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
        assert find_run(con, str(out))["id"] == run
        assert [con.execute(f"SELECT * FROM {t} WHERE run_id = ?", (run,)).fetchall()
                for t in ("attempts", "events", "checkpoints", "summaries")] == rows
        assert run in run_ember("runs", "--ledger", s.home / "ledger.db").stdout  # the run is still listed
    finally:
        s.stop()


def test_a_second_service_is_refused_naming_the_first(reference, tmp_path):
    root, _ = reference
    s = serve(root, "twice", None).start()
    try:
        r = subprocess.run([sys.executable, "-m", "ember", "serve", "--port", "0"], capture_output=True,
                           text=True, env=s.env, timeout=60)
        assert r.returncode == 1 and f"PID {s.proc.pid}" in r.stderr and "Traceback" not in r.stderr
    finally:
        s.stop()


def test_a_port_in_use_is_a_clear_error_before_anything_starts(tmp_path):
    """A busy port ended `ember serve` in uvicorn's own words after the engine had started (issue
    24, item 14): now it is refused first, naming the port and the settings, exit 1, no traceback;
    no inference engine was started. The same for `ember ui`."""
    import socket
    home = tmp_path / "home"
    home.mkdir()
    (home / "owner.toml").write_text("[inference]\nenabled = true\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for command in ("serve", "ui"):
            r = run_ember(command, "--port", str(port), env={"EMBER_HOME": str(home)}, timeout=120)
            assert r.returncode == 1, (command, r.returncode, r.stderr[-2000:])
            assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr, r.stderr
            assert "another program listens there" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (home / "serve" / "engine.json").exists()  # refused before the engine started


def test_an_edited_owner_toml_holds_at_once_waits_for_a_restart_or_if_invalid_changes_nothing(tmp_path):
    """A running service said "owner rules loaded" for any edit, though [service] and [inference]
    changes waited for a restart, and a file that did not validate showed only in its log (issue
    24, item 10). Now a live key holds at once, a key read at start is reported as waiting (and is
    not applied: the body limit stays), and an invalid file keeps the rules, said by `ember queue`."""
    s = Serve(tmp_path / "home", OWNER.format(root=tmp_path)).start()
    owner = s.home / "owner.toml"
    try:
        owner.write_text(f"[service]\nallowed = ['{tmp_path}']\nmax_body_bytes = 2048\n[inference]\nenabled = false\n"
                         f"[pause]\nhard_after_minutes = 4\n")
        got = wait_until("the edit read", lambda: (o := s.api("GET", "/api/owner").json())["restart"] and o, 30, 0.2)
        assert got["rules"]["pause"]["hard_after_minutes"] == 4 and got["error"] is None
        assert got["restart"] == [{"key": "service.max_body_bytes", "file": 2048, "in_force": 1 << 20}]
        # A body over 2048 bytes is read: the limit the service started with stays until a restart.
        big = s.api("POST", "/api/jobs", {"recipe": str(tmp_path / "none.toml"), "overrides": ["x" * 4000]})
        assert big.status_code == 400 and "no such file" in big.json()["error"]["message"], big.text
        q = s.cli("queue")
        assert q.returncode == 0 and "service.max_body_bytes = 2048 (in force: 1048576)" in q.stderr, q.stderr
        assert "restart it" in q.stderr and "changed, but read only at start" in s.output(), s.output()[-2000:]

        owner.write_text(f"[service]\nallowed = ['{tmp_path}']\n[pause]\nhard_after_minutes = 'soon'\n")
        got = wait_until("the error reported", lambda: (o := s.api("GET", "/api/owner").json())["error"] and o, 30, 0.2)
        assert f"{owner}:4: [pause] hard_after_minutes = 'soon': must be a number" in got["error"], got
        assert got["rules"]["pause"]["hard_after_minutes"] == 4  # the rules before it hold
        q = s.cli("queue")
        assert q.returncode == 0 and "Traceback" not in q.stderr, q.stderr
        assert "warning: owner.toml does not validate, so the service keeps the rules" in q.stderr, q.stderr
        assert "hard_after_minutes = 'soon'" in q.stderr and "`ember owner check`" in q.stderr, q.stderr
    finally:
        s.stop()


def test_owner_rules_window_foreign_load_and_yield(reference, cpu_group):
    """A weekday window keeps a job queued; a foreign busy process soft-pauses it; `ember yield
    --for` returns once its process is gone and it comes back after; the result is exact. The CPU
    rule counts a control group of the test's own ([cpu] cgroup), so that the test's busy loop
    pauses the job and whatever else loads the machine (other tests, a `make demo`) does not."""
    root, recipe = reference
    group, _ = cpu_group
    now = dt.datetime.now()
    day = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")[now.weekday()]
    later = (now + dt.timedelta(hours=2)).strftime("%H:%M") if now.hour < 21 else "23:59"
    closed = f"[schedule]\n{day} = ['{later}-24:00']\n" if now.hour < 21 else f"[schedule]\n{day} = []\n"
    s = serve(root, "owner", None, closed).start()
    busy = None
    try:
        assert s.cli("submit", str(recipe), "--name", "j").returncode == 0
        time.sleep(1.5)
        assert s.jobs()["j"]["state"] == "queued"
        explain = s.cli("serve", "--explain")
        assert explain.returncode == 0 and f"schedule.{day}" in explain.stdout, explain.stdout

        # The owner edits the rules: no window, but pause while others load the CPU.
        # Nothing else runs in the group: any share above 0 is the busy loop's (a share of 0.5 on
        # a quiet machine, 0.1 beside nine other busy threads).
        (s.home / "owner.toml").write_text(OWNER.format(root=root) + "[cpu]\nmax_other_load = 0.02\n"
                                           f"average_seconds = 1\ncgroup = '{group.name}'\n")
        s.wait(lambda j: j["j"]["state"] == "running" and j["j"]["step"] >= 2)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        join(group, busy.pid)
        s.wait(lambda j: j["j"]["state"] == "soft-paused", every=0.05)
        explain = s.cli("serve", "--explain").stdout
        assert f"cpu.max_other_load: group {group.name} uses" in explain and "mean over 1 s" in explain, explain
        busy.kill()
        busy.wait()
        busy = None
        s.wait(lambda j: j["j"]["state"] == "running")

        y = s.cli("yield", "--for", "4s")
        assert y.returncode == 0 and "devices free after" in y.stdout, y.stderr
        pid = s.job_pid("j")
        assert s.jobs()["j"]["state"] == "queued" and (pid is None or not _alive(pid))
        s.wait(lambda j: j["j"]["state"] in ("starting", "running"), timeout=30)
        s.wait(lambda j: j["j"]["state"] == "completed", timeout=300)
        out = root / "owner" / "runs" / "j"
        assert_same_result(out, root / "reference")
        con = connect(s.home / "ledger.db")
        run = find_run(con, str(out))
        kinds = [e["kind"] for e in ledger_events(con, run["id"])]
        assert "pause" in kinds
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        s.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.serial  # inference and training share two cores; the pause latency is measured
def test_inference_during_training_pauses_it_and_is_accounted(reference):
    """Completions through the service while a job trains on the same device: the job soft-pauses
    at a step boundary, resumes after the idle gap, and its report shows paused_for_inference."""
    root, recipe = reference
    owner = OWNER.format(root=root).replace("enabled = false", "seed = 7\nidle_gap_seconds = 1.0")
    s = Serve(root / "infer", owner, None, DELAY).start()
    try:
        s.wait(lambda j: True)
        deadline = time.monotonic() + 120
        while s.http.get("/health", timeout=10, headers=s.auth).status_code != 200:
            assert time.monotonic() < deadline, s.output()[-2000:]
            time.sleep(0.2)
        models = s.http.get("/v1/models", timeout=10, headers=s.auth).json()
        assert models["data"][0]["id"] == "base"
        assert s.cli("submit", str(recipe), "--name", "t").returncode == 0
        s.wait(lambda j: j["t"]["state"] == "running" and j["t"]["step"] >= 3)
        states = []
        for _ in range(4):
            r = s.http.post("/v1/completions", json={"model": "base", "prompt": "In the beginning",
                                                     "max_tokens": 16, "temperature": 0}, timeout=60,
                            headers=s.auth)
            assert r.status_code == 200, r.text
            # The pause takes effect at the job's next step boundary (~0.1 s), after an answer as
            # short as this one (~30 ms): the state right after the answer may still be "running".
            # Watched for until it shows, at most 5 s (the idle gap holds a pause for 1 s).
            until = time.monotonic() + 5.0
            while (state := s.jobs()["t"]["state"]) != "soft-paused" and time.monotonic() < until:
                time.sleep(0.02)
            states.append(state)
        with s.http.stream("POST", "/v1/chat/completions", timeout=60, headers=s.auth,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                 "stream": True}) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
        assert "soft-paused" in states, states
        stats = s.api("GET", "/api/stats").json()["inference"]
        assert stats["requests"] == 6 and stats["pauses"] >= 1  # /v1/models counts as a request too
        assert (stats["idle_gap_seconds"], stats["idle_gap_rule"]) == (1.0, "fixed"), stats
        s.wait(lambda j: j["t"]["state"] == "completed", timeout=300)
        out = root / "infer" / "runs" / "t"
        assert_same_result(out, root / "reference")
        steps = [json.loads(x)["step_seconds"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        # The pause takes effect at the next step boundary: within one step (plus the poll and
        # the service's own reaction), never a whole run of steps.
        assert stats["pause_latency_p99"] <= max(steps) + 1.0, (stats, max(steps))
        report = json.loads(run_ember("report", out, "--json", "--ledger", s.home / "ledger.db").stdout)
        assert report["goodput"]["buckets"]["paused_for_inference"] > 0
        # /api/stats says what the job's own event log says: each pause's latency, asked -> stopped.
        con = connect(s.home / "ledger.db")
        logged = [e["start"] - json.loads(e["detail"])["asked"]
                  for e in ledger_events(con, find_run(con, str(out))["id"]) if e["kind"] == "pause_inference"]
        final = s.api("GET", "/api/stats").json()["inference"]
        assert final["pauses"] == len(logged) >= 1, (final, logged)
        for q in (50, 99):
            assert abs(final[f"pause_latency_p{q}"] - percentile(logged, q)) < 1e-6, (q, final, logged)
    finally:
        s.stop()


def test_upstream_llama_cpp_server_behind_the_service(reference, tmp_path):
    """[inference] upstream: requests reach the real llama.cpp server (SmolLM2-135M GGUF)
    unchanged and stream back through ember, which counts each one in flight."""
    import httpx

    from tests.engines import llama_server
    root, _ = reference
    with llama_server(tmp_path) as upstream:
        owner = OWNER.format(root=root).replace("enabled = false", f'upstream = "{upstream}"')
        s = Serve(root / "upstream", owner, None, {}).start()
        try:
            assert s.http.get("/health", timeout=30, headers=s.auth).status_code == 200
            direct = httpx.post(upstream + "/v1/completions", timeout=60,
                                json={"prompt": "In the beginning", "max_tokens": 8, "temperature": 0})
            proxied = s.http.post("/v1/completions", timeout=60, headers=s.auth,
                                  json={"prompt": "In the beginning", "max_tokens": 8, "temperature": 0})
            assert proxied.status_code == 200
            assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
            with s.http.stream("POST", "/v1/chat/completions", timeout=60, headers=s.auth,
                               json={"messages": [{"role": "user", "content": "Say hello."}],
                                     "max_tokens": 8, "stream": True}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                lines = [x for x in r.iter_lines() if x]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 3
            bad = s.http.post("/v1/completions", content=b"{oops", timeout=30,
                              headers={"content-type": "application/json", **s.auth})
            assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]  # never forwarded
            anonymous = s.http.post("/v1/completions", timeout=30, json={"prompt": "In", "max_tokens": 1})
            assert anonymous.status_code == 401 and "API key" in anonymous.json()["error"]["message"]  # never forwarded
            assert s.api("GET", "/api/stats").json()["inference"]["requests"] == 2
            # said at start-up, and like every line of the service's log, after the local time
            assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d every request needs the token", s.output(), re.M), \
                s.output()[:2000]
        finally:
            s.stop()


def test_a_recipe_edited_after_submit_trains_as_admitted_and_the_ledger_names_the_job(tmp_path):
    """The service snapshots the recipe at admission (ember.launchspec): an edit to the file after
    `ember submit` never reaches the job, which trains what was admitted and planned; the run's
    attempts name the job and the devices it was given."""
    recipe = write_recipe(tmp_path / "recipe", train={"max_steps": 4})
    s = serve(tmp_path, "snap", "sim:1x4MiB").start()
    try:
        assert s.cli("yield", "--for", "1h").returncode == 0  # hold while the job queues
        assert s.cli("submit", str(recipe), "--name", "snap").returncode == 0
        write_recipe(tmp_path / "recipe", train={"max_steps": 9})  # edited after submit
        assert s.cli("yield", "--release").returncode == 0
        job = s.wait(lambda j: j["snap"]["state"] in ("completed", "failed") and j["snap"])
        assert job["state"] == "completed", s.output()[-3000:]
        out = tmp_path / "snap" / "runs" / "snap"
        assert [step for step, _ in losses(out)] == [1, 2, 3, 4]
        con = sqlite3.connect(tmp_path / "snap" / "ledger.db")
        attempts = con.execute("SELECT job, devices FROM attempts").fetchall()
        con.close()
        assert attempts == [(job["id"], "sim:0")], attempts
    finally:
        s.stop()
