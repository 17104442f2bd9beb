"""The causal-LM loss (effitrain.tasks.lm_loss): the chunked loss equals the plain one, loss and
gradients; token weighting makes accumulated and multi-process gradients equal one big batch's;
the choice of implementation and its refusals; estimate against a run."""

from __future__ import annotations

import pytest

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error

IGNORE = -100


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of a few hundred logits, so that the tiny shapes here take several."""
    from effitrain.tasks import lm_loss

    monkeypatch.setattr(lm_loss, "MIN_CHUNK_VALUES", 512)


def _plain_sum(hidden, weight, bias, labels, softcap=None):
    import torch
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_gradients_equal_the_plain_loss(softcap, bias):
    import torch

    from effitrain.tasks.lm_loss import Choice, chunk_tokens, chunked_loss_sum

    torch.manual_seed(0)
    batch, length, hidden_size, vocab = 3, 70, 16, 50
    assert chunk_tokens(batch * length, hidden_size, vocab) < batch * length  # several chunks
    hidden = torch.randn(batch, length, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (batch, length))
    labels[0, :20] = IGNORE
    labels[2, 50:] = IGNORE

    mine = chunked_loss_sum(Choice("torch"), hidden, weight, b, labels, softcap)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    my_grads = torch.autograd.grad(mine, inputs)
    plain = _plain_sum(hidden, weight, b, labels, softcap)
    plain_grads = torch.autograd.grad(plain, inputs)

    torch.testing.assert_close(mine, plain)
    for g, p in zip(my_grads, plain_grads, strict=True):
        torch.testing.assert_close(g, p)


def test_sequence_sums_from_hidden_states_or_logits():
    import torch
    import torch.nn.functional as F

    from effitrain.tasks.lm_loss import sequence_loss_sums

    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 90, 8), torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 90))
    labels[1, :30] = IGNORE
    expected = torch.stack([_plain_sum(hidden[i], weight, None, labels[i]) for i in range(2)])
    torch.testing.assert_close(sequence_loss_sums(hidden, weight, None, labels), expected)
    logits = F.linear(hidden, weight)
    torch.testing.assert_close(sequence_loss_sums(logits, None, None, labels), expected)


@pytest.fixture(scope="module")
def tiny_lm():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _padded_batch(lengths, width, seed=0):
    """Sequences of ``lengths`` tokens padded to ``width``; labels -100 on the padding."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def test_chunked_and_full_logits_give_the_model_loss_and_gradients(tiny_lm):
    """On a real model: both implementations equal the model's own loss (labels given) in value
    and gradients; the output layer is restored afterwards."""
    import torch

    from effitrain.tasks.lm_loss import Choice, LMLoss, labelled_tokens

    batch = _padded_batch([40, 17, 33], 40)
    tokens = labelled_tokens(batch)
    own = tiny_lm(**batch).loss
    own.backward()
    expected = _grads(tiny_lm)
    for name in ("torch", "off"):
        tiny_lm.zero_grad()
        loss = LMLoss(Choice(name), tiny_lm)(tiny_lm, batch) / tokens
        loss.backward()
        torch.testing.assert_close(loss, own)
        for g, e in zip(_grads(tiny_lm), expected, strict=True):
            torch.testing.assert_close(g, e)
    assert "forward" not in vars(tiny_lm.get_output_embeddings())
    tiny_lm.zero_grad()


def _accelerator(processes: int, steps: int):
    """What step_scale reads of an accelerator; its reduce adds the other process's count."""
    from types import SimpleNamespace

    return SimpleNamespace(num_processes=processes, gradient_accumulation_steps=steps)


