"""`effitrain inspect-state`: every supported layout, the numbers, and files that must be refused."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error


def stepped(optimizer_cls, **kwargs):
    """A small model and one step of ``optimizer_cls``; returns (model, optimizer)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2))
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def inspect_json(train_cli, path, *extra) -> dict:
    proc = train_cli("inspect-state", str(path), "--json", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_effitrain_checkpoint_with_adafactor(train_cli, data, tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.json"
    args = train_args(data, out, "--optim", "adafactor", "--max-steps", "3", "--save-every", "3")
    proc = train_cli(*args, "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stderr

    proc = train_cli("inspect-state", str(out / "checkpoint-3"), "--top", "10")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "effitrain checkpoint" in text and "adafactor (torch.optim.Adafactor)" in text
    assert "step       3" in text and "row_var" in text and "col_var" in text
    assert "factored" in text and "of AdamW" in text
    # named from effitrain.json; the prefix every row shares is said once
    assert "names under distilbert." in text and "embeddings.word_embeddings.weight" in text

    report = inspect_json(train_cli, out / "checkpoint-3", "--top", "100")
    # The same accounting as `train --metrics-json`, field for field.
    assert report["optimizer_state"] == json.loads(metrics.read_text())["optimizer_state"]
    assert report["format"] == "effitrain checkpoint" and report["step"] == 3
    assert report["optimizer"] == {
        "name": "adafactor",
        "class": "torch.optim.Adafactor",
        "inferred": False,
    }
    assert report["param_groups"][0]["params"] == 16 and "beta2_decay" in report["param_groups"][0]
    assert (
        report["adamw_equivalent_bytes"]
        == json.loads(metrics.read_text())["adamw_equivalent_bytes"]
    )
    embedding = next(
        p for p in report["largest"] if p["parameter"].endswith("word_embeddings.weight")
    )
    assert embedding["second_moment"].startswith("factored")
    from effitrain.models import load_tokenizer

    # Rows: the demo tokenizer's vocabulary; columns: the tiny preset's width.
    assert embedding["shape"] == [len(load_tokenizer("tiny")), 128]
    biases = [p for p in report["largest"] if len(p["shape"]) == 1]
    assert biases and all(p["second_moment"] == "full" for p in biases)
    # An output folder works too: its newest complete checkpoint is read.
    assert "checkpoint-3, the newest" in inspect_json(train_cli, out)["format"]


def test_accelerate_folder_with_two_optimizers(train_cli, tmp_path):
    import torch

    _, first = stepped(torch.optim.AdamW)
    _, second = stepped(torch.optim.SGD, lr=0.1, momentum=0.9)
    torch.save(first.state_dict(), tmp_path / "optimizer.bin")
    torch.save(second.state_dict(), tmp_path / "optimizer_1.bin")
    report = inspect_json(train_cli, tmp_path)
    assert report["format"] == "accelerate save_state folder"
    assert len(report["files"]) == 2
    assert set(report["optimizer_state"]["by_key"]) == {
        "step",
        "exp_avg",
        "exp_avg_sq",
        "momentum_buffer",
    }
    assert report["optimizer_state"]["params_with_state"] == 8
    assert len(report["param_groups"]) == 2


def test_trainer_checkpoint_folder(train_cli, tmp_path):
    import torch

    model, optimizer = stepped(torch.optim.AdamW, lr=1e-3)
    folder = tmp_path / "checkpoint-12"
    folder.mkdir()
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 12}))
    report = inspect_json(train_cli, folder)
    assert report["format"] == "transformers Trainer checkpoint" and report["step"] == 12
    assert report["optimizer"] == {"name": None, "class": "torch.optim.AdamW", "inferred": True}
    n = sum(p.numel() for p in model.parameters())
    assert report["optimizer_state"]["elements"] == 2 * n + 4
    # AdamW measured against the AdamW equivalent inferred from the shapes: equal.
    assert report["adamw_equivalent_bytes"] == report["optimizer_state"]["bytes"]
    assert report["largest"][0]["shape"] == [32, 64]


