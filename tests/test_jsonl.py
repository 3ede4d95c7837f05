"""JSON lines as ember reads them: the fast parser, with the standard library's NaN and Infinity."""

import json
import math

import pytest

from ember.errors import EmberError
from ember.jsonl import loads, read_jsonl


def test_nan_infinity_and_big_integers_read_as_the_standard_library_writes_them(tmp_path):
    rows = [{"step": 1, "loss": float("nan")}, {"step": 2, "loss": float("inf"), "grad_norm": -float("inf")},
            {"step": 3, "loss": 2.5, "tokens": 2 ** 70}, {"step": 4, "loss": 0.1 + 0.2, "lr": 1e-310}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')  # a torn last line
    notes: list[str] = []
    back = read_jsonl(path, notes)
    assert [r["step"] for r in back] == [1, 2, 3, 4] and notes and "torn last line" in notes[0]
    assert math.isnan(back[0]["loss"]) and back[1]["loss"] == math.inf and back[1]["grad_norm"] == -math.inf
    assert back[2]["tokens"] == 2 ** 70 and back[3] == rows[3]  # floats exactly as written
    assert loads(b'{"a": [1, 2.5, null, true]}') == {"a": [1, 2.5, None, True]}


def test_a_bad_line_in_the_middle_is_corruption(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(EmberError, match=r"m.jsonl:2: corrupted"):
        read_jsonl(path)


def test_a_line_nested_too_deeply_is_corruption_not_a_crash(tmp_path):
    """orjson refuses nesting past 1024 levels and the standard library's fallback recurses once
    per level: such a line reads as any bad line, never as a RecursionError."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"step": 3}\n')
    with pytest.raises(EmberError, match=r"m.jsonl:2: corrupted"):
        read_jsonl(path)


@pytest.mark.parametrize("line", ["null", "[1, 2]", "3", '"step"'])
def test_a_line_that_is_json_but_not_an_object_is_corruption(tmp_path, line):
    """Every line ember appends is an object: `ember report` once met a `null` line with a
    TypeError traceback."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n' + line + '\n{"step": 3}\n')
    with pytest.raises(EmberError, match=r"m.jsonl:2: corrupted \(not a JSON object\)"):
        read_jsonl(path)
