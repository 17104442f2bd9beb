"""The Python API (`effitrain.python_api`) and the Trainer callback.

Expected numbers are counted here by hand from each optimizer's own ``state_dict()`` (every
tensor's ``numel() × element_size()``, a tensor held by several parameters once, a Python
number as 1 element of 8 bytes), never with effitrain's ledger code. The model is

    Sequential(Linear(128, 64), LayerNorm(64), Linear(64, 96), Linear(96, 2))

with parameters (shape -> numel):
    0.weight (64, 128) -> 8192     0.bias (64,) -> 64
    1.weight (64,)     -> 64       1.bias (64,) -> 64
    2.weight (96, 64)  -> 6144     2.bias (96,) -> 96
    3.weight (2, 96)   -> 192      3.bias (2,)  -> 2
    total 14,818 elements in 8 tensors; two of them (8192, 6144) reach bitsandbytes'
    min_8bit_size of 4096, so they share its quantization maps.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from effitrain.errors import EffitrainError

torch = pytest.importorskip("torch")

PARAMS = 14_818
TENSORS = 8
ADAMW_ELEMENTS = 2 * PARAMS + TENSORS  # exp_avg + exp_avg_sq per element, one step each
ADAMW_BYTES = 4 * ADAMW_ELEMENTS  # all float32
BNB_NESTED = "__bnb_optimizer_quant_state__"


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 96),
        torch.nn.Linear(96, 2),
    )


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2)


def adamw_8bit(params):
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.optim.AdamW8bit(params, lr=1e-3)


OPTIMIZERS = [adamw, adafactor, adamw_8bit]


def stepped(make_optimizer, steps: int = 1):
    model = small_model()
    optimizer = make_optimizer(model.parameters())
    for _ in range(steps):
        model(torch.randn(4, 128)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def by_hand(state_dict) -> dict[str, tuple[int, int]]:
    """Per state key: (elements, bytes), counted from a state_dict without effitrain."""
    counted: dict[str, tuple[int, int]] = {}
    seen: set[tuple[int, int]] = set()
    for entry in state_dict["state"].values():
        flat = {k: v for k, v in entry.items() if k != BNB_NESTED}
        flat.update(entry.get(BNB_NESTED, {}))  # bitsandbytes nests its tensors one level down
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                identity = (value.data_ptr(), value.numel())
                if identity in seen:  # bitsandbytes' qmap1/qmap2: one tensor for all params
                    continue
                seen.add(identity)
                elements, nbytes = value.numel(), value.numel() * value.element_size()
            else:
                elements, nbytes = 1, 8
            old = counted.get(key, (0, 0))
            counted[key] = (old[0] + elements, old[1] + nbytes)
    return counted


def as_counts(result) -> dict[str, tuple[int, int]]:
    return {key: (usage.elements, usage.bytes) for key, usage in result.by_key.items()}


# --------------------------------------------------------------------------------------------
# Import cost
# --------------------------------------------------------------------------------------------


def test_package_import_and_api_import_load_nothing_heavy():
    code = (
        "import sys, effitrain\n"
        "assert 'optimizer_memory' in dir(effitrain)\n"
        "from effitrain import OptimizerMemory, optimizer_memory\n"
        "print([m for m in ('torch', 'transformers', 'accelerate', 'rich') if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_unknown_package_attribute_is_an_attribute_error():
    import effitrain

    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = effitrain.no_such_thing


# --------------------------------------------------------------------------------------------
# Live optimizers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_live_optimizer_matches_its_state_dict_counted_by_hand(make_optimizer):
    from effitrain import optimizer_memory

    _, optimizer = stepped(make_optimizer)
    expected = by_hand(optimizer.state_dict())
    result = optimizer_memory(optimizer)
    assert as_counts(result) == expected
    assert result.elements == sum(e for e, _ in expected.values())
    assert result.bytes == sum(b for _, b in expected.values())
    assert result.optimizer_state.params_with_state == TENSORS
    assert (result.adamw_equivalent_elements, result.adamw_equivalent_bytes) == (
        ADAMW_ELEMENTS,
        ADAMW_BYTES,
    )
    assert result.parameters == TENSORS and result.source == "optimizer"
    assert result.ratio_to_adamw == result.bytes / ADAMW_BYTES


def test_adamw_and_adafactor_numbers_by_shape():
    from effitrain import optimizer_memory

    # AdamW: exp_avg and exp_avg_sq of every parameter, and one float32 step each.
    assert optimizer_memory(stepped(adamw)[1]).bytes == ADAMW_BYTES
    # torch Adafactor: row_var (m) + col_var (n) for 2-D weights, variance (n) for 1-D, a
    # float32 step each: (64+128) + (96+64) + (2+96) + (64+64+64+96+2) + 8 = 748 elements.
    result = optimizer_memory(stepped(adafactor)[1])
    assert (result.elements, result.bytes) == (748, 748 * 4)
    assert as_counts(result) == {
        "step": (8, 32),
        "row_var": (64 + 96 + 2, 4 * 162),
        "col_var": (128 + 64 + 96, 4 * 288),
        "variance": (290, 4 * 290),
    }
    assert result.name == "Adafactor" and result.optimizer_class.startswith("torch.optim.")


def test_adamw_8bit_shares_its_quantization_maps_and_keeps_small_tensors_fp32():
    from effitrain import optimizer_memory

    result = optimizer_memory(stepped(adamw_8bit)[1])
    # Two parameters hold qmap1; it is one tensor of 256 float32, counted once.
    assert (result.by_key["qmap1"].elements, result.by_key["qmap1"].bytes) == (256, 1024)
    assert result.by_key["qmap1"].tensors == 1
    # state1: uint8 for the two large weights, float32 for the 482 elements of the rest.
    assert result.by_key["state1"].dtypes == ["float32", "uint8"]
    assert result.by_key["state1"].bytes == (8192 + 6144) + 4 * (PARAMS - 8192 - 6144)
    assert result.by_key["step"].dtypes == ["python int"]
    assert result.bytes < ADAMW_BYTES / 3


def test_wrapped_optimizer_is_unwrapped():
    from effitrain import optimizer_memory

    class Wrapper:  # the shape of accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def state(self):
            return self.optimizer.state

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    _, optimizer = stepped(adamw)
    wrapped = optimizer_memory(Wrapper(Wrapper(optimizer)))
    assert wrapped.to_dict() == optimizer_memory(optimizer).to_dict()
    assert wrapped.optimizer_class == "torch.optim.adamw.AdamW"


def test_frozen_parameters_are_not_in_the_adamw_figure():
    from effitrain import optimizer_memory

    model = small_model()
    model[0].weight.requires_grad_(False)
    optimizer = adamw(model.parameters())  # the frozen weight is in the group, with no grad
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    result = optimizer_memory(optimizer)
    assert result.parameters == TENSORS - 1
    assert result.adamw_equivalent_bytes == ADAMW_BYTES - (8 * 8192 + 4)
    assert result.bytes == result.adamw_equivalent_bytes  # AdamW is its own reference


def test_before_the_first_step_the_summary_says_the_state_is_empty():
    from effitrain import optimizer_memory

    result = optimizer_memory(adamw(small_model().parameters()))
    assert result.is_empty and result.bytes == 0 and result.by_key == {}
    assert result.adamw_equivalent_bytes == ADAMW_BYTES  # the reference is known already
    assert "empty" in str(result) and "first optimizer.step()" in str(result)
    assert "0.0%" not in str(result)


# --------------------------------------------------------------------------------------------
# State dicts and files
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_saved_file_and_state_dict_give_the_live_numbers(make_optimizer, tmp_path):
    from effitrain import optimizer_memory

    _, optimizer = stepped(make_optimizer, steps=2)
    live = optimizer_memory(optimizer)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    saved = optimizer_memory(tmp_path / "optimizer.pt")
    in_memory = optimizer_memory(optimizer.state_dict())
    for other in (saved, in_memory):
        # All parameters have state, so the shapes it reveals are all the parameters.
        assert other.to_dict()["optimizer_state"] == live.to_dict()["optimizer_state"]
        assert other.metrics() == live.metrics()
        assert other.parameters == TENSORS and other.params_without_shape == 0
    assert saved.source.startswith(str(tmp_path / "optimizer.pt"))
    assert optimizer_memory(str(tmp_path / "optimizer.pt")).metrics() == live.metrics()


def test_empty_saved_state_says_so(tmp_path):
    from effitrain import optimizer_memory

    torch.save(adamw(small_model().parameters()).state_dict(), tmp_path / "optimizer.pt")
    result = optimizer_memory(tmp_path / "optimizer.pt")
    assert result.is_empty and "saved before the first optimizer.step()" in str(result)


def test_bad_inputs_are_named():
    from effitrain import optimizer_memory

    with pytest.raises(TypeError, match="torch optimizer, an optimizer state_dict or a path"):
        optimizer_memory(42)
    with pytest.raises(TypeError, match="state_dict"):
        optimizer_memory({"lr": 0.1})
    with pytest.raises(EffitrainError, match="no such file"):
        optimizer_memory("no/such/optimizer.pt")


# --------------------------------------------------------------------------------------------
# What it prints
# --------------------------------------------------------------------------------------------


def test_summary_table_and_dict():
    from rich.console import Console

    from effitrain import optimizer_memory

    result = optimizer_memory(stepped(adafactor)[1])
    lines = result.summary().splitlines()
    assert lines[0] == (
        f"Adafactor state: 748 elements, 2.9 KiB "
        f"({748 * 4 / ADAMW_BYTES:.1%} of AdamW's {ADAMW_ELEMENTS:,} elements, 115.8 KiB)"
    )
    assert lines[1:] == [
        "  step: 8 elements, 32 B (float32)",
        "  row_var: 162 elements, 648 B (float32)",
        "  col_var: 288 elements, 1.1 KiB (float32)",
        "  variance: 290 elements, 1.1 KiB (float32)",
    ]
    console = Console(file=io.StringIO(), width=120)
    result.print_table(console)
    text = console.file.getvalue()
    assert "Optimizer state: Adafactor (torch.optim." in text
    assert "row_var" in text and "8 params with state" in text and lines[0] in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["optimizer_state"]["by_key"]["variance"]["elements"] == 290
    assert data["adamw_equivalent_bytes"] == ADAMW_BYTES


# --------------------------------------------------------------------------------------------
# The Trainer callback, alone
# --------------------------------------------------------------------------------------------


def test_callback_adds_its_numbers_to_the_train_summary_log_and_prints_on_the_main_process():
    from rich.console import Console
    from transformers import TrainerControl, TrainerState

    from effitrain.integrations import EffitrainMemoryCallback

    _, optimizer = stepped(adafactor)
    console = Console(file=io.StringIO(), width=120)
    callback = EffitrainMemoryCallback(console=console)
    state, control = TrainerState(), TrainerControl()
    # What Trainer.log does: append a copy to the history, then call on_log with the dict.
    step_log = {"loss": 0.7}
    state.log_history.append({**step_log, "step": 1})
    callback.on_log(None, state, control, logs=step_log, optimizer=optimizer)
    assert step_log == {"loss": 0.7} and callback.result is None
    summary = {"train_runtime": 1.0, "train_loss": 0.7}
    state.log_history.append({**summary, "step": 1})
    callback.on_log(None, state, control, logs=summary, optimizer=optimizer)
    assert summary["optimizer_state_bytes"] == 748 * 4
    assert state.log_history[-1]["optimizer_state_bytes"] == 748 * 4
    assert summary["adamw_equivalent_bytes"] == ADAMW_BYTES
    assert "optimizer_state_bytes" not in state.log_history[0]

    state.is_world_process_zero = False
    callback.on_train_end(None, state, control, optimizer=optimizer)
    assert console.file.getvalue() == ""
    state.is_world_process_zero = True
    callback.on_train_end(None, state, control, optimizer=optimizer)
    assert "Optimizer state: Adafactor" in console.file.getvalue()


def test_callback_warns_instead_of_failing_on_an_optimizer_it_cannot_read(caplog):
    from transformers import TrainerControl, TrainerState

    from effitrain.integrations import EffitrainMemoryCallback

    callback = EffitrainMemoryCallback()
    logs = {"train_runtime": 1.0}
    callback.on_log(None, TrainerState(), TrainerControl(), logs=logs, optimizer=object())
    assert callback.result is None and logs == {"train_runtime": 1.0}
    assert "optimizer state not measured" in caplog.text


# --------------------------------------------------------------------------------------------
# The Trainer callback, against `effitrain train`
# --------------------------------------------------------------------------------------------


def table_rows(text: str) -> list[str]:
    """The lines of the first rich table in ``text``, from its top border to its bottom one."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    bottom = next(i for i in range(top, len(lines)) if lines[i].startswith("└"))
    return [line.rstrip() for line in lines[top : bottom + 1]]