def test_token_weighted_accumulation_and_processes_equal_one_big_batch(tiny_lm, monkeypatch):
    """Uneven padding: 4 micro-batches (2 per process, 2 accumulation steps each) with very
    different labelled-token counts. Backward divides by the accumulation steps and the
    processes average their gradients, as Accelerate and DDP do; the sum equals the gradient of
    the token-mean loss over all four micro-batches at once."""
    import torch

    from effitrain.tasks import lm_loss
    from effitrain.tasks.lm_loss import Choice, LMLoss, step_scale

    micro = [
        _padded_batch([40, 3], 40, seed=1),
        _padded_batch([5, 2], 40, seed=2),
        _padded_batch([38, 40], 40, seed=3),
        _padded_batch([1, 9], 40, seed=4),
    ]
    loss = LMLoss(Choice("torch"), tiny_lm)
    big = {k: torch.cat([b[k] for b in micro]) for k in micro[0]}
    tiny_lm.zero_grad()
    (tiny_lm(**big).loss).backward()
    expected = _grads(tiny_lm)

    processes, steps = 2, 2
    per_process = [micro[:2], micro[2:]]
    total = sum(int(lm_loss.labelled_tokens(b)) for b in micro)
    averaged = None
    for mine in per_process:
        other = total - sum(int(lm_loss.labelled_tokens(b)) for b in mine)
        accelerator = _accelerator(processes, steps)
        accelerator.reduce = lambda t, op, other=other: t + other
        scale = step_scale(mine, accelerator)
        tiny_lm.zero_grad()
        for batch in mine:
            (loss(tiny_lm, batch) * scale / steps).backward()  # accelerator.backward's division
        grads = _grads(tiny_lm)
        averaged = (
            grads
            if averaged is None
            else [(a + g) / processes for a, g in zip(averaged, grads, strict=True)]
        )
    for g, e in zip(averaged, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    tiny_lm.zero_grad()


def test_a_run_with_uneven_micro_batches_steps_as_one_big_batch(train_cli, lm_model_dir, tmp_path):
    """Through the CLI and the loop: one step of --grad-accum 2 over padded texts of very
    different lengths ends at the same weights as one step over the same 8 texts at once."""
    import json

    import torch
    from safetensors.torch import load_file

    lengths = (60, 2, 3, 50, 1, 40, 2, 2)
    data = tmp_path / "uneven.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(["word"] * n)}) + "\n" for n in lengths))

    def weights(*options):
        out = tmp_path / "-".join(options)
        proc = train_cli(
            "train", "--quiet", "--task", "causal-lm", "--model", str(lm_model_dir),
            "--train-file", str(data), "--validation-file", str(data), "--no-packing",
            "--max-steps", "1", "--max-grad-norm", "0", "--warmup-steps", "0",
            "--optim", "sgd", "--lr", "0.5", "--no-memory-breakdown",
            "--output-dir", str(out), *options,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return load_file(out / "final" / "model.safetensors")

    one = weights("--batch-size", "8")
    accumulated = weights("--batch-size", "4", "--grad-accum", "2")
    start = load_file(lm_model_dir / "model.safetensors")
    assert any(not torch.equal(one[k], start[k]) for k in start)  # it stepped
    for key in one:
        torch.testing.assert_close(accumulated[key], one[key], rtol=1e-5, atol=1e-6)


def _device(kind):
    from types import SimpleNamespace

    return SimpleNamespace(type=kind)


def test_auto_chooses_torch_on_a_cpu_and_off_where_unsafe(tiny_lm, monkeypatch):
    from effitrain.levers import loss_options
    from effitrain.tasks.lm_loss import choose

    wanted = loss_options(TrainConfig(task="causal-lm")).chunked
    assert wanted == "auto"  # a causal-LM run's default
    assert choose(wanted, tiny_lm, _device("cpu"), None).name == "torch"
    off = choose(wanted, tiny_lm, _device("cpu"), "FSDP2 over 2 processes")
    assert (off.name, off.why) == (
        "off",
        "the output layer's weight is sharded under FSDP2 over 2 processes",
    )
    assert "full logits" in off.describe() and off.why in off.describe()
    monkeypatch.setattr(tiny_lm.config, "logit_scale", 0.0625, raising=False)
    assert "rescales its logits" in choose(wanted, tiny_lm, _device("cpu"), None).why
    torch_wanted = loss_options(TrainConfig(task="causal-lm", chunked_loss="torch")).chunked
    with pytest.raises(
        EffitrainError, match="--chunked-loss torch cannot run: this model rescales"
    ):
        choose(torch_wanted, tiny_lm, _device("cpu"), None)


def test_kernels_are_refused_on_a_cpu_or_uninstalled(tiny_lm, monkeypatch):
    from effitrain.tasks import lm_loss

    with pytest.raises(
        EffitrainError, match="CUDA .*this run's device is cpu; use --chunked-loss torch"
    ):
        lm_loss.choose("liger", tiny_lm, _device("cpu"), None)
    monkeypatch.setattr(lm_loss, "_kernel", lambda name: None)
    with pytest.raises(
        EffitrainError, match="needs cut-cross-entropy: pip install cut-cross-entropy"
    ):
        lm_loss.choose("cce", tiny_lm, _device("cuda"), None)
    # auto on CUDA without either package: the torch form.
    assert lm_loss.choose("auto", tiny_lm, _device("cuda"), None).name == "torch"
    monkeypatch.setattr(lm_loss, "_kernel", lambda name: object() if name == "cce" else None)
    assert lm_loss.choose("auto", tiny_lm, _device("cuda"), None).name == "cce"


def test_an_adapted_output_layer_keeps_the_full_logits(tiny_lm):
    """LoRA on the output layer makes it a peft layer: the bypass would skip the adapter."""
    import copy

    from peft import LoraConfig, get_peft_model

    from effitrain.tasks.lm_loss import choose

    model = get_peft_model(copy.deepcopy(tiny_lm), LoraConfig(r=2, target_modules=["lm_head"]))
    choice = choose("auto", model, _device("cpu"), None)
    assert choice.name == "off" and "not a plain Linear layer" in choice.why


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--task", "causal-lm", "--chunked-loss", "fast"],
            "unknown --chunked-loss 'fast'; choose one of: auto, torch, liger, cce, off",
        ),
        (
            ["--task", "causal-lm", "--chunked-loss", "liger"],
            "--chunked-loss liger is a CUDA (Triton) kernel",
        ),
        (["--chunked-loss", "torch"], "--chunked-loss needs --task causal-lm"),
    ],
)
def test_cli_refusals_are_one_line(train_cli, args, message):
    proc = train_cli("train", "--max-steps", "1", *args)
    assert_clean_error(proc, message)


