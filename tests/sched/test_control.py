"""The soft-pause files between the service and a training process."""

import threading
import time

from ember import control
from ember.control import PausePoint


def test_pause_waits_until_lifted_and_reports_its_reason(tmp_path):
    released = []
    point = PausePoint(tmp_path, lambda: False, lambda: released.append(1))
    assert point.check() is None  # no file: one stat, nothing else
    seq = control.request(tmp_path, "inference")
    result = []
    waiter = threading.Thread(target=lambda: result.append(point.check()), daemon=True)
    waiter.start()
    # Lifted 0.3 s after the waiter said it paused, not 0.3 s after the request: on a loaded
    # machine the thread once began its check() after a timer had lifted the pause already, and
    # found nothing to pause for (a `make test` run beside the suite).
    deadline = time.monotonic() + 60
    while (control.acknowledged(tmp_path) or {}).get("state") != "paused":
        assert time.monotonic() < deadline, f"no 'paused' acknowledgement in 60 s: {control.acknowledged(tmp_path)}"
        time.sleep(0.01)
    time.sleep(0.3)
    control.request(tmp_path, None)
    waiter.join(timeout=60)  # returns once lifted; 60 s is 200x the 0.3 s it was paused
    assert result, "the pause was lifted, but check() had not returned 60 s later"
    held = result[0]
    assert held is not None and held.kind == "pause_inference" and held.end - held.start >= 0.25
    assert released == [1]
    ack = control.acknowledged(tmp_path)
    assert ack["state"] == "running" and ack["seq"] == seq + 1
    assert point.check() is None  # unchanged file: nothing to do


def test_a_stop_request_ends_a_pause(tmp_path):
    stop = threading.Event()
    point = PausePoint(tmp_path, stop.is_set, lambda: None)
    control.request(tmp_path, "owner")
    threading.Timer(0.2, stop.set).start()
    held = point.check()
    assert held.kind == "pause" and held.reason == "owner"


def test_asking_the_same_twice_writes_once(tmp_path):
    a = control.request(tmp_path, "user")
    assert control.request(tmp_path, "user") == a
    assert control.request(tmp_path, None) == a + 1
    assert control.requested(tmp_path) is None


def test_without_a_control_folder_the_check_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv(control.ENV, raising=False)
    assert control.from_environment() is None
    assert PausePoint(None, lambda: False, lambda: None).check() is None
    monkeypatch.setenv(control.ENV, str(tmp_path))
    assert control.from_environment() == tmp_path