def run_trainer(tmp_path, optim: str, memory_callback, ahead_of_integrations: bool):
    """Two steps of a real Trainer on the tiny preset; returns (trainer, TrainOutput, recorder).

    ``recorder`` stands where the report_to integrations stand: before every callback added
    with ``Trainer(callbacks=...)``/``add_callback``.
    """
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    from effitrain.demo import build_demo_dataset
    from effitrain.integrations import add_memory_callback
    from effitrain.models import load_model, load_tokenizer

    class Recorder(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    tokenizer = load_tokenizer("tiny")
    model = load_model("tiny", ["no", "yes"], tokenizer)
    rows = build_demo_dataset(num_train=64, num_validation=16)["train"].select(range(32))
    rows = rows.map(
        lambda batch: tokenizer(batch["sentence1"], batch["sentence2"], truncation=True),
        batched=True,
        remove_columns=["sentence1", "sentence2"],
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        optim=optim,
        max_steps=2,
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    recorder = Recorder()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[recorder],
    )
    if ahead_of_integrations:
        add_memory_callback(trainer, memory_callback)
    else:
        trainer.add_callback(memory_callback)
    return trainer, trainer.train(), recorder


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainer_optim", "effitrain_optim", "ahead_of_integrations"),
    [
        # Trainer's adamw_torch is torch.optim.AdamW; its adafactor is transformers' Adafactor
        # with relative_step=False, scale_parameter=False: effitrain's adafactor-hf.
        ("adamw_torch", "adamw", False),
        ("adafactor", "adafactor-hf", True),
    ],
)
def test_trainer_callback_logs_and_prints_what_effitrain_train_reports(
    train_cli, tmp_path, trainer_optim, effitrain_optim, ahead_of_integrations
):
    from rich.console import Console

    from effitrain.integrations import EffitrainMemoryCallback

    console = Console(file=io.StringIO(), width=200)
    callback = EffitrainMemoryCallback(console=console)
    trainer, output, recorder = run_trainer(
        tmp_path, trainer_optim, callback, ahead_of_integrations
    )
    numbers = callback.result.metrics()
    assert set(numbers) == {
        "optimizer_state_bytes",
        "optimizer_state_elements",
        "adamw_equivalent_bytes",
        "adamw_equivalent_elements",
    }
    # Added to the Trainer's final train log: its history and what train() returns.
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final and {k: final[k] for k in numbers} == numbers
    assert {k: output.metrics[k] for k in numbers} == numbers
    assert not any("optimizer_state_bytes" in log for log in trainer.state.log_history[:-1])
    # Integrations sit before the callbacks passed to the Trainer: they see the numbers only
    # when the callback was put ahead of them.
    assert ("optimizer_state_bytes" in recorder.logs[-1]) is ahead_of_integrations

    metrics_json = tmp_path / "metrics.json"
    proc = train_cli(
        "train",
        *("--model", "tiny", "--optim", effitrain_optim, "--max-steps", "2"),
        *("--batch-size", "8", "--metrics-json", str(metrics_json)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    effitrain = json.loads(metrics_json.read_text())
    # The state's layout depends on the optimizer and the parameters, not on lr or data: the
    # same model and optimizer class give the same ledger, key for key, to the byte. Both
    # optimize every parameter of the model (the Trainer in two groups, decay / no decay).
    assert callback.result.to_dict()["optimizer_state"] == effitrain["optimizer_state"]
    assert numbers["adamw_equivalent_bytes"] == effitrain["adamw_equivalent_bytes"]
    assert numbers["adamw_equivalent_elements"] == effitrain["adamw_equivalent_elements"]
    assert effitrain["optimizer_class"].rpartition(".")[2] == callback.result.name
    # …and the same table as `effitrain train` prints, row for row.
    printed = console.file.getvalue()
    assert table_rows(printed) == table_rows(proc.stdout)
    assert callback.result.headline() in printed
