"""The training loop, top to bottom.

Build in order (data -> model -> optimizer -> scheduler -> prepare), then for each batch:
forward, ``accelerator.backward``, clip, ``optimizer.step``, ``lr_scheduler.step``,
``optimizer.zero_grad``; evaluate after each epoch; measure the optimizer state at the end.
Every process computes; only the main process prints (through the reporter).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from effitrain import memory
from effitrain.config import TrainConfig
from effitrain.data import build_dataloaders, load_data, steps_per_epoch
from effitrain.errors import EffitrainError
from effitrain.models import load_model, load_tokenizer
from effitrain.optim import build_optimizer, build_scheduler, get_spec, resolve_lr
from effitrain.report import Reporter, RunInfo, StepLog

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader


@dataclass
class TrainResult:
    """What a run measured; ``to_dict`` is the ``--metrics-json`` object."""

    optimizer: str
    optimizer_class: str
    lr: float
    global_steps: int
    epochs: int
    train_loss: float
    eval: dict[str, float]
    eval_history: list[dict[str, float]]
    optimizer_state: memory.OptimizerStateLedger
    parameter_bytes: int
    trainable_parameters: int
    gradient_bytes: int
    adamw_equivalent_bytes: int
    adamw_equivalent_elements: int
    peak_memory_bytes: int
    peak_memory_kind: str
    seconds_per_step: float
    samples_per_second: float
    train_seconds: float
    num_processes: int
    mixed_precision: str
    device: str
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer_state"] = self.optimizer_state.to_dict()
        return data


def evaluate(model: Any, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Loss, accuracy and F1 over the whole validation set, each example counted once.

    ``gather_for_metrics`` drops the samples that the last batch repeats to even out processes.
    F1 is binary for two labels and macro-averaged otherwise (scikit-learn).
    """
    import torch
    import torch.nn.functional as F
    from sklearn.metrics import accuracy_score, f1_score

    model.eval()
    predictions, references, losses = [], [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        per_example_loss = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        preds, refs, loss = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"], per_example_loss)
        )
        predictions.append(preds.cpu())
        references.append(refs.cpu())
        losses.append(loss.cpu())
    model.train()
    y_pred = torch.cat(predictions).numpy()
    y_true = torch.cat(references).numpy()
    num_labels = accelerator.unwrap_model(model).config.num_labels
    average = "binary" if num_labels == 2 else "macro"
    return {
        "loss": float(torch.cat(losses).mean()),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "f1": float(f1_score(y_true, y_pred, average=average, zero_division=0)),
        "examples": int(len(y_true)),
    }


