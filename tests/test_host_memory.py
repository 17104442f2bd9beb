"""The host side of ``effitrain estimate`` (``effitrain.memory.host``): a checkpoint's facts from
its safetensors headers, and the host bytes of each way of reading it. How close the model is to
a real run's peak RSS is ``benchmarks/loading``'s question, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from effitrain.memory import host
from effitrain.models import LoadOptions

MIB = 2**20


@pytest.fixture
def bf16_folder(tmp_path: Path) -> Path:
    """Two shards of bf16 weights (a 64 x 32 matrix, a 32-vector) with their index."""
    save_file({"a.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}, tmp_path / "s1.safetensors")
    save_file({"norm.weight": torch.zeros(32, dtype=torch.bfloat16)}, tmp_path / "s2.safetensors")
    index = {
        "metadata": {"total_size": (64 * 32 + 32) * 2},
        "weight_map": {"a.weight": "s1.safetensors", "norm.weight": "s2.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    return tmp_path


def test_facts_come_from_the_headers_of_every_shard(bf16_folder):
    facts = host.checkpoint_facts(str(bf16_folder))
    assert (facts.bytes, facts.elements, facts.dtype) == (
        (64 * 32 + 32) * 2,
        64 * 32 + 32,
        "bfloat16",
    )
    assert facts.source == "safetensors headers of 2 files"


def test_without_all_shards_the_index_and_config_say(bf16_folder):
    (bf16_folder / "s2.safetensors").unlink()
    facts = host.checkpoint_facts(str(bf16_folder))
    assert (facts.bytes, facts.elements, facts.dtype) == (
        (64 * 32 + 32) * 2,
        64 * 32 + 32,
        "bfloat16",
    )
    assert "total_size" in facts.source


def test_a_folder_without_safetensors_has_no_facts(tmp_path):
    assert host.checkpoint_facts(str(tmp_path)) is None
    assert host.checkpoint_facts("tiny-llama") is None


def _host(options: LoadOptions, weights: host.LandedWeights, step: int, checkpoint=None, **launch):
    checkpoint = checkpoint or host.CheckpointFacts(200 * MIB, 100 * MIB, "bfloat16", "test")
    launch = {"num_processes": 1, "device_type": "cpu"} | launch
    return host.host_memory(checkpoint, weights, options, step_bytes=step, **launch)


def test_bf16_read_as_bf16_stays_the_mapping_and_the_step_holds_it():
    """Views of the file: nothing is read while loading; on the CPU the step's tensors (the
    parameters among them, the mapping's pages once touched) are the host's."""
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=200 * MIB)
    memory = _host(LoadOptions(dtype="bfloat16"), weights, step=260 * MIB)
    assert (memory.mapped_bytes, memory.weights_bytes, memory.load_peak_bytes) == (0, 0, 0)
    assert memory.host_peak_bytes == host.LIBRARY_BYTES + 260 * MIB
    assert memory.peak_at == "the training step"


def test_a_cast_holds_the_pages_read_and_the_new_copy():
    """A bf16 checkpoint read in fp32: its pages while the files are open, plus fp32 weights."""
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=400 * MIB)
    memory = _host(LoadOptions(dtype="float32"), weights, step=450 * MIB)
    assert (memory.mapped_bytes, memory.weights_bytes) == (200 * MIB, 400 * MIB)
    assert memory.host_peak_bytes == host.LIBRARY_BYTES + 600 * MIB
    assert memory.peak_at == "loading"


def test_4bit_holds_what_it_quantizes_the_codes_and_its_working_memory():
    """80M of the 100M weights quantized: their 160 MiB of pages read, the 4-bit storage, the
    fp32 working copy of the largest quantized weight and the loader's workspace; the 20M kept
    as bf16 stay views of the file."""
    weights = host.LandedWeights(
        elements=100 * MIB,
        unquantized_bytes=40 * MIB,
        quantized_elements=80 * MIB,
        quantized_bytes=42 * MIB,
        largest_quantized=4 * MIB,
    )
    options = LoadOptions(dtype="bfloat16", quantization_config=object())
    memory = _host(options, weights, step=100 * MIB)
    assert memory.mapped_bytes == 160 * MIB
    assert memory.weights_bytes == 42 * MIB
    workspace = int(host.QUANTIZING_WORKSPACE * 160 * MIB)
    assert memory.quantize_buffer_bytes == 16 * MIB + workspace
    assert memory.host_peak_bytes == host.LIBRARY_BYTES + (160 + 42 + 16) * MIB + workspace
    assert "4-bit" in memory.read_dtype


def test_where_no_process_receives_each_reads_and_a_gpu_step_is_not_host_memory():
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=400 * MIB)
    memory = _host(
        LoadOptions(dtype="float32"), weights, step=10**12, num_processes=4, device_type="cuda"
    )
    assert (memory.copies, memory.step_bytes) == (4, 0)
    assert memory.host_peak_bytes == 4 * host.LIBRARY_BYTES + 4 * 600 * MIB


def test_what_a_gpu_step_offloads_is_host_memory_per_process():
    """The offload levers' pinned copies (``offloaded_bytes``) are each process's step on the
    host: the host's peak where they outgrow loading."""
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=400 * MIB)
    options = LoadOptions(dtype="float32")
    launch = {"num_processes": 2, "device_type": "cuda"}
    memory = _host(options, weights, step=10**12, offloaded_bytes=900 * MIB, **launch)
    assert (memory.step_bytes, memory.peak_at) == (900 * MIB, "the training step")
    assert memory.host_peak_bytes == 2 * host.LIBRARY_BYTES + 2 * 900 * MIB
    small = _host(options, weights, step=0, offloaded_bytes=100 * MIB, **launch)
    assert small.host_peak_bytes == 2 * host.LIBRARY_BYTES + 2 * 600 * MIB  # loading's


