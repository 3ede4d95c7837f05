"""Where a model comes from (ember.models): odd `[model] path` values and impossible config.json
sizes are refused by name, saying what to do, before anything computes with them; a GGUF file is
converted even when two processes start on it together."""

from __future__ import annotations

import json
import re

import pytest

from ember import models
from ember.errors import EmberError
from ember.events import Events
from tests.helpers import run_ember, write_recipe


@pytest.mark.parametrize("spec", ["package:", "package::model.gguf"])
def test_a_package_spec_naming_no_distribution_is_refused_by_name(spec, tmp_path):
    with pytest.raises(EmberError, match=f"path = '{spec}': names no package; write 'package:DIST:FILE'"):
        models.resolve_path(spec)
    result = run_ember("plan", write_recipe(tmp_path, model={"path": spec}))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "names no package" in result.stderr


def test_a_gguf_another_process_converted_meanwhile_is_used_not_refused(tmp_path, monkeypatch):
    """Two runs (or a run and the inference worker) that start on a new .gguf file both convert it;
    the second to finish finds the first one's folder in place, the same by the file's hash."""
    gguf, sha = tmp_path / "twice.gguf", "5e" * 32
    gguf.write_bytes(models.GGUF_MAGIC + bytes(60))
    target = models.home().models / f"twice-{sha[:16]}"

    def convert(source, tmp):  # this process converts; meanwhile the other renames its folder into place
        (tmp / "config.json").write_text('{"by": "this process"}')
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"by": "the other"}')
    monkeypatch.setattr(models, "_convert", convert)
    assert models.convert_gguf(gguf, sha, Events()) == target
    assert (target / "config.json").read_text() == '{"by": "the other"}'
    assert not list(target.parent.glob(".tmp-twice-*"))


def test_a_gguf_of_an_architecture_transformers_does_not_convert_is_not_called_damaged(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(path, "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EmberError) as refused:
        models.model_folder(str(path))
    assert "rwkv6" in str(refused.value) and "Hugging Face folder" in str(refused.value)
    assert "download it again" not in str(refused.value)


@pytest.mark.parametrize("field, value", [("hidden_size", "big"), ("num_hidden_layers", 0), ("vocab_size", 2.5),
                                          ("num_attention_heads", -4), ("intermediate_size", True)])
def test_a_config_json_with_an_impossible_shape_is_refused_naming_the_field(tmp_path, field, value):
    folder = tmp_path / "model"
    folder.mkdir()
    shape = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps({**shape, field: value}))
    with pytest.raises(EmberError, match=f"config.json has {field} = {re.escape(repr(value))}: .*positive whole number"):
        models.config_fields(str(folder))
    result = run_ember("plan", write_recipe(tmp_path, model={"path": str(folder)}))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"config.json has {field}" in result.stderr
