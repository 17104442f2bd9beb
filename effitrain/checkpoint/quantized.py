"""A QLoRA resume's check (``effitrain.levers.qlora``): the checkpoint's 4-bit base is the one just
quantized from ``--model``, and its other entries are this model's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    import torch


def check_checkpoint_base(model: torch.nn.Module, checkpoint: Any) -> None:
    """Before resuming: the checkpoint's 4-bit base (packed codes and quant states) must be the
    one just rebuilt from ``--model``, and every other entry must be there. Accelerate's strict
    load cannot take bitsandbytes' quant-state entries (``Linear4bit`` saves them but does not
    load them), so the run loads non-strictly after this check.

    Raises:
        EffitrainError: a key is missing or extra, or a 4-bit weight differs (another base model).
    """
    from pathlib import Path

    import torch
    from safetensors import safe_open

    expected = model.state_dict()
    found: dict[str, Any] = {}
    for file in sorted(Path(checkpoint).glob("model*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    saved = {expected[key].data_ptr() for key in found if key in expected}
    # A tied weight (the output layer sharing the embeddings) is saved once, under one name.
    missing = [k for k in expected if k not in found and expected[k].data_ptr() not in saved]
    missing += sorted(set(found) - set(expected))
    if missing:
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its model does not match this one ({missing[0]} "
            "is in one of them only); resume with the options it was saved with"
        )
    for key, value in expected.items():
        if ".base_layer.weight" in key and not torch.equal(found[key], value.detach().cpu()):
            raise EffitrainError(
                f"cannot resume from {checkpoint}: its 4-bit base weight {key} differs from the "
                "one quantized from --model now; resume with the base model it was trained on"
            )


SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"
"""Where Accelerate's ``save_state`` writes an FSDP2 model in ``SHARDED_STATE_DICT`` form
(torch.distributed.checkpoint), under the keys ``model.<name>``."""


def check_sharded_checkpoint_base(
    accelerator: Any, model: torch.nn.Module, checkpoint: Any
) -> None:
    """:func:`check_checkpoint_base` for an FSDP2 checkpoint in ``SHARDED_STATE_DICT`` form:
    the same keys, and each rank's shard of every 4-bit weight's packed codes equal to the one
    just quantized from ``--model`` (read by torch.distributed.checkpoint into this rank's
    layout). A collective: every process calls it, and every one raises.

    Raises:
        EffitrainError: as :func:`check_checkpoint_base`.
    """
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp

    from effitrain.memory.ledger import is_4bit

    folder = Path(checkpoint) / SHARDED_MODEL_DIR
    expected = model.state_dict(keep_vars=True)
    found = (
        {
            key.removeprefix("model.")
            for key in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        }
        if folder.is_dir()
        else set()
    )
    odd = sorted(set(expected) ^ found)
    if odd:
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its model does not match this one ({odd[0]} "
            "is in one of them only); resume with the options it was saved with"
        )
    codes = {key: value.detach() for key, value in expected.items() if is_4bit(value)}
    saved = {key: torch.empty_like(value) for key, value in codes.items()}
    dcp.load({"model": saved}, checkpoint_id=str(folder))
    # As bytes: codes stored as bf16 read as floats include NaNs, never equal to themselves.
    differ = [
        key
        for key in codes
        if not torch.equal(
            saved[key].to_local().view(torch.uint8), codes[key].to_local().view(torch.uint8)
        )
    ]
    flag = torch.tensor(float(bool(differ)), device=accelerator.device)
    if float(accelerator.reduce(flag, "sum")) > 0:
        where = differ[0] if differ else "a 4-bit base weight on another process"
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its 4-bit base weight {where} differs from the "
            "one quantized from --model now; resume with the base model it was trained on"
        )
