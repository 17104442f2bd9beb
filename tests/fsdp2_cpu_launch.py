"""``effitrain ...`` under Accelerate's real FSDP2 on CPU processes over gloo: a test harness.

    accelerate launch --config_file configs/accelerate/fsdp2-full-shard.yaml --num_processes 2 \\
        tests/fsdp2_cpu_launch.py train --optim adafactor ...

Accelerate turns ``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` only inside the
``elif self.distributed_type in [MULTI_GPU, ...]`` branch of ``AcceleratorState.__init__``
(accelerate/state.py). On a machine without GPUs effitrain asks for CPU processes, so Accelerate's
state is MULTI_CPU and FSDP is silently dropped (effitrain then refuses the run: FSDP needs GPUs).

The one patch: on the first ``AcceleratorState`` init, when FSDP is asked for, create the
PartialState as ``AcceleratorState`` would and show its MULTI_CPU as MULTI_GPU for the length of
the original ``__init__``. Accelerate's own branch then sets ``distributed_type = FSDP`` and its
plugin; backend, device and process group stay MULTI_CPU's (gloo, cpu). Everything after that
(``fully_shard``, ``save_state``/``load_state`` with torch.distributed.checkpoint) is
Accelerate's and effitrain's unchanged code.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, parse_flag_from_env

_STATE_ARGS = {
    "mixed_precision",
    "dynamo_plugin",
    "deepspeed_plugin",
    "fsdp_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "parallelism_config",
    "_from_accelerator",
}
"""AcceleratorState's arguments that PartialState does not take."""
_original_init = AcceleratorState.__init__


def _init(self, *args, cpu=False, **kwargs):
    wants_fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP") or kwargs.get("fsdp_plugin") is not None
    if not wants_fsdp or AcceleratorState._shared_state:  # not asked for, or already made
        return _original_init(self, *args, cpu=cpu, **kwargs)
    cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU")
    if not PartialState._shared_state:  # what AcceleratorState.__init__ would do
        PartialState(cpu, **{k: v for k, v in kwargs.items() if k not in _STATE_ARGS})
    shared = PartialState._shared_state
    if shared["distributed_type"] != DistributedType.MULTI_CPU:
        return _original_init(self, *args, cpu=cpu, **kwargs)
    shared["distributed_type"] = DistributedType.MULTI_GPU  # enter Accelerate's FSDP branch
    try:
        _original_init(self, *args, cpu=cpu, **kwargs)  # sets FSDP here and in PartialState
    finally:
        for state in (shared, self.__dict__):  # __init__ raised before the FSDP branch: undo
            if state.get("distributed_type") == DistributedType.MULTI_GPU:
                state["distributed_type"] = DistributedType.MULTI_CPU


AcceleratorState.__init__ = _init


@contextmanager
def fsdp_on_cpu() -> Iterator[None]:
    """The patch for a block of a process that goes on afterwards (a test's), then Accelerate
    as it was."""
    AcceleratorState.__init__ = _init
    try:
        yield
    finally:
        AcceleratorState.__init__ = _original_init


if __name__ == "__main__":
    from effitrain.cli import main

    sys.argv[0] = "effitrain"
    main()
