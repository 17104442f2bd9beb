"""The lr schedules are transformers' (``get_scheduler``), step for step: effitrain writes the
factors itself only so that a run's start does not import the Trainer's utilities."""

from __future__ import annotations

import pytest
import torch

from effitrain.config import SCHEDULERS
from effitrain.optim.schedule import build_scheduler


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("total, warmup", [(10, 0), (10, 3), (7, 7), (1, 0), (100, 6)])
def test_each_schedule_equals_transformers_at_every_step(name, total, warmup):
    from transformers import get_scheduler

    def lrs(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        scheduler = make(optimizer)
        out = []
        for _ in range(total + 2):  # past the end too: a schedule's tail stays at its floor
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out, scheduler.state_dict()

    ours, our_state = lrs(lambda o: build_scheduler(o, name, total, warmup))
    hf_name = {"constant": "constant_with_warmup"}.get(name, name)
    theirs, their_state = lrs(
        lambda o: get_scheduler(hf_name, o, num_warmup_steps=warmup, num_training_steps=total)
    )
    assert ours == theirs
    assert our_state.keys() == their_state.keys()  # what a checkpoint keeps of it
