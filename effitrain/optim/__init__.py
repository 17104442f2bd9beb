"""Optimizers: the registry and the wrappers it builds on.

- :mod:`.optimizer_spec`: what an entry says (:class:`OptimizerSpec`, its :class:`Defaults`);
- :mod:`.registry`: the table, name -> spec, and the measured state bytes;
- :mod:`.factories`: how each library's optimizer is made (and its FSDP2 variant);
- :mod:`.hyperparameters`: the lr and schedule a run uses;
- :mod:`.groups`: weight-decay groups and bitsandbytes' 32-bit embedding state;
- :mod:`.construction`: an optimizer built from its spec over a model;
- :mod:`.schedule`: the lr scheduler;
- :mod:`.low_bit`: torchao's 8-bit, 4-bit and FP8 AdamW;
- :mod:`.adam_mini`: Adam-mini's per-head and per-row blocks;
- :mod:`.split`: Muon, GaLore and APOLLO on the hidden matrices, AdamW on the rest;
- :mod:`.in_backward`: one optimizer per parameter, stepped inside backward;
- :mod:`.fsdp2`: the factored Adafactors and CAME on FSDP2's sharded parameters;
- :mod:`.bf16`: bf16 weights with torch-optimi's Kahan summation or stochastic rounding
  (:mod:`.stochastic_rounding`, the Adafactors).

Nothing heavy is imported here: ``effitrain optimizers`` and ``--help`` stay instant.
"""

from effitrain.optim.construction import build_optimizer
from effitrain.optim.factories import for_sharding, set_train_mode
from effitrain.optim.groups import embedding_weights, param_groups
from effitrain.optim.hyperparameters import Hyperparameters, LrDivisor, resolve_hyperparameters
from effitrain.optim.optimizer_spec import FINE_TUNE, SCRATCH, Defaults, OptimizerSpec, ParamGroups
from effitrain.optim.registry import (
    IN_BACKWARD_REFUSED,
    OPTIMIZERS,
    check_options,
    get_spec,
    measured_state_bytes,
    state_bytes_per_param,
)
from effitrain.optim.schedule import build_scheduler

__all__ = [
    "FINE_TUNE",
    "IN_BACKWARD_REFUSED",
    "OPTIMIZERS",
    "SCRATCH",
    "Defaults",
    "Hyperparameters",
    "LrDivisor",
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