@pytest.mark.slow
def test_metrics_and_banner_say_which_loss_ran(train_cli, tmp_path):
    import json

    metrics = tmp_path / "m.json"
    text = tmp_path / "a.txt"  # not the demo: its loading was most of the run
    text.write_text("\n\n".join([" ".join(["the cat sat on a mat"] * 20)] * 8) + "\n")
    proc = train_cli(
        "train", "--task", "causal-lm", "--train-file", str(text), "--max-steps", "1",
        "--max-length", "32", "--metrics-json", str(metrics),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "chunked loss (torch)" in proc.stdout and "weighted by labelled tokens" in proc.stdout
    result = json.loads(metrics.read_text())
    assert result["loss"] == {"implementation": "torch", "weighting": "tokens", "why": ""}
    assert "chunked-loss" in result["levers"]


@pytest.mark.slow
@pytest.mark.parametrize("chunked", ["torch", "off"])
def test_estimate_equals_a_run(train_cli, tmp_path, chunked):
    from tests.test_estimate import compare

    estimated, measured = compare(
        train_cli, tmp_path,
        ["--task", "causal-lm", "--max-length", "64", "--batch-size", "4", "--chunked-loss", chunked],
    )  # fmt: skip
    assert estimated["loss"] == measured["loss"]
    assert estimated["levers"] == measured["levers"]


@pytest.mark.slow
def test_the_estimate_runs_one_chunk_of_each_kind_and_counts_them_all(monkeypatch):
    """On fake tensors one chunk of each kind runs (the first, one of those after it, the
    shorter last), counted for all: the estimate (peak and its parts, FLOPs, bytes, operator
    calls) equals the one that runs every chunk."""
    from effitrain.config import TrainConfig
    from effitrain.cost import one_of_each_kind
    from effitrain.estimation import estimate
    from effitrain.tasks import lm_loss

    config = TrainConfig(
        task="causal-lm", model="tiny-llama", max_length=64, batch_size=4, chunked_loss="torch"
    )
    counted = []

    def counting(pieces, settled, fake):
        counted.append((len(pieces), len(one_of_each_kind(pieces, settled, fake))))
        return one_of_each_kind(pieces, settled, fake)

    monkeypatch.setattr("effitrain.cost.one_of_each_kind", counting)
    lm_loss._linear_cross_entropy.cache_clear()  # imports it again
    shortcut = estimate(config).to_dict()
    assert (8, 3) in counted  # 256 tokens: 7 chunks of 34, the last of 18
    monkeypatch.setattr(lm_loss, "SETTLED", 256)  # every chunk a kind of its own
    assert estimate(config).to_dict() == shortcut
    lm_loss._linear_cross_entropy.cache_clear()  # not the counting one, for the next tests


def test_under_bf16_autocast_the_chunks_compute_as_the_output_layer_does(tiny_lm):
    """The loss runs inside the model's forward, under its autocast: the same bf16 matmul."""
    import torch

    from effitrain.tasks.lm_loss import Choice, LMLoss

    batch = _padded_batch([40, 25], 40, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = LMLoss(Choice("torch"), tiny_lm)(tiny_lm, batch)
        full = LMLoss(Choice("off"), tiny_lm)(tiny_lm, batch)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-3, atol=0)
