"""The memory levers: each one flag, checked before anything is built, applied in one place.

===========================  ===============================  ======================================
lever (name in the metrics)  option                           what it removes
===========================  ===============================  ======================================
gradient-checkpointing       ``--gradient-checkpointing``     most activations (recomputed in
                                                              backward)
optimizer-in-backward        ``--optimizer-in-backward``      the full set of gradients
bf16-weights                 ``--weights-dtype bf16``         half of parameters, gradients, state
lora                         ``--lora-rank R``                gradients and state of the base model
load-in-4bit                 ``--load-in-4bit``               7/8 of the frozen base's Linear weights
activation-offload           ``--activation-offload``         saved activations from the GPU (CUDA)
optimizer-offload            ``--optimizer-offload state``    optimizer state from the GPU (CUDA;
                                                              ``state+grads``: gradients too)
===========================  ===============================  ======================================

``TrainConfig.validate`` refuses lever values that cannot work on their own and
:func:`check_options` the levers an optimizer cannot take, one line each, before anything is
built; :func:`check_launch` refuses what depends on how the run was launched;
:func:`apply_to_model` turns the model-side levers on, between loading the model and building
the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    from effitrain.config import TrainConfig


def active(config: TrainConfig) -> list[str]:
    """The levers this run turns on, by their names in the metrics JSON (``levers``)."""
    names = []
    if config.gradient_checkpointing:
        names.append("gradient-checkpointing")
    if config.optimizer_in_backward:
        names.append("optimizer-in-backward")
    if config.weights_dtype == "bf16":
        names.append("bf16-weights")
    if config.lora_rank is not None:
        names.append("lora")
    if config.load_in_4bit:
        names.append("load-in-4bit")
    if config.activation_offload:
        names.append("activation-offload")
    if config.optimizer_offload != "off":
        names.append("optimizer-offload")
    return names


def check_options(config: TrainConfig) -> None:
    """Refuse a lever with an optimizer that cannot take it.

    Raises:
        EffitrainError: one line naming both, and what to use instead.
    """
    from effitrain.optim.bf16 import refusal

    if config.optimizer_in_backward:
        _check_per_parameter(
            config,
            "--optimizer-in-backward",
            "it is built over the whole model, not one parameter at a time",
        )
    problem = refusal(config)
    if problem:
        raise EffitrainError(problem)
    if config.optimizer_offload != "off":
        # torchao's offload runs one optimizer per parameter too, with the same limits.
        _check_per_parameter(
            config,
            "--optimizer-offload",
            "it is built over the whole model, and the offload runs one per parameter",
        )
    if config.lora_rank is not None and config.optim == "adafactor":
        # Its update is relative to each weight's RMS; LoRA's B matrices start at zero.
        raise EffitrainError(
            "--optim adafactor cannot train LoRA adapters: its step is relative to each "
            "weight's size (RMS), and LoRA's B matrices start at zero, so they barely move; "
            "use --optim adafactor-hf (the Trainer's Adafactor: the same factored state, a "
            "plain lr) or adamw"
        )


def _check_per_parameter(config: TrainConfig, flag: str, whole_model: str) -> None:
    """A lever that runs one optimizer per parameter: refuse the optimizers that cannot be one
    (``whole_model`` says why for those built over the model)."""
    from effitrain.optim import IN_BACKWARD_REFUSED, get_spec

    why = IN_BACKWARD_REFUSED.get(config.optim)
    if not get_spec(config.optim).per_parameter:
        why = whole_model
    if why:
        raise EffitrainError(
            f"--optim {config.optim} cannot combine with {flag}: {why}; use another --optim or "
            "leave the lever out"
        )


def _check_offload_launch(config: TrainConfig, state: Any, sharding: Any) -> None:
    """Both offloads move tensors from a CUDA device to host memory; the optimizer's runs on one
    process only."""
    device = getattr(state, "device", None)
    on_cuda = getattr(device, "type", None) == "cuda"
    for on, flag, what in (
        (config.activation_offload, "--activation-offload", "activations"),
        (config.optimizer_offload != "off", "--optimizer-offload", "the optimizer state"),
    ):
        if on and not on_cuda:
            raise EffitrainError(
                f"{flag} moves {what} from the GPU to host memory; this run's device is "
                f"{'the CPU' if getattr(device, 'type', 'cpu') == 'cpu' else device}: drop "
                f"{flag}"
            )
    if config.optimizer_offload != "off" and (
        sharding.kind != "single" or sharding.num_processes > 1
    ):
        # torchao copies each gradient in a post-accumulate-grad hook, before DDP's all-reduce
        # (it would step on this process's gradient alone); FSDP and DeepSpeed own the state.
        raise EffitrainError(
            f"--optimizer-offload cannot run on {sharding.description}: each gradient is copied "
            "to the host before the processes average them; run one process (or use FSDP's or "
            "DeepSpeed's own CPU offload)"
        )


def check_launch(config: TrainConfig, state: Any) -> None:
    """Refuse levers that the launch (processes, FSDP, DeepSpeed) rules out.

    ``state`` is Accelerate's ``AcceleratorState``.

    Raises:
        EffitrainError: one line naming the lever and the launch.
    """
    from effitrain.distributed import detect_sharding

    sharding = detect_sharding(state)
    _check_offload_launch(config, state, sharding)
    sharded = sharding.sharded
    if config.lora_rank is not None:
        from effitrain.lora import require_peft

        require_peft()
        if sharded:
            # Refused, not left unverified: peft under FSDP needs its own wrap policy and mixed
            # frozen/trainable shards, and the adapters would have to be gathered from the
            # shards for the final save.
            raise EffitrainError(
                f"--lora-rank is not supported under {sharding.description}: LoRA's base "
                "weights are frozen, so plain DDP (accelerate launch --multi_gpu) or one process "
                "fits where full fine-tuning needed sharding"
            )
    if config.optimizer_in_backward and (sharding.kind != "single" or sharding.num_processes > 1):
        # The update runs in a post-accumulate-grad hook, which fires before DDP's all-reduce
        # (it would use this process's gradient alone); FSDP and DeepSpeed own the gradients.
        raise EffitrainError(
            f"--optimizer-in-backward cannot run on {sharding.description}: each update runs "
            "as soon as this process's gradient is ready, before the processes average their "
            "gradients; run one process, or drop --optimizer-in-backward"
        )
    if config.load_in_4bit:
        from effitrain.quantize import require_bitsandbytes

        require_bitsandbytes()  # under sharding, --lora-rank is refused above
    if config.weights_dtype == "bf16" and sharded:
        # Refused, not left unverified: both bring their own low-precision parameters, and
        # optimi's Kahan buffers are not sharding-aware.
        raise EffitrainError(
            f"--weights-dtype bf16 is not supported under {sharding.description}: use its "
            "own bf16 (FSDP's mixed-precision policy, DeepSpeed's bf16 section) with "
            "--weights-dtype fp32"
        )


def apply_to_model(model: Any, config: TrainConfig, device: Any = None) -> Any:
    """Turn on the levers that change the model; returns the model to train (LoRA wraps it).
    ``device``: where the run trains, where 4-bit weights are quantized (default: where the
    model is; on the meta device, ``effitrain estimate``'s, they are not quantized yet).

    Raises:
        EffitrainError: the model cannot take a lever (e.g. no gradient checkpointing).
    """
    from effitrain.optim.bf16 import cast_model

    if config.load_in_4bit:
        from effitrain.quantize import quantize_model

        model = quantize_model(model, config, device)
    model = cast_model(model, config)  # before any adapter is added: adapters stay fp32
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.lora_rank is not None:
        # Last: peft wraps the model as it is then (dtype included: adapters over bf16 base
        # weights are created in fp32, peft's autocast_adapter_dtype).
        from effitrain.lora import apply
        from effitrain.optim.bf16 import keep_trained_fp32

        model = apply(model, config)
        if config.weights_dtype == "bf16":
            keep_trained_fp32(model)
    return model


def describe(config: TrainConfig, model: Any) -> list[str]:
    """One banner line per lever that is on (``model``: unwrapped)."""
    from effitrain.optim.bf16 import banner_line

    weights = banner_line(config)  # None for fp32 weights
    lines = [weights] if weights else []
    if config.gradient_checkpointing:
        lines.append("gradient checkpointing (non-reentrant: activations recomputed in backward)")
    if config.optimizer_in_backward:
        lines.append(
            "optimizer step in backward: each parameter is updated as soon as its gradient is "
            "ready, then the gradient is freed (no clipping)"
        )
    if config.lora_rank is not None:
        from effitrain.lora import describe as describe_lora

        lines.append(describe_lora(model, config))
    if config.load_in_4bit:
        from effitrain.quantize import describe as describe_4bit

        lines.append(describe_4bit(model, config))
    if config.activation_offload:
        lines.append(
            "activation offload: tensors saved for backward wait in pinned host memory (trl's "
            "OffloadActivations, copies on a side CUDA stream"
            + ("; only the checkpoints" if config.gradient_checkpointing else "")
            + ")"
        )
    if config.optimizer_offload != "off":
        grads = (
            ", and each gradient once copied" if config.optimizer_offload == "state+grads" else ""
        )
        lines.append(
            "optimizer offload: state and step on the host for tensors of 4096+ elements "
            f"(torchao's CPUOffloadOptimizer{grads}); no clipping"
        )
    return lines


def quantized_weights(config: TrainConfig, model: Any) -> dict[str, int] | None:
    """--load-in-4bit: what the 4-bit weights take (metrics ``quantized_weights``), else None."""
    if not config.load_in_4bit:
        return None
    from effitrain.quantize import storage

    return storage(model).to_dict()


def offload_results(run: Any) -> dict[str, Any]:
    """The offload levers' fields of the metrics JSON (``TrainResult``); {} without them."""
    results: dict[str, Any] = {}
    if run.activation_offload is not None:
        results["activation_offload_host_bytes"] = run.activation_offload.host_bytes.peak
    if run.config.optimizer_offload != "off":
        from effitrain.optim.offload import offload_ledger

        results["optimizer_offload"] = offload_ledger(run.optimizer)
    return results


def activation_offload(config: TrainConfig, model: Any) -> Any:
    """--activation-offload's context for ``model`` (unwrapped), its ``host_bytes`` counting
    what it moves; None without the lever."""
    if not config.activation_offload:
        return None
    from effitrain.activation_offload import HostBytes, offload_context

    counter = HostBytes()
    context = offload_context(model, counter)
    context.host_bytes = counter
    return context


def original_parameters(model: Any) -> Any:
    """The parameters the model had before any lever added some (LoRA's adapters and head
    copies): what "the same model trained whole" trains."""
    from effitrain.lora import original_parameters
    from effitrain.models import is_lora

    return original_parameters(model) if is_lora(model) else model


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in backward: the model's own (transformers'
    ``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``), non-reentrant
    implementation (the reentrant one needs inputs that require grad and breaks with frozen
    embeddings).

    Raises:
        EffitrainError: the architecture has no gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise EffitrainError(
            f"--gradient-checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing in transformers; drop the option or choose another model"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
