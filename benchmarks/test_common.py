"""benchmarks/common.py: results files, tables rendered from them, and every README in step with
its results.json. Nothing here trains: ``python -m pytest -q benchmarks/test_common.py``."""

from __future__ import annotations

import importlib
import json

import pytest

from benchmarks import common

TOPICS = sorted(path.parent.name for path in (common.REPO / "benchmarks").glob("*/run.py"))


def test_a_published_cell_is_kept_and_a_measured_one_formatted():
    base = {"row": "a", "bytes": 2 * 2**20}
    rows = [base, {"row": "b", "bytes": 2**20}, {"row": "c", "bytes": "3.0 MiB (1.50×)"}]
    columns = [
        common.Column("row", lambda r: r["row"], right=False),
        common.Column("memory", lambda r: common.with_ratio(r, base, "bytes", common.mib)),
    ]
    assert common.markdown_table(columns, rows).splitlines() == [
        "| row | memory |",
        "|---|---:|",
        "| a | 2.0 MiB |",
        "| b | 1.0 MiB (0.50×) |",
        "| c | 3.0 MiB (1.50×) |",
    ]


def test_empty_columns_are_dropped_and_pipes_escaped():
    columns = [
        common.Column("name", lambda r: r["name"]),
        common.Column("never", lambda r: common.shown(r.get("never"), str)),
    ]
    table = common.markdown_table(columns, [{"name": "a|b"}], drop_empty=True)
    assert table.splitlines() == ["| name |", "|---:|", "| a\\|b |"]


def test_derived_values_fall_back_to_the_published_cell():
    def share(row):
        return row["state"] / row["adamw"]

    assert common.derived({"state": 1, "adamw": 4}, "vs", share, "{:.2f}×".format) == "0.25×"
    assert common.derived({"vs": "0.25×"}, "vs", share, "{:.2f}×".format) == "0.25×"
    assert common.derived({"state": 1}, "vs", share, "{:.2f}×".format) == "–"


def test_a_run_replaces_the_run_of_the_same_name(tmp_path):
    topic = common.Topic("demo")
    path = tmp_path / "results.json"
    common.record(path, topic, {"name": "cpu", "rows": [1]})
    common.record(path, topic, {"name": "gpu", "rows": [2]})
    data = common.record(path, topic, {"name": "cpu", "rows": [3]})
    assert [(run["name"], run["rows"]) for run in data["runs"]] == [("cpu", [3]), ("gpu", [2])]
    assert json.loads(path.read_text()) == data


def test_the_block_is_replaced_and_the_text_around_it_kept():
    readme = f"# t\n\nintro\n\n{common.BEGIN.format(topic='t')}\nold\n{common.END}\n\noutro\n"
    new = common.replace_block(readme, "<!-- results: x -->\nnew\n" + common.END)
    assert new == "# t\n\nintro\n\n<!-- results: x -->\nnew\n<!-- /results -->\n\noutro\n"
    assert common.replace_block("# t\n", "B") == "# t\n\nB\n"


def test_provenance_says_what_where_and_when(monkeypatch):
    run = {
        "provenance": {
            "source": "README.md at commit abc",
            "command": "python x.py",
            "effitrain_commit": None,
            "date": "2026-12-03",
            "device": {"kind": "cuda", "name": "H200", "cuda": "13.0"},
            "versions": {"torch": "2.11"},
        }
    }
    lines = common.describe(run).splitlines()
    assert lines == [
        "- **What ran:** `python x.py` (effitrain commit not recorded)",
        "- **Where:** GPU: H200 (CUDA 13.0); torch 2.11",
        "- **When:** 2026-12-03",
        "- **Source:** README.md at commit abc",
    ]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    measured = common.provenance(common.Topic("levers"), ["--repeats", "2"], "cpu")
    assert measured["command"] == "python -m benchmarks.levers.run --repeats 2"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a pinned run says so
    pinned = common.provenance(common.Topic("levers"), ["--repeats", "2"], "cpu")
    assert pinned["command"] == "OMP_NUM_THREADS=1 python -m benchmarks.levers.run --repeats 2"
    assert measured["device"]["kind"] == "cpu" and measured["device"]["cores"] >= 1
    assert "torch" in measured["versions"] and measured["source"] == "measured"


@pytest.mark.parametrize("name", TOPICS)
def test_every_readme_matches_its_results(name):
    """What `run.py --check` checks: the tables are the ones results.json renders to, and every
    run says where it comes from."""
    module = importlib.import_module(f"benchmarks.{name}.run")
    topic = module.TOPIC
    data = common.load_results(topic.results, topic)
    # A topic that only a GPU can run may have none yet; its README then says so.
    assert data["runs"] or getattr(module, "GPU_ONLY", False), f"{name}: no runs in results.json"
    for run in data["runs"]:
        assert {"source", "date", "device"} <= set(run["provenance"]), (name, run["name"])
    block = common.render_block(topic, data, module.render)
    assert common.replace_block(topic.readme.read_text(), block) == topic.readme.read_text()


def test_the_sharding_table_in_the_docs_is_the_rendered_one():
    """docs/distributed.md's table: effitrain's rules now, with benchmarks/sharding's evidence."""
    from benchmarks.sharding import run

    assert run.render_docs(check=True) == 0, "python -m benchmarks.sharding.run --render"


def test_the_optimizer_state_figures_are_the_rendered_ones():
    """effitrain/optim/state_bytes.json, which `effitrain optimizers` reads: the bytes/param of
    benchmarks/optimizer_costs' distilbert-base runs, written by the same --render."""
    from benchmarks.optimizer_costs import run

    assert run.render_state_bytes(check=True) == 0, (
        "python -m benchmarks.optimizer_costs.run --render"
    )


def test_optimizer_state_figures_come_from_the_registry_settings_and_must_agree():
    from benchmarks.optimizer_costs import run

    def costs(name, settings, row):
        return {"name": name, "provenance": {"date": "d"}, "settings": settings, "rows": [row]}

    base = {"model": "distilbert-base"}
    measured = {"optimizer": "sgd", "optimizer_state_bytes": 400, "trainable_parameters": 100}
    published = {"optimizer": "sgd", "bytes_per_param": "4.00"}
    other_model = costs("qwen", {"model": "qwen2.5-0.5b", "task": "causal-lm"}, published)
    data = {"runs": [costs("cpu", base, published), costs("gpu", base, measured), other_model]}
    figures = run.state_bytes(data)
    assert figures["bytes_per_param"] == {"sgd": 4.0}
    assert [each["name"] for each in figures["runs"]] == ["cpu", "gpu"]
    stale = {
        "runs": [
            costs("cpu", base, published),
            costs("gpu", base, measured | {"optimizer_state_bytes": 800}),
        ]
    }
    with pytest.raises(SystemExit, match="disagree on sgd"):
        run.state_bytes(stale)


def test_importing_the_benchmarks_is_light():
    """gpu.py reads each run.py's GPU_ARGS and SMOKE_ARGS: importing them must not import torch."""
    import subprocess
    import sys

    modules = ", ".join(f"benchmarks.{name}.run" for name in TOPICS)
    code = f"import sys, benchmarks.gpu, {modules}; print(sorted(m for m in sys.modules if m in ('torch', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