def test_single_file_plain_and_nested(train_cli, tmp_path):
    import torch

    _, optimizer = stepped(torch.optim.AdamW)
    plain, nested = tmp_path / "opt.pt", tmp_path / "ckpt.pt"
    torch.save(optimizer.state_dict(), plain)
    torch.save({"optimizer": optimizer.state_dict(), "epoch": 3}, nested)
    a, b = inspect_json(train_cli, plain), inspect_json(train_cli, nested)
    assert a["optimizer_state"] == b["optimizer_state"]
    assert a["step"] == b["step"] == 1
    assert "(key 'optimizer')" in b["files"][0]
    proc = train_cli("inspect-state", str(nested))
    assert (
        proc.returncode == 0 and "torch.optim.AdamW (inferred from the state keys)" in proc.stdout
    )


def test_bitsandbytes_nested_state_is_counted(train_cli, tmp_path):
    import bitsandbytes as bnb
    import torch

    from effitrain.memory.ledger import optimizer_state_ledger

    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(128, 64))  # >= 4096 elements: quantized
    small = torch.nn.Parameter(torch.randn(8))  # stays fp32
    optimizer = bnb.optim.AdamW8bit([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    report = inspect_json(train_cli, tmp_path)
    assert report["optimizer_state"] == optimizer_state_ledger(optimizer.state_dict()).to_dict()
    assert {"state1", "state2", "qmap1", "absmax1"} <= set(report["optimizer_state"]["by_key"])
    assert report["optimizer"]["class"].startswith("bitsandbytes 8-bit")
    rows = {tuple(p["shape"]): p for p in report["largest"]}
    assert rows[(128, 64)]["second_moment"] == "8-bit"
    assert rows[(8,)]["second_moment"] == "full"
    assert report["optimizer_state"]["bytes"] < report["adamw_equivalent_bytes"] / 3


class Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_optimizer_file_is_refused_and_never_runs(train_cli, tmp_path):
    import torch

    folder, marker = tmp_path / "evil", tmp_path / "PWNED"
    folder.mkdir()
    state = {"state": {0: {"exp_avg": Payload(marker)}}, "param_groups": [{"params": [0]}]}
    torch.save(state, folder / "optimizer.bin")
    with (folder / "custom_checkpoint_0.pkl").open("wb") as handle:
        pickle.dump(Payload(marker), handle)

    proc = train_cli("inspect-state", str(folder))
    line = assert_clean_error(proc, "refused", "system", "could run code")
    assert "optimizer.bin" in line
    assert not marker.exists()
    # A plain pickle given directly is refused before anything reads it.
    proc = train_cli("inspect-state", str(folder / "custom_checkpoint_0.pkl"))
    assert_clean_error(proc, "plain pickle, refused")
    assert not marker.exists()


@pytest.fixture
def good_file(tmp_path):
    import torch

    _, optimizer = stepped(torch.optim.AdamW)
    path = tmp_path / "good.pt"
    torch.save(optimizer.state_dict(), path)
    return path


def test_bad_files_each_get_one_clear_line(train_cli, tmp_path, good_file):
    import zipfile

    import torch

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good_file.read_bytes()[: good_file.stat().st_size // 2])
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a checkpoint\n")
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("readme.txt", "hi")
    weights_only = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, weights_only)
    no_state = tmp_path / "folder"
    no_state.mkdir()
    sharded = tmp_path / "fsdp-checkpoint"  # what Accelerate's FSDP2 SHARDED_STATE_DICT writes
    (sharded / "optimizer_0").mkdir(parents=True)
    (sharded / "optimizer_0" / "__0_0.distcp").write_bytes(b"\0" * 8)

    cases = [
        (truncated, "truncated or corrupt"),
        (empty, "is empty (0 bytes)"),
        (text, "not a PyTorch checkpoint"),
        (other_zip, "not a readable PyTorch checkpoint"),
        (weights_only, "holds no optimizer state_dict (top-level keys: weight)"),
        (tmp_path / "missing.pt", "no such file or folder"),
        (no_state, "no optimizer state in"),
        (sharded, "sharded optimizer state (torch.distributed.checkpoint"),
        (sharded / "optimizer_0", "fsdp_state_dict_type: FULL_STATE_DICT"),
    ]
    for path, fragment in cases:
        assert_clean_error(train_cli("inspect-state", str(path)), fragment)


def test_inspect_state_help_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from effitrain.cli import main\n"
        "try:\n"
        "    main(['inspect-state', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "--json" in proc.stdout and proc.stdout.strip().endswith("False"), proc.stdout


def test_a_fifo_is_one_line(train_cli, tmp_path):
    """A named pipe is neither a file nor a folder: reading it could block; one line instead."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_clean_error(train_cli("inspect-state", str(fifo)), "is neither a file nor a folder")
