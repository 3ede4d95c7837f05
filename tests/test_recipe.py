"""Recipe loading and validation: every bad input is rejected before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.recipe import OPERATIONAL_KEYS, SECTIONS, DataFormat, Strategy, diff_recipes, explain, load_recipe

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
[data]
files = ["d.jsonl"]
[train]
max_steps = 10
"""

BAD = [
    # (recipe text, overrides, expected message fragments)
    ("[trian]\nmax_steps = 3", [], ["unknown section [trian]", "did you mean 'train'"]),
    ("[train]\nmax_step = 3", [], ["unknown key 'max_step' in [train]", "did you mean 'max_steps'"]),
    ("[train]\nmax_steps = 0", [], ["[train] max_steps = 0", "must be >= 1"]),
    ("[train]\nmax_steps = 'ten'", [], ["[train] max_steps = 'ten'", "must be an integer"]),
    ("[train]\nmax_steps = 2.5", [], ["must be an integer"]),
    ("[train]\nmicro_batch = true", [], ["[train] micro_batch = True", "must be an integer"]),
    ("[optimizer]\nlr = 0", [], ["[optimizer] lr = 0.0", "must be > 0"]),
    ("[optimizer]\nlr = -1e-3", [], ["must be > 0"]),
    ("[optimizer]\nbeta2 = 1.5", [], ["[optimizer] beta2 = 1.5", "must be <= 0.999999"]),
    ("[optimizer]\nlr = nan", [], ["must be a finite number"]),
    ("[precision]\nmode = 'fp8'", [], ["[precision] mode = 'fp8'", "'fp32', 'bf16', 'fp16'"]),
    ("[method]\nkind = 'qlora'", [], ["[method] kind = 'qlora'", "'full', 'lora'"]),
    ("[method]\ntarget_modules = 'q_proj'", [], ["target_modules = 'q_proj'", "must be a list of str"]),
    ("[method]\ntarget_modules = [1]", [], ["target_modules[0] = 1", "must be a string"]),
    ("[method]\ndropout = 0.95", [], ["must be <= 0.9"]),
    ("[data]\nseq_len = 1", [], ["[data] seq_len = 1", "must be >= 2"]),
    ("[train]\nseed = 4294967296", [], ["[train] seed = 4294967296", "must be <= 4294967295"]),
    ("[data]\nfiles = []", [], ["[data] files is empty"]),
    ("[checkpoint]\nkeep_last = 0", [], ["[checkpoint] keep_last = 0", "must be >= 1"]),
    ("[schedule]\nkind = 'step'", [], ["'cosine', 'linear', 'constant'"]),
    ("train = 3", [], ["'train' must be a [train] table"]),
    ("[train\nmax_steps = 3", [], ["not valid TOML"]),
    ("", ["train.max_steps=-5"], ["[train] max_steps = -5", "must be >= 1"]),
    ("", ["train.maxsteps=5"], ["unknown key 'maxsteps'", "did you mean 'max_steps'"]),
    ("", ["max_steps=5"], ["expected section.key=value"]),
    ("", ["optimiser.lr=1"], ["unknown section [optimiser]", "did you mean 'optimizer'"]),
]


