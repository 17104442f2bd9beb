"""A data file that does not parse: one error naming the file, the line and the parser's reason,
and no log line of the datasets library before it."""

from __future__ import annotations

import json

import pytest

from effitrain.errors import EffitrainError
from effitrain.tasks.sources import load_local_file, load_splits
from tests.conftest import assert_clean_error

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


# --- no row dropped without a word: folders of several formats, rows that differ ---


def _folder(tmp_path, files: dict[str, str | bytes]):
    folder = tmp_path / "data"
    folder.mkdir()
    for name, content in files.items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content)
    return folder


CSV_40 = "text,label\n" + "".join(f"row {i},{i % 2}\n" for i in range(40))
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


@pytest.mark.parametrize(
    "formats, found",
    [
        (None, "1 .csv file (a.csv), 1 .jsonl file (c.jsonl)"),
        ("lm", "1 .csv file (a.csv), 1 .txt file (b.txt), 1 .jsonl file (c.jsonl)"),
    ],
)
def test_a_folder_of_several_data_formats_is_refused(tmp_path, capfd, formats, found):
    from effitrain.config import TrainConfig
    from effitrain.tasks.lm_data import LM_FORMATS

    folder = _folder(
        tmp_path,
        {
            "a.csv": CSV_40,
            "b.txt": "some notes\n",
            "c.jsonl": json.dumps({"text": "one row", "label": 1}) + "\n",
            "d.png": PNG,
        },
    )
    config = TrainConfig(dataset=str(folder))
    options = {"formats": LM_FORMATS} if formats else {}
    message = _error(capfd, lambda: load_splits(config, **options))
    assert message.startswith(f"dataset folder '{folder}' holds several data formats: {found};")
    assert f"--dataset {folder}/a.csv" in message


def test_a_folder_skips_what_is_not_data_with_a_note(tmp_path, monkeypatch):
    from effitrain.config import TrainConfig
    from effitrain.tasks.classification import load_data

    _folder(tmp_path, {"a.csv": CSV_40, "d.png": PNG, "e.png": PNG, "notes.txt": "hi"})
    monkeypatch.chdir(tmp_path)  # a relative path, as typed
    data = load_data(TrainConfig(dataset="data"))
    assert len(data.train) + len(data.validation) == 40
    assert data.notes == [
        "dataset folder 'data': skipped 2 .png files (d.png, e.png): not a data format",
        "dataset folder 'data': skipped 1 .txt file (notes.txt): not a data format",
    ]


def test_a_folder_without_data_files_says_what_it_holds(tmp_path, capfd):
    from effitrain.config import TrainConfig

    folder = _folder(tmp_path, {"d.png": PNG})
    message = _error(capfd, lambda: load_splits(TrainConfig(dataset=str(folder))))
    assert message.startswith(f"dataset folder '{folder}' holds no data file (found 1 .png file")


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_jsonl_labels_mixing_integers_and_strings(tmp_path, capfd):
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(6)]
    rows[3]["label"] = "pos"
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    message = _error(capfd, lambda: load_local_file(path, "train"))
    assert message == (
        f"cannot read '{path}': 'label' is a string (\"pos\") on line 4 but an integer on "
        "line 1; every value of a column needs one type"
    )


@pytest.mark.parametrize(
    "row, keys",
    [({"text": "x"}, "text"), ({"txt": "x", "label": 1}, "txt, label")],
)
def test_jsonl_rows_with_different_keys(tmp_path, capfd, row, keys):
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(6)]
    rows[4] = row
    path = _jsonl(tmp_path / "keys.jsonl", rows)
    message = _error(capfd, lambda: load_local_file(path, "train"))
    assert message == (
        f"cannot read '{path}': line 5 has keys {keys} but line 1 has text, label; every row "
        "needs the same keys"
    )


def test_json_document_rows_with_different_keys(tmp_path, capfd):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"text": "a", "label": 0}, {"text": "b"}]))
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message.endswith(
        "row 2 has keys text but row 1 has text, label; every row needs the same keys"
    )


