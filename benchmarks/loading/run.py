"""Loading a real-size checkpoint: the host memory (peak RSS) and the time of ``effitrain train``
for one step, beside plain transformers loading the same folder, and ``effitrain estimate``'s
host figure (``host_peak_bytes``) for the same options.

The checkpoint is built on the fly (random weights, never in git) in a Qwen2.5-1.5B-like shape
with untied embeddings (1.78B parameters), saved in bf16 by ``save_pretrained`` in ~1 GB shards
as hub checkpoints are, with the causal-LM demo's tokenizer. Each row is a fresh process, one at
a time; its peak RSS is the kernel's (``ru_maxrss`` of the child, which is the whole run: no
process of its own is started), its load time the moment its first line after loading appears
(effitrain's banner; the transformers script's own clock). Rows:

- ``libraries``: ``effitrain train`` on the tiny-llama preset (tensors under 10 MiB): what the
  libraries and the pipeline hold, ``effitrain.memory.host.LIBRARY_BYTES``;
- ``full-bf16``: (a) bf16 full fine-tuning with the levers;
- ``qlora-bf16``: (b) QLoRA with ``--weights-dtype bf16``;
- ``hf-bf16`` and ``hf-4bit``: ``from_pretrained(dtype=torch.bfloat16)`` and with a 4-bit
  ``BitsAndBytesConfig`` (nf4, double quantization, bf16 compute), load only.

    python -m benchmarks.loading.run
    python -m benchmarks.loading.run --rows libraries hf-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
"""Qwen2.5-1.5B's architecture with untied embeddings: 1.78B parameters."""
SHARD = "1GB"
TRAIN = {
    "full-bf16": ["--weights-dtype", "bf16", "--optim", "adafactor", "--optimizer-in-backward",
                  "--gradient-checkpointing"],
    "qlora-bf16": ["--load-in-4bit", "--lora-rank", "16", "--weights-dtype", "bf16"],
}  # fmt: skip
"""(a) and (b): ``effitrain train`` options on top of the shared ones."""
ROW_NAMES = ["libraries", "full-bf16", "qlora-bf16", "hf-bf16", "hf-4bit"]
LABELS = {
    "libraries": "`effitrain train`, tiny-llama preset (the libraries)",
    "full-bf16": "(a) `effitrain train " + " ".join(TRAIN["full-bf16"]) + "`",
    "qlora-bf16": "(b) `effitrain train " + " ".join(TRAIN["qlora-bf16"]) + "`",
    "hf-bf16": "transformers `from_pretrained(dtype=torch.bfloat16)`, load only",
    "hf-4bit": "transformers with a 4-bit `BitsAndBytesConfig`, load only",
}
POLL = 0.2
"""Seconds between the samples of a child's RSS split (anonymous, file-backed)."""
GIB = 2**30
ESTIMATE_TOLERANCE = 0.15


# -- the checkpoint ----------------------------------------------------------------------------


def make_checkpoint(folder: Path) -> None:
    """Random weights in :data:`SHAPE`, saved in bf16 in :data:`SHARD` shards, with the LM
    demo's tokenizer (run in a child: the 3.5 GB model is gone when it exits)."""
    import torch
    import transformers

    from effitrain.demo.lm import build_lm_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=SHARD)
    build_lm_tokenizer().save_pretrained(folder)


def checkpoint(work_dir: Path) -> Path:
    folder = work_dir / "checkpoint"
    if not (folder / "model.safetensors.index.json").exists():
        print(f"building the checkpoint in {folder} …", file=sys.stderr, flush=True)
        code = (
            f"from benchmarks.loading.run import make_checkpoint; make_checkpoint({str(folder)!r})"
        )
        subprocess.run([sys.executable, "-c", f"from pathlib import Path; {code}"], check=True)
    return folder