def test_one_process_reads_where_the_others_receive():
    """DDP on the CPU: the main process reads (600 MiB while loading), the 3 others hold their
    model, empty, as it arrives (400 MiB each); on a GPU that is the GPU's."""
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=400 * MIB)
    options = LoadOptions(dtype="float32")
    on_cpu = _host(options, weights, step=0, num_processes=4, receive="empty")
    assert (on_cpu.copies, on_cpu.received_bytes) == (1, 400 * MIB)
    assert on_cpu.host_peak_bytes == 4 * host.LIBRARY_BYTES + (600 + 3 * 400) * MIB
    fsdp = _host(options, weights, step=0, num_processes=4, receive="meta")
    assert fsdp.received_bytes == 100 * MIB  # its shard
    on_gpu = _host(options, weights, step=0, num_processes=4, device_type="cuda", receive="empty")
    assert on_gpu.host_peak_bytes == 4 * host.LIBRARY_BYTES + 600 * MIB


def test_a_preset_is_built_in_the_dtype_it_trains_in():
    weights = host.LandedWeights(elements=100 * MIB, unquantized_bytes=200 * MIB)
    memory = host.host_memory(None, weights, LoadOptions(dtype="bfloat16"), 1, "cuda", None)
    assert (memory.mapped_bytes, memory.weights_bytes, memory.checkpoint) == (0, 200 * MIB, None)


@pytest.mark.slow
def test_estimate_reads_a_folders_headers_and_the_levers_dtype(lm_model_dir):
    """The tiny-llama folder (saved in fp32) estimated with --weights-dtype bf16: the headers'
    bytes are read whole (a cast) into bf16 weights; on the CPU the step holds more."""
    from effitrain.build import checked_config
    from effitrain.estimation import estimate

    config = checked_config(
        None,
        {"model": str(lm_model_dir), "task": "causal-lm", "max_length": 16, "batch_size": 1,
         "weights_dtype": "bf16", "optim": "adafactor"},
    )  # fmt: skip
    result = estimate(config).to_dict()
    memory = result["host_memory"]
    facts = host.checkpoint_facts(str(lm_model_dir))
    assert memory["checkpoint"]["bytes"] == facts.bytes and facts.dtype == "float32"
    assert memory["mapped_bytes"] == facts.bytes
    assert memory["weights_bytes"] == facts.elements * 2
    assert result["host_peak_bytes"] == memory["library_bytes"] + max(
        memory["load_peak_bytes"], result["peak_tensor_bytes"]
    )


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_pages_read_from_a_mapped_checkpoint_are_dropped_and_read_again(tmp_path):
    """What stays mapped after loading (a view of the file) keeps its values when its pages are
    dropped; a mapping with a written page is left as it is."""
    from safetensors import safe_open

    from effitrain.models import release_read_pages

    values = torch.arange(2**20, dtype=torch.float32)
    save_file({"clean": values, "written": values.clone()}, tmp_path / "w.safetensors")
    save_file({"other": values.clone()}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        clean = f.get_tensor("clean")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        written = f.get_tensor("other")
    assert float(clean.sum()) == float(values.sum())  # every page read
    written[0] = -1.0  # a copy-on-write page in x's mapping
    assert release_read_pages() >= values.nbytes
    assert torch.equal(clean, values)
    assert written[0] == -1.0 and torch.equal(written[1:], values[1:])