@pytest.mark.parametrize("text,overrides,fragments", BAD)
def test_bad_recipe_is_rejected_with_a_message_naming_file_key_and_value(tmp_path, text, overrides,
                                                                          fragments):
    path = tmp_path / "bad.toml"
    path.write_text(text + ("" if "[data]" in text else "\n[data]\nfiles = ['d.jsonl']\n"))
    with pytest.raises(EmberError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert str(path) in message or "--set" in message
    for fragment in fragments:
        assert fragment in message


def test_missing_recipe_file(tmp_path):
    with pytest.raises(EmberError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.toml")


def test_overrides_apply_typed_values_and_paths_resolve_beside_the_recipe(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(GOOD)
    recipe = load_recipe(path, ["train.max_steps=200", "optimizer.lr=2e-4", "method.kind=lora",
                                "train.activation_checkpointing=true", "model.path=builtin:tiny"])
    assert recipe.train.max_steps == 200 and recipe.optimizer.lr == 2e-4
    assert recipe.method.kind == "lora" and recipe.train.activation_checkpointing is True
    assert recipe.data.files == [str(tmp_path / "d.jsonl")]


def test_digest_changes_with_any_field_and_diff_names_the_keys(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(GOOD)
    a, b = load_recipe(path), load_recipe(path, ["schedule.warmup_steps=3", "data.workers=2"])
    assert a.digest() == load_recipe(path).digest() and a.digest() != b.digest()
    changed = diff_recipes(a.to_dict(), b.to_dict())
    assert changed == ["data.workers", "schedule.warmup_steps"]
    assert "data.workers" in OPERATIONAL_KEYS and "schedule.warmup_steps" not in OPERATIONAL_KEYS


def test_every_setting_is_documented():
    """Each field has help text, and docs/recipe.md lists every key."""
    docs = (ROOT / "docs" / "recipe.md").read_text()
    rows = explain()
    assert len(rows) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    for key, _type, _default, help_text in rows:
        assert help_text.strip(), key
        assert f"`{key}`" in docs, f"{key} missing from docs/recipe.md"


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.toml")))
def test_examples_are_valid(example):
    load_recipe(example)


def write_recipe_file(folder: Path, text: str = "") -> Path:
    """GOOD, with `text` appended (TOML allows a section only once: use sections GOOD lacks)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "r.toml"
    path.write_text(GOOD.replace("[train]\nmax_steps = 10\n", "") + text
                    + ("" if "[train]" in text else "[train]\nmax_steps = 10\n"))
    return path


def test_to_toml_reads_back_to_the_same_recipe(tmp_path):
    r = load_recipe(write_recipe_file(tmp_path, '[method]\nkind = "lora"\ntarget_modules = ["q_proj"]\n'
                                      '[checkpoint]\nevery_seconds = "auto"\nasync = false\n'))
    again = tmp_path / "again.toml"
    again.write_text(r.to_toml())
    assert load_recipe(again).to_dict() == r.to_dict()
    assert load_recipe(again).digest() == r.digest()


def test_to_toml_reads_back_text_beyond_the_basic_multilingual_plane(tmp_path):
    """A data file named with an emoji, or an eval prompt holding one, was written as JSON's
    surrogate escapes ("\\ud83d\\ude00"), which TOML refuses: the service's
    recipe snapshot, preflight's and repro's recipes could not be read back ("not a Unicode
    scalar value")."""
    path = tmp_path / "r.toml"
    path.write_text('[data]\nfiles = ["😀 data.jsonl"]\n[eval]\nholdout = 0.1\nprompts = ["Say 👋", "a\\u007fb"]\n')
    r = load_recipe(path)
    again = tmp_path / "again.toml"
    again.write_text(r.to_toml())
    assert load_recipe(again).to_dict() == r.to_dict()
    assert r.eval.prompts == ["Say 👋", "a\x7fb"] and r.data.files[0].endswith("😀 data.jsonl")


def test_with_changes_validates_like_a_recipe_file(tmp_path):
    r = load_recipe(write_recipe_file(tmp_path))
    changed = r.with_changes({"train.micro_batch": 2, "checkpoint.async": False})
    assert changed.train.micro_batch == 2 and changed.checkpoint.async_ is False
    assert r.train.micro_batch != 2  # the original is untouched
    with pytest.raises(EmberError, match=r"\[train\] micro_batch = 0: must be >= 1"):
        r.with_changes({"train.micro_batch": 0})
    with pytest.raises(EmberError, match="unknown key 'micro_batc'"):
        r.with_changes({"train.micro_batc": 2})


def test_settings_users_get_wrong_are_warned_with_the_reason(tmp_path):
    import os
    warnings: list[str] = []
    path = write_recipe_file(tmp_path, '[method]\nrank = 4\n[schedule]\nwarmup_steps = 500\n'
                             f'[train]\nmax_steps = 100\nthreads = {(os.cpu_count() or 1) + 1}\n')
    load_recipe(path, [], warnings.append)
    assert any("warmup_steps = 500 is not shorter than the run" in w for w in warnings)
    assert any("[method] rank set, but kind = 'full'" in w for w in warnings)
    assert any("more than this machine's" in w for w in warnings)
    warnings.clear()
    load_recipe(write_recipe_file(tmp_path / "ok"), [], warnings.append)
    assert warnings == []


def test_integers_beyond_64_bits_are_refused(tmp_path):
    with pytest.raises(EmberError, match="max_steps = 99999999999999999999999"):
        load_recipe(write_recipe_file(tmp_path), ["train.max_steps=99999999999999999999999"])


def test_strategy_and_data_format_are_strenums_written_as_before(tmp_path):
    """[distributed] strategy and [data] format parse to their StrEnums, which compare equal to
    the strings; the recipe's TOML, digest and error messages stay as they were."""
    r = load_recipe(write_recipe_file(tmp_path), ["distributed.strategy='fsdp+tp'", "data.format='chat'"])
    assert r.distributed.strategy is Strategy.FSDP_TP and r.distributed.strategy == "fsdp+tp"
    assert r.data.format is DataFormat.CHAT and f"{r.data.format}" == "chat"
    assert 'strategy = "fsdp+tp"' in r.to_toml() and 'format = "chat"' in r.to_toml()
    plain = dataclasses.replace(r, distributed=dataclasses.replace(r.distributed, strategy="fsdp+tp"),
                                data=dataclasses.replace(r.data, format="chat"))
    assert plain.digest() == r.digest()
    choices = r"'ddp', 'fsdp', 'tp', 'fsdp\+tp', 'pp', 'pp\+ddp'$"
    with pytest.raises(EmberError, match=r"strategy = 'zero3': must be one of " + choices):
        load_recipe(write_recipe_file(tmp_path), ["distributed.strategy='zero3'"])
    with pytest.raises(EmberError, match="must be one of 'auto', 'text', 'chat', 'completion'"):
        load_recipe(write_recipe_file(tmp_path), ["data.format='csv'"])
    assert ("distributed.strategy", "'ddp' | 'fsdp' | 'tp' | 'fsdp+tp' | 'pp' | 'pp+ddp'", '"ddp"') == \
        next(row[:3] for row in explain() if row[0] == "distributed.strategy")
