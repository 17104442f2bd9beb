"""Optimizers: the registry (:mod:`.registry`) and the wrappers it builds on.

- :mod:`.low_bit`: torchao's 8-bit, 4-bit and FP8 AdamW;
- :mod:`.adam_mini`: Adam-mini's per-head and per-row blocks;
- :mod:`.split`: Muon, GaLore and APOLLO on the hidden matrices, AdamW on the rest;
- :mod:`.in_backward`: one optimizer per parameter, stepped inside backward;
- :mod:`.fsdp2`: the factored Adafactors and CAME on FSDP2's sharded parameters;
- :mod:`.bf16`: bf16 weights with torch-optimi's Kahan summation or stochastic rounding
  (:mod:`.stochastic_rounding`, the Adafactors).

Nothing heavy is imported here: ``effitrain optimizers`` and ``--help`` stay instant.
"""

from effitrain.optim.registry import (
    FINE_TUNE,
    IN_BACKWARD_REFUSED,
    OPTIMIZERS,
    SCRATCH,
    Defaults,
    Hyperparameters,
    OptimizerSpec,
    ParamGroups,
    build_optimizer,
    build_scheduler,
    check_options,
    embedding_weights,
    for_sharding,
    get_spec,
    measured_state_bytes,
    param_groups,
    resolve_hyperparameters,
    set_train_mode,
    state_bytes_per_param,
)

__all__ = [
    "FINE_TUNE",
    "IN_BACKWARD_REFUSED",
    "OPTIMIZERS",
    "SCRATCH",
    "Defaults",
    "Hyperparameters",
    "OptimizerSpec",
    "ParamGroups",
    "build_optimizer",
    "build_scheduler",
    "check_options",
    "embedding_weights",
    "for_sharding",
    "get_spec",
    "measured_state_bytes",
    "param_groups",
    "resolve_hyperparameters",
    "set_train_mode",
    "state_bytes_per_param",
]
