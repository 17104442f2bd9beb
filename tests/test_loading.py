"""Checkpoints read in the dtype they train in: ``--weights-dtype bf16`` (full and under LoRA)
reads a bf16 checkpoint straight into bf16, ``--load-in-4bit`` quantizes it tensor by tensor
while reading, and no fp32 copy of the model exists on the way (issue 37, items 1 and 2)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.checkpoint_helpers import assert_identical, load_tensors, resume_copy

LM = ("--task", "causal-lm")
SHAPE = ("--batch-size", "2", "--max-length", "32")
QLORA_BF16 = (*LM, "--load-in-4bit", "--lora-rank", "8", "--weights-dtype", "bf16", *SHAPE)


@pytest.fixture(scope="module")
def bf16_lm_dir(tmp_path_factory) -> Path:
    """The tiny-llama preset saved in bf16, as hub checkpoints are published."""
    import torch

    from effitrain.models import load_causal_lm, load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-bf16")
    tokenizer = load_tokenizer("tiny-llama")
    load_causal_lm("tiny-llama", tokenizer).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Float32Peak:
    """The most float32 bytes alive at once among the tensors that operators create while it is
    on (a dispatch mode: it sees this thread's operators, so transformers must read in this
    thread, ``HF_DEACTIVATE_ASYNC_LOAD=1``). Reading a bf16 checkpoint into fp32 creates each
    fp32 tensor by a cast it sees; tensors memory-mapped from the file are not counted."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        peak = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                peak.created(out)
                return out

        self.mode = Mode()
        self.live: dict[int, int] = {}
        self.peak = 0

    def created(self, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.peak = max(self.peak, sum(self.live.values()))
            weakref.finalize(storage, self.live.pop, key, None)


@pytest.fixture
def loading_spy(monkeypatch):
    """Records the arguments of every ``from_pretrained`` call; ``build(*options)`` builds the
    model that ``effitrain train OPTIONS`` trains (``build.build_model``, the train command's
    own loading, levers applied) under a :class:`Float32Peak`."""
    import transformers

    seen = SimpleNamespace(calls=[], model=None, peak=None)
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")

    def build(*options: str) -> None:
        import torch

        import effitrain.build as build
        from effitrain.cli.compare import train_config
        from effitrain.models import load_tokenizer

        config = train_config([*LM, *SHAPE, *options])
        task = build.resolve_task(config)
        data, tokenizer = task.load_data(config), load_tokenizer(config.model)
        meter = Float32Peak()
        with meter.mode:
            seen.model = build.build_model(config, task, data, tokenizer, torch.device("cpu"))
        seen.peak = meter.peak

    seen.build = build
    for auto in (
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForSequenceClassification,
    ):
        original = auto.from_pretrained

        def spied_load(*args, _original=original, **kwargs):
            seen.calls.append(kwargs)
            return _original(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", spied_load)
    return seen


def fp32_allowance(model) -> int:
    """The fp32 bytes a run may hold at once while it loads: its fp32 parameters as built
    (adapters; embeddings, norms and the output layer of a fp32 QLoRA base), one 4-bit weight
    in fp32 (read one at a time, then quantized) and 4 KiB of buffers (rotary inv_freq)."""
    import torch

    from effitrain.memory.ledger import is_4bit, logical_numel

    kept = sum(4 * p.numel() for p in model.parameters() if p.dtype == torch.float32)
    largest = max((logical_numel(p) for p in model.parameters() if is_4bit(p)), default=0)
    return kept + 4 * largest + 4096


def model_fp32_bytes(model) -> int:
    """The model (adapters left out) in fp32: what loading in fp32 holds."""
    from effitrain.memory.ledger import logical_numel

    return 4 * sum(logical_numel(p) for n, p in model.named_parameters() if "lora_" not in n)


def plain(state: dict) -> dict:
    """A state dict without bitsandbytes' tensor subclass (compared as plain tensors)."""
    import torch

    return {key: value.detach().as_subclass(torch.Tensor) for key, value in state.items()}


def dtypes(model) -> dict[str, set[str]]:
    """The dtypes of the model's parameters, by what they are: LoRA's adapters, 4-bit weights,
    norms (1-D), and the other matrices (embeddings, output layer, unquantized Linear layers)."""
    from effitrain.memory.ledger import is_4bit

    parts: dict[str, set[str]] = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            part = "adapters"
        elif is_4bit(p):
            part = "4-bit"
        elif p.dim() == 1:
            part = "norms"
        else:
            part = "matrices"
        parts.setdefault(part, set()).add(str(p.dtype).removeprefix("torch."))
    return parts


@pytest.mark.parametrize(
    ("options", "read_in", "quantized", "expected"),
    [
        (
            ("--weights-dtype", "bf16"),
            "bfloat16",
            False,
            {"norms": {"bfloat16"}, "matrices": {"bfloat16"}},
        ),
        (
            ("--weights-dtype", "bf16", "--lora-rank", "8"),
            "bfloat16",
            False,
            {
                "adapters": {"float32"},
                "norms": {"bfloat16"},
                "matrices": {"bfloat16"},
            },
        ),
        (
            ("--load-in-4bit", "--lora-rank", "8"),
            "float32",
            True,
            {
                "adapters": {"float32"},
                "4-bit": {"uint8"},
                "norms": {"float32"},
                "matrices": {"float32"},
            },
        ),
        (
            ("--load-in-4bit", "--lora-rank", "8", "--weights-dtype", "bf16"),
            "bfloat16",
            True,
            {
                "adapters": {"float32"},
                "4-bit": {"uint8"},
                "norms": {"bfloat16"},
                "matrices": {"bfloat16"},
            },
        ),
    ],
    ids=["bf16", "lora-bf16", "qlora", "qlora-bf16"],
)
def test_a_bf16_checkpoint_is_read_as_it_trains(
    bf16_lm_dir, loading_spy, options, read_in, quantized, expected
):
    loading_spy.build("--model", str(bf16_lm_dir), *options)
    (call,) = loading_spy.calls
    assert call["dtype"] == read_in
    quantization = call.get("quantization_config")
    assert (quantization is not None) == quantized
    if quantized:
        assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
        assert quantization.bnb_4bit_use_double_quant
        assert quantization.llm_int8_skip_modules == ["lm_head"]  # kept: the output layer
        compute = "bfloat16" if "bf16" in options else "float32"
        assert str(quantization.bnb_4bit_compute_dtype) == f"torch.{compute}"
    model = loading_spy.model
    assert dtypes(model) == expected
    for module in model.modules():  # read quantized: no repacking for CPU inference either
        assert not getattr(module, "support_avx512bf16_for_cpu", False)
    # No fp32 copy of the model: the float32 bytes alive at once while it was read and the
    # levers applied stay within what the run keeps in fp32 and one weight read at a time.
    assert loading_spy.peak <= fp32_allowance(model) < model_fp32_bytes(model) / 2


def test_presets_are_built_in_bf16(loading_spy):
    loading_spy.build("--weights-dtype", "bf16")
    assert loading_spy.calls == []  # random init: built, not read
    bf16 = {"bfloat16"}
    assert dtypes(loading_spy.model) == {"norms": bf16, "matrices": bf16}
    assert loading_spy.peak <= 4096  # the rotary inv_freq buffer


def test_quantizing_while_reading_gives_the_same_4bit_weights(tiny_model_dir):
    """A classification checkpoint: the head (pre_classifier, classifier) stays unquantized,
    and every 4-bit code and quant state equals what quantizing the fp32 model after loading
    gives (so checkpoints written before resume as before)."""
    from effitrain.config import TrainConfig
    from effitrain.levers import load_options
    from effitrain.levers.qlora_bnb import quantize_model
    from effitrain.models import LoadOptions, load_model, load_tokenizer

    config = TrainConfig(model=str(tiny_model_dir), lora_rank=8, load_in_4bit=True)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    labels = ["no", "yes"]
    after = quantize_model(load_model(str(tiny_model_dir), labels, tokenizer), config)
    options = load_options(config, LoadOptions())
    while_read = load_model(str(tiny_model_dir), labels, tokenizer, options)
    assert while_read.is_loaded_in_4bit
    expected = plain(after.state_dict())
    assert assert_identical(expected, plain(while_read.state_dict())) == len(expected)
    assert type(while_read.classifier).__name__ == "Linear"
    assert type(while_read.pre_classifier).__name__ == "Linear"
    attention = while_read.distilbert.transformer.layer[0].attention
    assert type(attention.q_lin).__name__ == "Linear4bit"


def test_a_bf16_read_quantizes_to_the_same_codes(bf16_lm_dir):
    """Read into bf16, a bf16 checkpoint gives the codes and scales of its exact fp32 copy
    quantized after loading; only the quant state's record of the weight's dtype differs."""
    import dataclasses

    import torch

    from effitrain.config import TrainConfig
    from effitrain.levers import load_options
    from effitrain.levers.qlora_bnb import quantize_model
    from effitrain.models import LoadOptions, load_causal_lm, load_tokenizer

    name = str(bf16_lm_dir)
    config = TrainConfig(task="causal-lm", model=name, lora_rank=8, load_in_4bit=True)
    tokenizer = load_tokenizer(name)
    after = plain(quantize_model(load_causal_lm(name, tokenizer), config).state_dict())
    bf16 = load_options(dataclasses.replace(config, weights_dtype="bf16"), LoadOptions())
    assert bf16.dtype == "bfloat16"
    in_bf16 = plain(load_causal_lm(name, tokenizer, bf16).state_dict())
    quantized = [key for key in after if "proj.weight" in key]
    # q, k, v, o, gate, up, down in 2 layers: codes, absmax, code, nested absmax and code, and
    # the quant state's record (its dtype)
    assert len(quantized) == 2 * 7 * 6
    for key in quantized:
        same = torch.equal(in_bf16[key], after[key])
        assert same != key.endswith("bitsandbytes__nf4"), key
    assert in_bf16["lm_head.weight"].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def qlora_bf16_run(tmp_path_factory, bf16_lm_dir):
    """QLoRA over the bf16 checkpoint with --weights-dtype bf16: 4 steps, saving at 2 and 4."""
    from tests.conftest import train_in_process

    folder = tmp_path_factory.mktemp("qlora-bf16")
    out, metrics = folder / "out", folder / "metrics.json"
    model = ("--model", str(bf16_lm_dir), *QLORA_BF16)
    options = (*model, "--lr", "1e-2", "--log-every", "1", "--max-steps", "4", "--save-every", "2")
    proc = train_in_process(
        "train", *options, "--output-dir", str(out), "--metrics-json", str(metrics)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return SimpleNamespace(
        out=out, proc=proc, metrics=json.loads(metrics.read_text()), options=options, model=model
    )


@pytest.mark.slow
def test_qlora_with_bf16_weights_learns(qlora_bf16_run):
    metrics = qlora_bf16_run.metrics
    losses = [entry["loss"] for entry in metrics["loss_history"]]
    assert losses[-1] < losses[0]
    assert {"load-in-4bit", "bf16-weights", "lora"} <= set(metrics["levers"])
    assert "compute bf16" in qlora_bf16_run.proc.stdout
    # The quant states are in the step's peak, as part of the parameters, in the 4-bit row.
    step = metrics["step_memory"]
    assert step["at_peak"]["parameters"] == metrics["parameter_bytes"]
    assert step["quantized_at_peak"] == metrics["quantized_weights"]["bytes"]


@pytest.mark.slow
def test_qlora_with_bf16_weights_resumes_exactly(qlora_bf16_run, tmp_path, train_cli):
    resumed = tmp_path / "resumed"
    proc = resume_copy(train_cli, qlora_bf16_run.out, qlora_bf16_run.options, resumed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not an exact continuation" not in proc.stdout
    straight = load_tensors(qlora_bf16_run.out / "checkpoint-4")
    assert assert_identical(straight, load_tensors(resumed / "checkpoint-4")) > 100


@pytest.mark.slow  # 1 s: the fake-tensor step through bitsandbytes' shape-only kernels
def test_qlora_with_bf16_weights_estimate_equals_the_run(qlora_bf16_run, train_cli):
    proc = train_cli("estimate", *qlora_bf16_run.model, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    estimate = json.loads(proc.stdout)
    measured = qlora_bf16_run.metrics
    for key in ("parameter_bytes", "trainable_parameter_bytes", "gradient_bytes"):
        assert estimate[key] == measured[key], key
    assert estimate["optimizer_state"]["bytes"] == measured["optimizer_state"]["bytes"]
    assert estimate["quantized_weights"] == measured["quantized_weights"]
    assert estimate["step_memory"]["quantized_at_peak"] == measured["quantized_weights"]["bytes"]


# --------------------------------------------------------------------------------------------
# A process that receives its weights under accelerate launch reads none
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("receive", ["meta", "empty"])
def test_a_receiving_process_builds_the_model_without_reading_it(lm_model_dir, receive):
    """The model ``from_pretrained`` gives, with no weight read: parameters on the meta device
    (``meta``, for FSDP2's loading) or in uninitialised memory (``empty``, for DDP's broadcast),
    buffers computed at init, tied weights tied, the saved generation config; QLoRA reads."""
    import torch
    from transformers import BitsAndBytesConfig

    from effitrain.models import LoadOptions, load_causal_lm, load_tokenizer, materialize_empty

    tokenizer = load_tokenizer(str(lm_model_dir))
    read = load_causal_lm(str(lm_model_dir), tokenizer)
    model = load_causal_lm(str(lm_model_dir), tokenizer, LoadOptions(receive=receive))
    if receive == "empty":
        materialize_empty(model, torch.device("cpu"))
    params = dict(model.named_parameters())
    assert params.keys() == dict(read.named_parameters()).keys()
    assert {p.device.type for p in params.values()} == {"meta" if receive == "meta" else "cpu"}
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, buffer in read.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    assert model.generation_config.to_dict() == read.generation_config.to_dict()
    assert model.training == read.training and model.config.use_cache == read.config.use_cache
    quantized = LoadOptions(receive=receive, quantization_config=BitsAndBytesConfig())
    assert LoadOptions(receive=receive).receives == receive and quantized.receives is None


# --------------------------------------------------------------------------------------------
# Weights load or the run is refused; what a checkpoint or the hub cannot give, in one line
# (issue 44, item 2 and the loading edges of items 6 and 7)
# --------------------------------------------------------------------------------------------

LM_RUN = (*LM, *SHAPE, "--max-steps", "1")


@pytest.fixture
def lm_copy(lm_model_dir, tmp_path) -> Path:
    """A copy of the saved tiny-llama folder, to break."""
    import shutil

    return Path(shutil.copytree(lm_model_dir, tmp_path / "model"))


@pytest.mark.parametrize(
    "options",
    [(), ("--weights-dtype", "bf16"), ("--load-in-4bit", "--lora-rank", "8")],
    ids=["fp32", "bf16", "qlora"],
)
def test_a_checkpoint_missing_a_layer_is_refused(lm_copy, train_cli, options):
    from safetensors.torch import load_file, save_file

    from tests.conftest import assert_clean_error

    weights = lm_copy / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if not k.startswith("model.layers.1.")}
    save_file(kept, weights, metadata={"format": "pt"})
    proc = train_cli("train", "--model", str(lm_copy), *LM_RUN, *options)
    assert_clean_error(
        proc,
        "9 weight(s) missing from the checkpoint (e.g. model.layers.1.",
        "truncated or partial checkpoint",
    )


def test_a_config_of_another_architecture_is_refused(lm_copy, train_cli):
    from tests.conftest import assert_clean_error

    config = json.loads((lm_copy / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertForMaskedLM"])
    (lm_copy / "config.json").write_text(json.dumps(config))
    proc = train_cli("train", "--model", str(lm_copy), *LM_RUN)
    assert_clean_error(
        proc,
        "missing from the checkpoint (e.g. bert.",
        "in the checkpoint have no place in the model (e.g. model.",
        "architecture (BertLMHeadModel, model_type bert) does not match the weights",
    )


def test_a_config_with_other_shapes_is_refused(lm_copy, train_cli):
    from tests.conftest import assert_clean_error

    config = json.loads((lm_copy / "config.json").read_text())
    config["intermediate_size"] *= 2
    (lm_copy / "config.json").write_text(json.dumps(config))
    proc = train_cli("train", "--model", str(lm_copy), *LM_RUN)
    assert_clean_error(
        proc, "6 weight(s) have another shape in the checkpoint", "whose sizes do not"
    )


def test_a_base_model_gets_a_classification_head_with_a_note(tmp_path, train_cli):
    """A checkpoint of the base model alone (no head): the task's head is new, said once."""
    from effitrain.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    load_model("tiny", ["no", "yes"], tokenizer).base_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    proc = train_cli("train", "--model", str(tmp_path), "--max-steps", "1", "--batch-size", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = [line for line in proc.stdout.splitlines() if "initialized for this task" in line]
    assert notes == [
        "note: classifier.bias, classifier.weight, pre_classifier.bias, pre_classifier.weight "
        "are new: initialized for this task"
    ]


def test_a_truncated_safetensors_names_the_file(lm_copy, train_cli):
    from tests.conftest import assert_clean_error

    weights = lm_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = assert_clean_error(
        train_cli("train", "--model", str(lm_copy), *LM_RUN),
        f"{weights} is truncated or corrupt",
    )
    assert "SafetensorError" not in line


@pytest.mark.slow
def test_a_pickle_checkpoint_is_refused_with_a_conversion(lm_copy, train_cli):
    """A pytorch_model.bin that the weights-only loader refuses (it holds more than tensors):
    refused, never unpickled here; the printed conversion gives a folder that trains."""
    import argparse
    import re

    import torch
    from safetensors.torch import load_file

    from tests.conftest import assert_clean_error

    weights = load_file(lm_copy / "model.safetensors")
    (lm_copy / "model.safetensors").unlink()
    pickled = lm_copy / "pytorch_model.bin"
    torch.save({**weights, "args": argparse.Namespace(lr=1.0)}, pickled)
    line = assert_clean_error(
        train_cli("train", "--model", str(lm_copy), *LM_RUN),
        f"{pickled} is a pickle holding more than tensors, refused",
        "never unpickled with code execution",
    )
    assert "weights_only=False" not in line.split("convert it once:")[0]
    code = re.search(r'python -c "(.*)" and remove', line).group(1)
    exec(code, {})  # the user's step, on a file this test wrote
    pickled.unlink()
    proc = train_cli("train", "--model", str(lm_copy), *LM_RUN)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_uncached_hub_id_offline_says_what_works(train_cli):
    from tests.conftest import assert_clean_error

    assert_clean_error(  # the tests run with HF_HUB_OFFLINE=1
        train_cli("train", "--model", "effitrain-test/not-cached", "--max-steps", "1"),
        "cannot load model 'effitrain-test/not-cached': the hub is offline (HF_HUB_OFFLINE=1)",
        "offline, use a preset (tiny,",
        "or a local folder",
    )


@pytest.fixture
def online(monkeypatch):
    """This process as if HF_HUB_OFFLINE were unset, with the hub at a loopback port where
    nothing listens (refused at once)."""
    from huggingface_hub import constants

    import effitrain.models as models

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(models, "_unreachable_hub", None)


def test_an_unreachable_hub_goes_offline_at_once(online, caplog):
    """One request tells that the hub cannot be reached: the process goes offline (a cached
    copy would load) and an uncached id fails without huggingface_hub's retries."""
    import os

    from huggingface_hub import constants

    from effitrain.errors import EffitrainError
    from effitrain.models import load_model_config

    with pytest.raises(EffitrainError) as error:
        load_model_config("effitrain-test/not-cached")
    assert str(error.value).startswith(
        "cannot load model 'effitrain-test/not-cached': the hub (http://127.0.0.1:9) cannot be "
        "reached and no copy is cached; offline, use a preset (tiny,"
    )
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


@pytest.mark.slow  # a fresh process, with the hub's environment unset
def test_an_unreachable_hub_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import OFFLINE, assert_clean_error

    env = {k: v for k, v in os.environ.items() if k not in OFFLINE and k != "EFFITRAIN_DEBUG"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path), COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "effitrain", "train", "--model", "org/not-cached"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert_clean_error(proc, "the hub (http://127.0.0.1:9) cannot be reached")
    assert "Retrying" not in proc.stderr


CUT = "note: --max-length 100 is above the 64 positions the model takes: sequences are cut"


@pytest.mark.slow
def test_a_max_length_above_the_positions_is_noted_by_train(train_cli):
    trained = train_cli("train", "--max-length", "100", "--max-steps", "1", "--batch-size", "4")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert trained.stdout.count(CUT) == 1


@pytest.mark.slow
def test_a_max_length_above_the_positions_is_noted_by_estimate_alike(train_cli):
    estimated = train_cli("estimate", "--max-length", "100", "--batch-size", "4")
    assert CUT in " ".join(estimated.stdout.split())  # rich wraps the note


def test_the_default_max_length_is_cut_without_a_note():
    """The default (128) is above the tiny preset's 64 positions: no note on every demo run."""
    from effitrain.config import default_for
    from effitrain.models import capped_length

    notes: list[str] = []
    assert capped_length(default_for("max_length"), 64, notes) == 64 and notes == []
    assert capped_length(100, 64, notes) == 64 and len(notes) == 1


@pytest.mark.slow
def test_the_banner_counts_all_parameters_and_the_trainable_ones(train_cli):
    import re

    proc = train_cli("train", *LM_RUN, "--lora-rank", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    banner = re.search(r"\(LlamaForCausalLM, ([\d,]+) params, ([\d,]+) trainable\)", proc.stdout)
    lever = re.search(r"([\d,]+) of ([\d,]+) parameters train", proc.stdout)
    assert banner.group(1) == lever.group(2) and banner.group(2) == lever.group(1)


@pytest.mark.slow
def test_saving_a_tied_model_says_nothing_of_its_shared_tensor(tmp_path, train_cli, caplog):
    """tiny-llama's output layer is tied to its embeddings: Accelerate's save_state keeps the
    tensor once, as expected, and its warning stays off the console."""
    import logging

    caplog.set_level(logging.WARNING)
    out = tmp_path / "out"
    options = ("--max-steps", "1", "--save-every", "1", "--output-dir", str(out))
    proc = train_cli("train", *LM_RUN[:-2], *options)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "checkpoint-1").is_dir()
    said = proc.stdout + proc.stderr + caplog.text
    assert "Removed shared tensor" not in said
