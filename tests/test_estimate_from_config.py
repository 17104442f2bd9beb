"""``effitrain estimate`` of a model known by its config.json alone (no tokenizer, no weights):
the same numbers as the same shapes with a tokenizer, and one-line errors where even the config
is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_clean_error

COMPARED = ("parameter_bytes", "gradient_bytes", "activation_bytes", "peak_tensor_bytes")


def _estimate(**options) -> dict:
    """The estimate as ``effitrain estimate --json`` prints it (the metrics JSON's names)."""
    from effitrain.build import checked_config
    from effitrain.estimation import estimate

    return estimate(checked_config(None, options)).to_dict()


def _no_tokenizer(result: dict) -> list[str]:
    return [note for note in result["notes"] if note.startswith("no tokenizer found")]


@pytest.fixture(scope="module")
def llama_config_dir(tmp_path_factory) -> Path:
    """The tiny-llama preset's shapes as a hub config.json (bf16 on disk, as published LLMs are),
    and nothing else in the folder."""
    from transformers import LlamaConfig

    from effitrain.models import causal_preset_settings

    folder = tmp_path_factory.mktemp("llama-config-only")
    settings = {**LlamaConfig(**causal_preset_settings("tiny-llama")).to_dict()}
    settings.update(torch_dtype="bfloat16", use_cache=True, architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "adafactor"])
def test_a_config_json_alone_estimates_as_the_preset_with_its_tokenizer(llama_config_dir, optim):
    """Weights in fp32 (as a run loads them, whatever config.json's dtype) and no key/value
    cache (as a run trains): the config-only estimate equals the preset's, to the byte."""
    shape = {"task": "causal-lm", "optim": optim, "batch_size": 2, "max_length": 32}
    from_config = _estimate(model=str(llama_config_dir), **shape)
    preset = _estimate(model="tiny-llama", **shape)
    for key in COMPARED:
        assert from_config[key] == preset[key], key
    assert from_config["optimizer_state"] == preset["optimizer_state"]
    assert from_config["estimate"]["max_length"] == 32
    assert _no_tokenizer(from_config) and not _no_tokenizer(preset)
    assert "2 x 32 token ids" in _no_tokenizer(from_config)[0]


@pytest.mark.slow
def test_the_length_is_capped_by_the_config_positions(llama_config_dir):
    from effitrain.models import causal_preset_settings

    positions = causal_preset_settings("tiny-llama")["max_position_embeddings"]
    result = _estimate(
        task="causal-lm", model=str(llama_config_dir), batch_size=1, max_length=positions + 64
    )
    assert result["estimate"]["max_length"] == positions
    assert f"max_position_embeddings ({positions:,})" in _no_tokenizer(result)[0]


def test_a_folder_with_a_tokenizer_keeps_using_it(lm_model_dir):
    result = _estimate(task="causal-lm", model=str(lm_model_dir), batch_size=1, max_length=16)
    assert not _no_tokenizer(result)


def test_a_classifier_config_json_alone(tmp_path, tiny_model_dir):
    """Sequence classification takes the same path (its labels come from the demo data; for a
    DistilBERT config, transformers makes a vocabulary-less tokenizer: the shapes stay the
    config's either way)."""
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    shape = {"batch_size": 4, "max_length": 32}
    from_config = _estimate(model=str(tmp_path), **shape)
    with_tokenizer = _estimate(model=str(tiny_model_dir), **shape)
    for key in COMPARED:
        assert from_config[key] == with_tokenizer[key], key


def test_errors_are_one_line(train_cli, tmp_path):
    assert_clean_error(
        train_cli("estimate", "--task", "causal-lm", "--model", str(tmp_path)),
        f"cannot load model '{tmp_path}': the folder has no config.json",
    )
    assert_clean_error(
        train_cli("estimate", "--task", "causal-lm", "--model", str(tmp_path / "nowhere")),
        "no such folder",
    )
    assert_clean_error(  # tests run offline: an uncached hub id
        train_cli("estimate", "--task", "causal-lm", "--model", "effitrain-test/not-cached"),
        "cannot load model 'effitrain-test/not-cached'",
        "offline",
    )


@pytest.mark.slow
def test_a_cached_hub_id_with_only_its_config(train_cli, monkeypatch, tmp_path, llama_config_dir):
    """A hub id goes through the same path: offline, a cache holding its config.json is enough.
    The cache is this process's (huggingface_hub reads ``HF_HUB_CACHE`` once, at import, and
    both it and transformers look the constant up at each call)."""
    import huggingface_hub.constants

    snapshot = "0" * 40
    repo = tmp_path / "models--org--llama-config-only"
    (repo / "snapshots" / snapshot).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot)
    shutil.copy(llama_config_dir / "config.json", repo / "snapshots" / snapshot)
    args = ("estimate", "--task", "causal-lm", "--batch-size", "2", "--max-length", "32", "--json")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    from_hub = train_cli(*args, "--model", "org/llama-config-only")
    assert from_hub.returncode == 0, from_hub.stderr
    from_folder = _estimate(
        model=str(llama_config_dir), task="causal-lm", batch_size=2, max_length=32
    )
    result = json.loads(from_hub.stdout)
    for key in COMPARED:
        assert result[key] == from_folder[key], key
    assert _no_tokenizer(result)


def test_training_from_a_folder_without_a_tokenizer_is_refused(
    train_cli, no_dropout_model_dir, tmp_path
):
    """transformers would make a 5-token tokenizer from the config: every word unknown."""
    import shutil

    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(no_dropout_model_dir / name, folder / name)
    proc = train_cli("train", "--model", str(folder), "--max-steps", "1")
    assert_clean_error(proc, "the folder has no tokenizer files")
