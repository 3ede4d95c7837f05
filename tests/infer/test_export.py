"""`ember export`: each format loads in the engine it is for and computes the logits of the model
ember trained, within a tolerance per format; bad input is refused by name and writes nothing.

The model is a tiny random Llama (hidden 64, 2 layers, tied embeddings) with SmolLM2's real
tokenizer, so llama.cpp can load it; the runs train it for 3 steps at a high learning rate, so the
trained logits are far from the base's (an export that dropped the training would fail).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from ember.errors import EmberError
from ember.events import collect
from ember.infer.export import export_run
from ember.models import resolve_path
from ember.paths import cached_sha256
from tests.engines import SMOLLM2_GGUF, require_llama_cpp
from tests.gguf_files import gguf_parses
from tests.helpers import run_ember, write_recipe

IDS = [100, 2000, 345, 17, 9000, 42, 7, 31000, 5, 48000]
# Tolerances on the max absolute logit difference (logits here are up to about 1.6), about 5x the
# maxima measured: f32 through transformers/peft 3e-7 (the merge's rounding; peft 0); llama.cpp f32
# 6e-5 (its own kernels: summation order, RoPE tables); f16 weights 3e-4 (transformers, peft) and
# 4e-4 (llama.cpp). GGUF without the Q/K re-ordering is off by 1e-2: both GGUF tolerances catch it.
F32_TOL, F16_TOL, GGUF_F32_TOL, GGUF_F16_TOL = 1e-5, 2e-3, 5e-4, 2e-3
TRAINED_AT_LEAST = 0.1  # how far 3 steps move the logits from the base's, at least


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    gguf = resolve_path(SMOLLM2_GGUF)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: mit\nlanguage:\n- en\n---\n# A tiny Llama\n")  # a model card
    return folder


@pytest.fixture(scope="module")
def smollm2_fields() -> dict:
    import gguf
    return gguf.GGUFReader(resolve_path(SMOLLM2_GGUF)).fields  # opening it takes seconds: once


def train(root: Path, model: Path, kind: str) -> Path:
    lora = {"kind": "lora", "rank": 4, "alpha": 32} if kind != "full" else {"kind": "full"}
    if kind == "qlora":
        lora["quantize"] = "nf4"
    recipe = write_recipe(root / f"recipe-{kind}", model={"path": str(model)}, method=lora,
                          optimizer={"lr": 2e-2}, schedule={"warmup_steps": 0},
                          train={"max_steps": 3, "micro_batch": 2, "seed": 7, "threads": 1},
                          checkpoint={"every_steps": 100})
    result = run_ember("run", recipe, "--out", root / kind, "--no-ledger", timeout=180)
    assert result.returncode == 0, result.stderr
    return root / kind


@pytest.fixture(scope="module")
def lora_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs"), tiny_llama, "lora")


@pytest.fixture(scope="module")
def qlora_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs"), tiny_llama, "qlora")


@pytest.fixture(scope="module")
def full_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs"), tiny_llama, "full")


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([IDS])).logits[0].float()


def base_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def trained_logits(run: Path, base: Path) -> torch.Tensor:
    """What ember trained, computed the way training did: the base with the adapter unmerged
    (LoRA), or the final weights (full)."""
    from peft import PeftModel
    if (run / "final" / "adapter_config.json").is_file():
        return logits(PeftModel.from_pretrained(base_model(base), run / "final"))
    return logits(base_model(run / "final"))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("dtype, tol", [("f32", F32_TOL), ("f16", F16_TOL)])
def test_hf_export_of_a_lora_run_is_the_merged_model(lora_run, tiny_llama, tmp_path, dtype, tol):
    from transformers import AutoTokenizer
    out = export_run(lora_run, "hf", tmp_path / "hf", dtype)
    assert out.kind == "lora" and Path(out.path) == tmp_path / "hf"
    assert not (tmp_path / "hf" / "adapter_config.json").exists()  # merged, not an adapter
    want = trained_logits(lora_run, tiny_llama)
    assert max_diff(want, logits(base_model(tiny_llama))) > TRAINED_AT_LEAST
    assert max_diff(logits(base_model(tmp_path / "hf")), want) < tol
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("In the beginning")["input_ids"] == \
        AutoTokenizer.from_pretrained(tiny_llama)("In the beginning")["input_ids"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True  # for inference


def test_hf_export_of_a_full_run_is_its_trained_weights(full_run, tiny_llama, tmp_path):
    export_run(full_run, "hf", tmp_path / "hf16", "f16")
    assert json.loads((full_run / "final" / "config.json").read_text())["use_cache"] is False  # as trained
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["use_cache"] is True
    want = trained_logits(full_run, tiny_llama)
    assert max_diff(want, logits(base_model(tiny_llama))) > TRAINED_AT_LEAST
    assert max_diff(logits(base_model(tmp_path / "hf16")), want) < F16_TOL


def test_peft_export_loads_on_the_base_it_names(lora_run, tiny_llama):
    from peft import PeftModel
    out = Path(export_run(lora_run, "peft").path)
    assert out == lora_run / "export" / "peft"  # the default --out
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == tiny_llama.resolve()
    got = logits(PeftModel.from_pretrained(base_model(Path(base)), out))
    assert max_diff(got, trained_logits(lora_run, tiny_llama)) < F32_TOL


def qlora_trained_logits(run: Path, base: Path) -> torch.Tensor:
    """What a QLoRA run trained, computed as training did: the adapter unmerged over the base
    quantized to 4 bits."""
    from peft import PeftModel
    from ember.train.quantize import quantize_base
    model = base_model(base)
    quantize_base(model)
    return logits(PeftModel.from_pretrained(model, run / "final"))


def test_hf_export_of_a_qlora_run_is_the_adapter_merged_into_the_dequantized_base(qlora_run, tiny_llama, tmp_path):
    import bitsandbytes.functional as bnbf
    from safetensors.torch import load_file
    out = export_run(qlora_run, "hf", tmp_path / "hf", "f32")
    assert out.kind == "lora" and not (tmp_path / "hf" / "adapter_config.json").exists()
    exported = base_model(tmp_path / "hf").state_dict()
    base = base_model(tiny_llama).state_dict()
    adapter = load_file(qlora_run / "final" / "adapter_model.safetensors")
    scale = 32 / 4  # alpha / rank
    for name, w in base.items():
        key = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{key}.lora_A.weight" in adapter:  # every decoder linear: 4-bit in training
            codes, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            want = bnbf.dequantize_4bit(codes, state) + adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"] * scale
            torch.testing.assert_close(exported[name], want, rtol=0, atol=1e-6)
        else:  # embeddings, norms: the base's own
            assert torch.equal(exported[name], w), name
    want = qlora_trained_logits(qlora_run, tiny_llama)
    assert max_diff(want, logits(base_model(tiny_llama))) > TRAINED_AT_LEAST
    assert max_diff(logits(base_model(tmp_path / "hf")), want) < F32_TOL
    # and not the adapter merged into the fp32 base (what a plain LoRA export would write)
    assert max_diff(logits(base_model(tmp_path / "hf")), trained_logits(qlora_run, tiny_llama)) > 10 * F32_TOL
    step = export_run(qlora_run, "hf", tmp_path / "ckpt", "f32", checkpoint="last")  # a checkpoint's: the same merge
    assert max_diff(logits(base_model(Path(step.path))), want) < F32_TOL


def test_gguf_export_of_a_qlora_run_has_the_trained_logits(qlora_run, tiny_llama):
    require_llama_cpp()
    path = Path(export_run(qlora_run, "gguf", dtype="f32").path)
    assert max_diff(llama_logits(path), qlora_trained_logits(qlora_run, tiny_llama)) < GGUF_F32_TOL


def llama(path: Path):
    from llama_cpp import Llama
    return Llama(str(path), logits_all=True, n_ctx=64, verbose=False)


def llama_logits(path: Path) -> torch.Tensor:
    model = llama(path)
    model.eval(IDS)
    return torch.tensor(np.array(model.scores[:len(IDS)]))


@pytest.mark.parametrize("dtype, tol", [("f32", GGUF_F32_TOL), ("f16", GGUF_F16_TOL)])
def test_gguf_export_runs_in_llama_cpp_with_the_trained_logits(lora_run, tiny_llama, dtype, tol):
    require_llama_cpp()
    from transformers import AutoTokenizer
    path = Path(export_run(lora_run, "gguf", dtype=dtype).path)
    assert path == lora_run / "export" / f"model-{dtype}.gguf"
    assert max_diff(llama_logits(path), trained_logits(lora_run, tiny_llama)) < tol
    text = "In the beginning God created the heaven and the earth, 1234 times."
    done = llama(path).create_completion(text, max_tokens=3, temperature=0)
    assert done["usage"]["completion_tokens"] >= 1
    # the tokenizer went in whole: llama.cpp splits text as the Hugging Face tokenizer does
    assert llama(path).tokenize(text.encode(), add_bos=False) == \
        AutoTokenizer.from_pretrained(tiny_llama)(text)["input_ids"]


def test_gguf_of_a_full_run_and_its_tokenizer_tables_match_smollm2s_own(full_run, tiny_llama, tmp_path,
                                                                         smollm2_fields):
    """The tokenizer built from the HF folder has the very tokens, types and merges of the GGUF
    that HF tokenizer came from."""
    import gguf
    require_llama_cpp()
    path = Path(export_run(full_run, "gguf", tmp_path / "m.gguf", "f32").path)
    assert max_diff(llama_logits(path), trained_logits(full_run, tiny_llama)) < GGUF_F32_TOL
    ours, theirs = gguf.GGUFReader(path).fields, smollm2_fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.model", "tokenizer.ggml.eos_token_id"):
        assert ours[key].contents() == theirs[key].contents(), key
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}  # tied: token_embd
    # general.*: from the base folder's model card and its name
    assert ours["general.license"].contents() == "mit" and ours["general.languages"].contents() == ["en"]
    assert ours["general.name"].contents() == tiny_llama.name


def test_gguf_of_a_run_from_a_gguf_copies_its_tokenizer(lora_run, tmp_path, smollm2_fields):
    """A run whose base came from a GGUF file: the tokenizer.* metadata is that file's, unchanged
    (the record is edited to say so; the weights are the tiny model's, of the same vocabulary)."""
    import gguf
    require_llama_cpp()
    from llama_cpp import Llama
    run = tmp_path / "from-gguf"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("export"))
    record = json.loads((run / "run.json").read_text())
    source = resolve_path(SMOLLM2_GGUF)
    record["model"].update(kind="gguf", path=str(source), sha256=cached_sha256(source))
    (run / "run.json").write_text(json.dumps(record))
    with gguf_parses() as parses:
        path = Path(export_run(run, "gguf").path)
    assert parses[0] == 1  # the source's general.* and tokenizer.* from one parse (two before)
    ours, theirs = gguf.GGUFReader(path).fields, smollm2_fields
    keys = sorted(k for k in theirs if k.startswith("tokenizer."))
    assert "tokenizer.ggml.pre" in keys and sorted(k for k in ours if k.startswith("tokenizer.")) == keys
    for key in keys:
        assert ours[key].contents() == theirs[key].contents(), key
    assert llama(path).tokenize(b"Hello 12345", add_bos=False) == \
        Llama(str(source), vocab_only=True, verbose=False).tokenize(b"Hello 12345", add_bos=False)
    # general.*: the source's, but for what describes the file (its type, quantization)
    assert ours["general.name"].contents() == theirs["general.name"].contents() == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert ours["general.license"].contents() == "apache-2.0"
    for key in ("general.organization", "general.basename", "general.size_label", "general.languages"):
        assert ours[key].contents() == theirs[key].contents(), key
    assert ours["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32 != theirs["general.file_type"].contents()
    assert "general.quantization_version" not in ours


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_exported_files_have_ordinary_modes_under_the_umask(lora_run, tmp_path, mask):
    """safetensors writes 0600; an export gets what any file written under the umask gets."""
    require_llama_cpp()
    old = os.umask(mask)
    try:
        outs = [Path(export_run(lora_run, fmt, tmp_path / name).path)
                for fmt, name in (("hf", "hf"), ("peft", "peft"), ("gguf", "m.gguf"))]
    finally:
        os.umask(old)
    for out in outs:
        for p in [out, *out.rglob("*")]:
            want = (0o777 if p.is_dir() else 0o666) & ~mask
            assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


def test_q_and_k_rows_are_reordered_into_rotary_pairs():
    from ember.infer.gguf_export import pairs_from_halves
    rows = torch.arange(8.0).unsqueeze(1)  # 2 heads of 4 rows: halves (0,1|2,3) -> pairs (0,2,1,3)
    assert pairs_from_halves(rows, 2).squeeze(1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_refusals_say_what_where_and_what_to_do(lora_run, full_run, tmp_path):
    with pytest.raises(EmberError, match="not an ember run folder"):
        export_run(tmp_path, "hf")
    with pytest.raises(EmberError, match="unknown; choose one of hf, peft, gguf"):
        export_run(lora_run, "onnx")
    with pytest.raises(EmberError, match="--dtype 'bf16': unknown"):
        export_run(lora_run, "hf", dtype="bf16")
    with pytest.raises(EmberError, match="full fine-tuning run.*--format hf.*--format gguf"):
        export_run(full_run, "peft")
    (tmp_path / "taken").mkdir()
    with pytest.raises(EmberError, match="already exists"):
        export_run(lora_run, "hf", tmp_path / "taken")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(lora_run, unfinished, ignore=shutil.ignore_patterns("export", "final"))
    with pytest.raises(EmberError, match="has not completed.*run the same `ember run`"):
        export_run(unfinished, "hf")


def test_gguf_refuses_what_it_cannot_write_faithfully():
    from transformers import GPT2Config, LlamaConfig

    from ember.infer.export import TrainedRun, gguf_tokenizer_source
    from ember.infer.gguf_export import check_llama
    with pytest.raises(EmberError, match="'gpt2' model.*Llama family only"):
        check_llama(GPT2Config())
    scaled = LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with pytest.raises(EmberError, match="'llama3' RoPE scaling"):
        check_llama(scaled)
    with pytest.raises(EmberError, match="byte-level tokenizer.*--format hf"):
        gguf_tokenizer_source(TrainedRun(Path("r"), {}, "lora", "builtin:tiny"))


def test_a_failed_export_leaves_nothing_behind(lora_run, tmp_path, monkeypatch):
    from ember.infer import export

    def half_written(trained, tmp, dtype, events):
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")
    monkeypatch.setattr(export, "write_hf", half_written)
    with pytest.raises(OSError, match="No space"):
        export_run(lora_run, "hf", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_the_result_or_the_error_without_a_traceback(lora_run, full_run, tmp_path, capsys):
    from ember.cli.main import build_parser, main
    assert "export" in build_parser().format_help()
    assert main(["export", str(full_run), "--format", "peft"]) == 1
    err = capsys.readouterr().err
    assert "full fine-tuning run" in err and "Traceback" not in err
    assert main(["export", str(lora_run), "--format", "peft", "--out", str(tmp_path / "p"), "--dtype", "f16"]) == 0
    assert str(tmp_path / "p") in capsys.readouterr().out
    assert (tmp_path / "p" / "adapter_model.safetensors").is_file()


def test_export_reports_through_events(lora_run, tmp_path):
    events, seen = collect()
    export_run(lora_run, "hf", tmp_path / "hf", "f32", events)
    assert any(e.kind == "stage" and "merging" in e.message for e in seen)
    assert seen[-1].kind == "info" and seen[-1].data["path"] == str(tmp_path / "hf")


def test_library_warnings_stay_off_the_console(lora_run, tmp_path):
    """Merging a LoRA run makes transformers warn of a deprecation (FutureWarning): ember's console
    says only ember's own lines."""
    done = run_ember("export", lora_run, "--format", "hf", "--out", tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"merging the LoRA adapter of {lora_run} into its base",
                                        "writing a Hugging Face folder (float32)",
                                        f"exported {lora_run} (final weights) as hf (f32) to {tmp_path / 'hf'}"]
