"""Every optimizer of the registry learns: on the tiny preset it overfits a handful of examples
(8 random token sequences, two labels) in 15 steps at its from-scratch default lr, with the
loop's default clipping (global norm 1.0), so that the training loss falls by at least half,
and every trained tensor moves (for Muon, GaLore and APOLLO: the hidden matrices too, not only
the rest that AdamW trains).

Whether a whole run reaches an accuracy on real data is a benchmark, with its thresholds:
``benchmarks/learning/``.
"""

from __future__ import annotations

import pytest

from effitrain.config import TrainConfig
from effitrain.optim import OPTIMIZERS, build_optimizer, get_spec, set_train_mode

STEPS = 15
TORCHAO = [name for name, spec in OPTIMIZERS.items() if spec.module == "torchao"]


@pytest.fixture(scope="module")
def examples():
    import torch

    from effitrain.models import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, len(tokenizer), (8, 16), generator=generator)
    return tokenizer, {"input_ids": input_ids, "labels": torch.tensor([0, 1] * 4)}


def overfit(name: str, examples) -> None:
    import torch

    from effitrain.models import load_model

    spec = get_spec(name)
    if not spec.is_available():
        pytest.skip(f"{name}: {spec.install}")
    tokenizer, batch = examples
    torch.manual_seed(0)
    model = load_model("tiny", ["a", "b"], tokenizer)
    optimizer = build_optimizer(model, name, spec.scratch.lr, TrainConfig().weight_decay)
    set_train_mode(optimizer, True)  # as a run does (schedule-free steps only in train mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] <= 0.5 * losses[0], losses
    still = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not still, f"{name} never updated {still}"


FAST = ("adamw", "adafactor", "adafactor-hf", "adamw-8bit")
"""The default comparison's optimizers (and the Trainer's Adafactor) learn in the fast tier; the
others in the full suite."""


@pytest.mark.parametrize(
    "name",
    [
        name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
        for name in OPTIMIZERS
        if name not in TORCHAO
    ],
)
def test_overfits_a_handful_of_examples(name, examples):
    overfit(name, examples)


@pytest.mark.parametrize(
    "name",
    [n if n == "adamw-8bit-ao" else pytest.param(n, marks=pytest.mark.slow) for n in TORCHAO],
)
def test_torchao_overfits_with_its_update_run_eagerly(name, examples, uncompiled):
    overfit(name, examples)


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHAO)
def test_torchao_overfits_with_its_traced_update(name, examples, traced_not_inductor):
    # The update traced whole, as torchao compiles it (no inductor kernels), on the tiny
    # preset's shapes and parameter groups as in test_optim_ao's runs: one xdist worker runs
    # both files (conftest.SAME_WORKER), so the traced graphs are shared.
    overfit(name, examples)
