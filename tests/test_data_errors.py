"""A data file that does not parse: one error naming the file, the line and the parser's reason,
and no log line of the datasets library before it."""

from __future__ import annotations

import json

import pytest

from effitrain.errors import EffitrainError
from effitrain.tasks.sources import load_local_file, load_splits

ROWS = [json.dumps({"text": f"sentence number {i}", "label": i % 2}) for i in range(12)]


def _error(capfd, load) -> str:
    """The load's EffitrainError message; asserts nothing else was printed."""
    with pytest.raises(EffitrainError) as info:
        load()
    out, err = capfd.readouterr()
    assert "Failed to" not in out + err and "error" not in (out + err).lower(), out + err
    return str(info.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_lines_name_the_broken_line(tmp_path, capfd, suffix):
    rows = list(ROWS)
    rows[6] = '{"text": "broken, "label": 1}'
    path = tmp_path / f"bad{suffix}"
    path.write_text("\n".join(rows) + "\n")
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message == (f"cannot read '{path}' as json: line 7, column 20: Expecting ',' delimiter")


def test_json_document_names_line_and_column(tmp_path, capfd):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"text": "a", "label": 1},\n  {"text": "b" "label": 0}\n]\n')
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message.endswith("as json: line 3, column 16: Expecting ',' delimiter"), message


def test_csv_gives_the_parsers_reason(tmp_path, capfd):
    path = tmp_path / "bad.csv"
    path.write_text("text,label\nhello,1\nworld,0\nfoo,1,2,3\n")
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message.startswith(f"cannot read '{path}' as csv: ")
    assert "Expected 2 fields in line 4, saw 4" in message
    assert "An error occurred while generating" not in message


def test_parquet_gives_the_readers_reason(tmp_path, capfd):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1" + b"x" * 16 + b"PAR1")
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message.startswith(f"cannot read '{path}' as parquet: ") and "Parquet" in message


def test_a_folder_names_the_file(tmp_path, capfd):
    from effitrain.config import TrainConfig

    rows = list(ROWS)
    rows[2] = "{not json"
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "validation.jsonl").write_text("\n".join(ROWS) + "\n")
    config = TrainConfig(dataset=str(tmp_path))
    message = _error(capfd, lambda: load_splits(config))
    assert message.startswith(f"cannot read dataset folder '{tmp_path}': train.jsonl: line 3, ")