def test_a_folder_names_the_jsonl_whose_rows_differ(tmp_path, capfd):
    from effitrain.config import TrainConfig

    rows = [{"text": f"t{i}", "label": i % 2} for i in range(6)]
    folder = tmp_path / "data"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", rows)
    _jsonl(folder / "validation.jsonl", [*rows[:2], {"text": "c"}])
    message = _error(capfd, lambda: load_splits(TrainConfig(dataset=str(folder))))
    assert message == (
        f"cannot read dataset folder '{folder}': validation.jsonl: line 3 has keys text but "
        "line 1 has text, label; every row needs the same keys"
    )


def test_explicit_nulls_are_not_differing_keys(tmp_path):
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(6)]
    rows[2]["text"] = None
    path = _jsonl(tmp_path / "nulls.jsonl", rows)
    assert load_local_file(path, "train")["text"][2] is None


@pytest.mark.parametrize(
    ("name", "data", "line", "column"),
    [
        ("latin.jsonl", '{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"), 2, 14),
        ("latin.csv", "text,label\nhello,1\ncaf\xe9,0\n".encode("latin-1"), 3, 4),
    ],
)
def test_non_utf8_names_the_file_line_and_column(tmp_path, capfd, name, data, line, column):
    """pyarrow read a Latin-1 jsonl, and tokenizing failed later with a bare UnicodeDecodeError."""
    path = tmp_path / name
    path.write_bytes(data)
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message == (
        f"cannot read '{path}': line {line}, column {column}: byte 0xe9 is not UTF-8; "
        "save the file as UTF-8"
    )


def test_non_utf8_is_found_across_read_chunks(tmp_path):
    from effitrain.tasks.sources import _not_utf8

    path = tmp_path / "a.txt"
    # 'é' is two bytes: with 3-byte chunks some are split between reads and stay valid.
    path.write_bytes("éé\nxé é\n".encode() + b"ab\xff\n")
    assert _not_utf8(path, chunk_bytes=3) == (
        "line 3, column 3: byte 0xff is not UTF-8; save the file as UTF-8"
    )
    path.write_bytes("éé\nxé é\n".encode())
    assert _not_utf8(path, chunk_bytes=3) is None


def test_a_raw_nul_byte_is_shown_escaped(tmp_path, capfd):
    """Python's message stopped at 'Invalid control character at' (and a raw NUL cut lines)."""
    path = tmp_path / "nul.jsonl"
    path.write_bytes(b'{"text": "a", "label": 0}\n{"text": "b\x00c", "label": 1}\n')
    message = _error(capfd, lambda: load_local_file(str(path), "train"))
    assert message == (
        f"cannot read '{path}' as json: line 2, column 12: raw control character '\\x00' "
        "inside a string; JSON needs it escaped (\\u0000)"
    )
    assert "\x00" not in message


@pytest.mark.parametrize(
    ("row", "hint"),
    [
        (
            {"prompt": "a", "completion": "b"},
            "prompt+completion is causal-LM data: train on it with --task causal-lm",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "--task causal-lm"),
        (
            {"prompt": "a", "chosen": "b", "rejected": "c"},
            "These are preference pairs: train on them with --task preference",
        ),
    ],
)
def test_another_tasks_data_names_its_task(train_cli, tmp_path, row, hint):
    """Without --task, the classifier preset asked for --text-columns, which cannot help."""
    path = _jsonl(tmp_path / "data.jsonl", [row] * 4)
    error = assert_clean_error(train_cli("train", "--train-file", path), hint)
    assert "--text-columns" not in error


def test_non_utf8_jsonl_is_refused_before_training(train_cli, tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(
        '{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n'.encode("latin-1")
    )
    assert_clean_error(
        train_cli("train", "--train-file", str(path)), f"'{path}': line 2, column 14: byte 0xe9"
    )
