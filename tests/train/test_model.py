"""Loading a Hugging Face model folder (ember.train.model.load_model): a folder whose weights are
damaged is refused by name, saying what to do, as ember's own error (the CLI prints
it without a traceback), not a library's exception."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ember.errors import EmberError
from ember.recipe import MethodConfig, ModelConfig
from ember.train.model import load_model
from tests.helpers import run_ember, write_recipe


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Llama with a byte-level BPE tokenizer trained on a few words (no model hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["in the beginning"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-hf")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 eos_token_id=fast.eos_token_id)).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def damaged(folder: Path, tmp_path: Path, name: str, damage) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    (copy / name).write_bytes(damage((copy / name).read_bytes()))
    return copy


DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "header length": lambda data: b"\xff" * 8 + data[8:],
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_weights_are_refused_naming_the_folder(tiny_folder, tmp_path, damage):
    model = damaged(tiny_folder, tmp_path, "model.safetensors", DAMAGE[damage])
    with pytest.raises(EmberError, match=f"\\[model\\] path = '{model}'.*weights.*damaged"):
        load_model(ModelConfig(str(model)), MethodConfig(), False)


def test_ember_run_on_truncated_weights_exits_1_without_a_traceback(tiny_folder, tmp_path):
    model = damaged(tiny_folder, tmp_path, "model.safetensors", DAMAGE["truncated"])
    recipe = write_recipe(tmp_path, model={"path": str(model)}, train={"max_steps": 2})
    result = run_ember("run", recipe, "--out", tmp_path / "run", "--no-ledger", timeout=180)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "damaged" in result.stderr, result.stderr[-2000:]


def test_a_config_json_that_does_not_describe_the_weights_is_refused_saying_so(tiny_folder, tmp_path):
    import json
    model = damaged(tiny_folder, tmp_path, "config.json",
                    lambda data: json.dumps({**json.loads(data), "hidden_size": 48}).encode())
    with pytest.raises(EmberError, match=f"\\[model\\] path = '{model}'.*config.json does not describe its weights"):
        load_model(ModelConfig(str(model)), MethodConfig(), False)