def _check_outputs_writable(config: TrainConfig) -> None:
    """Fail before training, not after it, when results could not be written."""
    from pathlib import Path

    if config.metrics_json:
        parent = Path(config.metrics_json).expanduser().resolve().parent
        existing = next(p for p in (parent, *parent.parents) if p.exists())
        if not existing.is_dir():
            raise EffitrainError(
                f"--metrics-json {config.metrics_json}: {existing} is not a folder"
            )


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run one training job as configured and return what it measured.

    Raises:
        EffitrainError: a user-fixable problem (bad data, model, optimizer, options).
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    _check_outputs_writable(config)
    try:
        accelerator = Accelerator(
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.grad_accum,
            # A seedable sampler makes data order depend only on (seed, epoch), on every rank.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        )
    except (ValueError, RuntimeError) as exc:
        raise EffitrainError(
            f"--mixed-precision {config.mixed_precision} is not available here: {exc}"
        ) from exc
    if reporter is None:
        reporter = Reporter(enabled=accelerator.is_main_process, quiet=config.quiet)
    set_seed(config.seed)
    if accelerator.num_processes == 1 and torch.cuda.device_count() > 1:
        reporter.note(
            f"{torch.cuda.device_count()} GPUs are visible but this run uses one; to use them all: "
            "accelerate launch --multi_gpu -m effitrain train ..."
        )

    # 1. Data and model. The main process goes first so it alone fills the datasets cache.
    with accelerator.main_process_first():
        data = load_data(config)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, data.num_labels, data.label_names, tokenizer)
    with accelerator.main_process_first():
        train_loader, eval_loader = build_dataloaders(
            data,
            tokenizer,
            config,
            pad_to_multiple_of=8 if config.mixed_precision != "no" else None,
        )
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)

    # 2. How long: optimizer steps per epoch on this process, and in total.
    per_epoch = steps_per_epoch(len(train_loader), config.grad_accum)
    if per_epoch == 0:
        raise EffitrainError("the training set yields no batches; check --batch-size and the data")
    total_steps = config.max_steps or per_epoch * config.epochs
    num_epochs = math.ceil(total_steps / per_epoch)
    warmup = (
        config.warmup_steps
        if config.warmup_steps is not None
        else math.ceil(total_steps * config.warmup_ratio)
    )

    # 3. Optimizer and schedule. Accelerate's prepared scheduler steps once per process on every
    # optimizer step, so its lengths are counted in process-steps.
    spec = get_spec(config.optim)
    lr = resolve_lr(config)
    optimizer = build_optimizer(model, config)
    n = accelerator.num_processes
    lr_scheduler = build_scheduler(optimizer, config, total_steps * n, warmup * n)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)

    reporter.run_started(
        RunInfo(
            model=config.model,
            model_class=type(accelerator.unwrap_model(model)).__name__,
            parameters=memory.trainable_parameter_count(model),
            dataset=data.source,
            train_examples=len(data.train),
            validation_examples=len(data.validation),
            validation_source=data.validation_source,
            text_columns=data.text_columns,
            label_column=data.label_column,
            num_labels=data.num_labels,
            optimizer=spec.name,
            optimizer_class=spec.class_path,
            lr=lr,
            total_steps=total_steps,
            epochs=num_epochs,
            steps_per_epoch=per_epoch,
            global_batch_size=config.batch_size * config.grad_accum * n,
            device=str(accelerator.device),
            num_processes=n,
            mixed_precision=accelerator.mixed_precision,
        )
    )

    # 4. The loop.
    device = accelerator.device
    global_step = 0
    gradient_bytes = 0
    # Running sums since the last log line: loss, micro-batches, samples. They stay on the device:
    # reading them (.tolist()) syncs, so it happens once per log interval, not per step.
    window = torch.zeros(3, device=device, dtype=torch.float64)
    total_loss, total_batches, total_samples = 0.0, 0.0, 0.0
    step_seconds: list[float] = []
    eval_history: list[dict[str, float]] = []
    final_eval: dict[str, float] | None = None
    reporter.progress_started(total_steps)
    window_start = last_step_end = time.perf_counter()
    model.train()
    for epoch in range(num_epochs):
        for batch in train_loader:
            # Inside accumulate(), backward only syncs gradients (and the optimizer only steps)
            # on the last micro-batch of each group; on the others step/zero_grad are no-ops.
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if global_step == 0:
                        gradient_bytes = memory.gradient_bytes(model)
                    if config.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            window += torch.stack(
                [
                    loss.detach().to(torch.float64),
                    torch.ones((), device=device, dtype=torch.float64),
                    torch.tensor(batch["labels"].shape[0], device=device, dtype=torch.float64),
                ]
            )
            if not accelerator.sync_gradients:
                continue

            global_step += 1
            now = time.perf_counter()
            step_seconds.append(now - last_step_end)
            last_step_end = now
            reporter.step_done(global_step)
            if global_step % config.log_every == 0 or global_step == total_steps:
                # Summed over processes: the loss shown is the mean over every rank's batches.
                loss_sum, batches, samples = accelerator.reduce(window, "sum").tolist()
                window.zero_()
                total_loss += loss_sum
                total_batches += batches
                total_samples += samples
                elapsed = now - window_start
                window_start = now
                recent = step_seconds[-config.log_every :]
                reporter.logged(
                    StepLog(
                        step=global_step,
                        total_steps=total_steps,
                        epoch=epoch + 1,
                        loss=loss_sum / max(batches, 1),
                        lr=lr_scheduler.get_last_lr()[0],
                        samples_per_second=samples / elapsed if elapsed > 0 else 0.0,
                        eta_seconds=(total_steps - global_step) * statistics.fmean(recent),
                    )
                )
            if global_step >= total_steps:
                break

        # Evaluate after each epoch (or where max_steps stops); the time is not training time.
        eval_start = time.perf_counter()
        metrics = evaluate(model, eval_loader, accelerator)
        metrics["epoch"] = epoch + 1
        metrics["step"] = global_step
        eval_history.append(metrics)
        final_eval = metrics
        stopped_mid_epoch = global_step >= total_steps and global_step % per_epoch != 0
        reporter.evaluated(epoch + 1, metrics, final=stopped_mid_epoch)
        pause = time.perf_counter() - eval_start
        window_start += pause
        last_step_end += pause
        if global_step >= total_steps:
            break
    reporter.progress_finished()

    # 5. What it cost, measured from the real storage.
    assert final_eval is not None
    train_seconds = sum(step_seconds)
    peak_bytes, peak_kind = memory.peak_memory_bytes(device)
    result = TrainResult(
        optimizer=spec.name,
        optimizer_class=spec.class_path,
        lr=lr,
        global_steps=global_step,
        epochs=len(eval_history),
        train_loss=total_loss / max(total_batches, 1),
        eval={k: final_eval[k] for k in ("accuracy", "f1", "loss", "examples")},
        eval_history=eval_history,
        optimizer_state=memory.optimizer_state_ledger(optimizer),
        parameter_bytes=memory.parameter_bytes(model),
        trainable_parameters=memory.trainable_parameter_count(model),
        gradient_bytes=gradient_bytes,
        adamw_equivalent_bytes=memory.adamw_equivalent_bytes(model),
        adamw_equivalent_elements=memory.adamw_equivalent_elements(model),
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        # The first step pays one-off costs (allocations, lazy state init): leave it out.
        seconds_per_step=statistics.median(step_seconds[1:] or step_seconds),
        samples_per_second=total_samples / train_seconds if train_seconds > 0 else 0.0,
        train_seconds=train_seconds,
        num_processes=n,
        mixed_precision=accelerator.mixed_precision,
        device=str(device),
        config=config.to_dict(),
    )
    return result