def checkpoint_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# -- one child, measured -----------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    """The child's resident memory now, split as the kernel counts it (bytes)."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def measured(command: list[str], log: Path, loaded: re.Pattern[str]) -> dict:
    """Run ``command`` to its end: its peak RSS (``ru_maxrss``), the largest anonymous and
    file-backed parts sampled, the seconds to its first line matching ``loaded`` and in all."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    found: dict[str, float] = {}
    lines: list[tuple[float, str]] = []

    def read() -> None:  # the output, time-stamped, in a thread of its own
        assert child.stdout is not None
        for line in child.stdout:
            now = time.perf_counter() - start
            lines.append((now, line.rstrip()))
            if "load" not in found and loaded.search(line):
                found["load"] = now

    reader = threading.Thread(target=read)
    reader.start()
    samples: list[tuple[float, dict[str, int]]] = []
    while True:
        samples.append((time.perf_counter() - start, _status(child.pid)))
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(POLL)
    child.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    samples = [(t, sample) for t, sample in samples if sample]
    peaks = {
        key: max((s.get(key, 0) for _, s in samples), default=0) for key in ("RssAnon", "RssFile")
    }
    top_time = max(samples, key=lambda item: item[1].get("VmRSS", 0))[0] if samples else 0.0
    before = [line for t, line in lines if t <= top_time and line.strip()]
    timeline = [
        (
            t,
            f"rss {s.get('VmRSS', 0) / 2**20:7.0f} MiB anon {s.get('RssAnon', 0) / 2**20:7.0f} "
            f"file {s.get('RssFile', 0) / 2**20:7.0f}",
        )
        for t, s in samples
    ]
    with log.open("w") as out:
        for t, line in sorted(lines + [(t, f"# {text}") for t, text in timeline]):
            out.write(f"[{t:7.1f}s] {line}\n")
    if child.returncode:
        raise SystemExit(f"failed ({child.returncode}): {' '.join(command)}; see {log}")
    return {
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "peak_anon_bytes": peaks["RssAnon"],
        "peak_file_bytes": peaks["RssFile"],
        "load_seconds": found.get("load"),
        "peak_sampled_after": before[-1][:120] if before else "(start)",
        "peak_sampled_at_seconds": round(top_time, 1),
        "seconds": time.perf_counter() - start,
    }


# -- the rows ----------------------------------------------------------------------------------


def train_command(folder: Path | str, data: tuple[Path, Path], extra: list[str], out: Path):
    train, validation = data
    return [
        sys.executable, "-m", "effitrain", "train", "--task", "causal-lm", "--model", str(folder),
        "--train-file", str(train), "--validation-file", str(validation), "--batch-size", "1",
        "--eval-batch-size", "1", "--max-length", "256", "--max-steps", "1", "--log-every", "1",
        "--output-dir", str(out), "--metrics-json", str(out / "metrics.json"), *extra,
    ]  # fmt: skip


def host_estimate(folder: Path, extra: list[str], data: tuple[Path, Path], out: Path) -> dict:
    """``effitrain estimate --json`` of the same options, in a child (this process stays
    light): its host figure and breakdown."""
    command = train_command(folder, data, extra, out)
    command[3] = "estimate"
    keep = [a for a in command if a not in ("--output-dir", "--metrics-json")]
    drop = {command.index("--output-dir") + 1, command.index("--metrics-json") + 1}
    keep = [a for i, a in enumerate(command) if i not in drop and a in keep]
    done = subprocess.run(
        [*keep, "--device", "cpu", "--json"], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout)
    result = found[0] if isinstance(found, list) else found
    return {"host_peak_bytes": result["host_peak_bytes"], "host_memory": result["host_memory"]}


def measure_row(name: str, folder: Path, data: tuple[Path, Path], work: Path) -> common.Row:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # train refuses a folder that holds a trained model
    out.mkdir(parents=True)
    row: common.Row = {"row": name, "label": LABELS[name]}
    if name.startswith("hf-"):
        command = [sys.executable, "-m", "benchmarks.loading.hf_load", str(folder), name[3:]]
        return row | measured(command, out / "output.log", re.compile(r"^loaded "))
    model = "tiny-llama" if name == "libraries" else folder
    extra = TRAIN.get(name, [])
    command = train_command(model, data, extra, out)
    row |= measured(command, out / "output.log", re.compile(r"effitrain · model"))
    metrics = json.loads((out / "metrics.json").read_text())
    row["peak_tensor_bytes"] = metrics.get("peak_tensor_bytes")
    row["seconds_per_step"] = metrics.get("seconds_per_step")
    if name in TRAIN:
        try:
            row |= host_estimate(folder, extra, data, out)
        except (subprocess.CalledProcessError, KeyError) as exc:  # recorded beside the run
            row["estimate_error"] = f"{type(exc).__name__}: {exc}"
    return row


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.llm_levers.run import write_texts

    if device != "cpu":
        raise SystemExit("error: the loading benchmark measures host memory on the CPU only")
    folder = checkpoint(args.work_dir)
    data = write_texts(args.work_dir / "data", 2, 256 + 64)
    rows = []
    for name in args.rows:  # one heavy process at a time
        print(f"running {name} …", file=sys.stderr, flush=True)
        rows.append(measure_row(name, folder, data, args.work_dir / "runs"))
    size = checkpoint_size(folder)
    settings = {"shape": SHAPE, "shard": SHARD, "checkpoint_bytes": size}
    settings |= {"files": len(list(folder.glob("*.safetensors"))), "batch": "1 x 256"}
    run = {
        "name": args.name or "cpu",
        "title": f"Qwen2.5-1.5B-like checkpoint (1.78B parameters, {size / GIB:.2f} GiB of bf16 "
        "safetensors), one step at 1 × 256 tokens, CPU",
        "settings": settings,
        "rows": rows,
        "notes": [],
    }
    return run


# -- the table ---------------------------------------------------------------------------------


def _gib(value) -> str:
    return "–" if value is None else f"{value / GIB:.2f} GiB"


def _estimate_cell(row: common.Row) -> str:
    predicted = row.get("host_peak_bytes")
    if predicted is None:
        return "–"
    error = (predicted - row["peak_rss_bytes"]) / row["peak_rss_bytes"]
    return f"{_gib(predicted)} ({error:+.1%})"


def goals(run: common.Run) -> list[str]:
    """The issue's goals, each with the numbers and whether it is met."""
    rows = {row["row"]: row for row in run["rows"]}
    size = run["settings"]["checkpoint_bytes"]
    lines = []
    if "full-bf16" in rows:
        limit = 1.3 * size + 1.2 * GIB
        got = rows["full-bf16"]["peak_rss_bytes"]
        lines.append(
            f"(a) bf16 full fine-tuning: peak RSS {_gib(got)} ≤ 1.3 × the checkpoint + 1.2 GiB "
            f"= {_gib(limit)}: {'met' if got <= limit else 'missed'}"
        )
    if "qlora-bf16" in rows and "hf-4bit" in rows:
        limit = rows["hf-4bit"]["peak_rss_bytes"] + 0.5 * GIB
        got = rows["qlora-bf16"]["peak_rss_bytes"]
        lines.append(
            f"(b) QLoRA with bf16: peak RSS {_gib(got)} ≤ transformers' 4-bit load + 0.5 GiB "
            f"= {_gib(limit)}: {'met' if got <= limit else 'missed'}"
        )
    for name in ("full-bf16", "qlora-bf16"):
        row = rows.get(name)
        if row and row.get("host_peak_bytes"):
            error = (row["host_peak_bytes"] - row["peak_rss_bytes"]) / row["peak_rss_bytes"]
            met = abs(error) <= ESTIMATE_TOLERANCE
            lines.append(
                f"{name}: estimate's host figure {_gib(row['host_peak_bytes'])} within 15 % of "
                f"the measured {_gib(row['peak_rss_bytes'])}: {error:+.1%}, "
                f"{'met' if met else 'missed'}"
            )
    return lines


def render(run: common.Run) -> str:
    size = run["settings"]["checkpoint_bytes"]
    columns = [
        common.Column("run", lambda row: row["label"], right=False),
        common.Column(
            "peak RSS",
            lambda row: f"{_gib(row['peak_rss_bytes'])} ({row['peak_rss_bytes'] / size:.2f}×)",
        ),
        common.Column("largest anon / file-backed", lambda row: (
            f"{_gib(row.get('peak_anon_bytes'))} / {_gib(row.get('peak_file_bytes'))}"
        )),
        common.Column("peak tensors", lambda row: _gib(row.get("peak_tensor_bytes"))),
        common.Column("load s", lambda row: common.shown(row.get("load_seconds"), "{:.1f}".format)),
        common.Column("s/step", lambda row: common.shown(row.get("seconds_per_step"), "{:.1f}".format)),
        common.Column("estimate's host figure (error)", _estimate_cell),
    ]  # fmt: skip
    table = common.markdown_table(columns, run["rows"])
    lines = "\n".join(f"- **Goal** {line}" for line in goals(run))
    return f"{table}\n\n(× the checkpoint's {_gib(size)} on disk.)\n\n{lines}"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    common.add_rows_argument(parser, ROW_NAMES)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
