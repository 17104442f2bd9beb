"""What each optimizer costs: its state, measured to the byte, and its time per step against AdamW.

The distilbert-base preset's shape (65.8M parameters, random init), batch 8 x 128 tokens, the
same synthetic texts as scripts/levers.py. Every run is a fresh ``effitrain train`` process;
with --repeats N the optimizers run in turn, N times (A B C … A B C …), so machine noise hits
every row alike. Per optimizer: optimizer-state bytes and elements (effitrain's true-storage
ledger), bytes per trained parameter, the state as a fraction of fp32 AdamW's, peak tensor
memory of the measured step, the median seconds per step (first and measured steps excluded;
median over repeats) and its ratio to AdamW's in the same run. With --finetune, the fine-tuning
benchmark's accuracies (scripts/finetune_matrix.py --json files) are joined in.

    python scripts/optimizer_costs.py --repeats 2 --json costs.jsonl \
        --finetune finetune.jsonl
    python scripts/optimizer_costs.py --summarize costs.jsonl --finetune finetune.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TASKS = ("vader-sent3", "pl-sentences")
"""Fine-tuning benchmark tasks shown (all-MiniLM-L6-v2, 2 epochs, the README's data)."""


def summarize(name: str, runs: list[dict]) -> dict:
    """Bytes are the same in every repeat (checked); time is the median over repeats."""
    first = runs[0]
    state = [r["optimizer_state"]["bytes"] for r in runs]
    if len(set(state)) != 1:
        sys.exit(f"{name}: optimizer-state bytes differ between repeats: {state}")
    return {
        "optimizer": name,
        "optimizer_class": first.get("optimizer_class"),
        "optimizer_state_bytes": state[0],
        "optimizer_state_elements": first["optimizer_state"]["elements"],
        "trainable_parameters": first["trainable_parameters"],
        "adamw_equivalent_bytes": first["adamw_equivalent_bytes"],
        "bytes_per_param": state[0] / first["trainable_parameters"],
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
        "repeats": len(runs),
    }


def load_finetune(paths: list[Path]) -> dict[tuple[str, str], float]:
    """(optimizer, task) -> accuracy, from finetune_matrix.py --json lines (the last one wins)."""
    out = {}
    for path in paths:
        for line in path.open():
            row = json.loads(line)
            if "accuracy" in row:
                out[(row["optimizer"], row["task"])] = row["accuracy"]
    return out


def table(rows: list[dict], finetune: dict[tuple[str, str], float]) -> str:
    from effitrain.memory.ledger import format_bytes

    base = next((r for r in rows if r["optimizer"] == "adamw"), rows[0])
    head = (
        "| `--optim` | state (measured) | bytes/param | vs fp32 AdamW | peak tensors | s/step "
        "| time vs adamw | " + " | ".join(TASKS) + " |"
    )
    lines = [head, "|---" + "|---:" * (6 + len(TASKS)) + "|"]
    for row in rows:
        accuracy = [
            f"{finetune[(row['optimizer'], t)]:.3f}" if (row["optimizer"], t) in finetune else "–"
            for t in TASKS
        ]
        lines.append(
            f"| `{row['optimizer']}` | {format_bytes(row['optimizer_state_bytes'])} "
            f"| {row['bytes_per_param']:.2f} "
            f"| {row['optimizer_state_bytes'] / row['adamw_equivalent_bytes']:.2f}× "
            f"| {format_bytes(row['peak_tensor_bytes']) if row['peak_tensor_bytes'] else '–'} "
            f"| {row['seconds_per_step']:.2f} "
            f"| {row['seconds_per_step'] / base['seconds_per_step']:.2f}× | "
            + " | ".join(accuracy)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    from effitrain.optim import OPTIMIZERS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optims", nargs="+", default=None, help="default: every installed one")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--json", type=Path, help="append one JSON line per optimizer here")
    parser.add_argument("--finetune", type=Path, nargs="*", default=[], help="finetune_matrix JSON")
    parser.add_argument("--summarize", type=Path, help="only print the table of this --json file")
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args()
    finetune = load_finetune(args.finetune)
    if args.summarize:
        print(table([json.loads(line) for line in args.summarize.open()], finetune))
        return

    from levers import run, write_data

    names = args.optims or [n for n, spec in OPTIMIZERS.items() if spec.is_available()]
    if "adamw" not in names:
        names.insert(0, "adamw")  # the reference every ratio needs
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        train, validation = write_data(tmp / "data", rows=args.batch_size * args.steps)
        common = [
            "--model", args.model,
            "--train-file", str(train),
            "--validation-file", str(validation),
            "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length),
            "--max-steps", str(args.steps),
            "--log-every", "1",
            *args.extra,
        ]  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in names}
        index = 0
        for repeat in range(args.repeats):
            for name in names:
                index += 1
                data = run(name, ["--optim", name], common, tmp, index)
                runs[name].append(data)
                print(
                    f"[{repeat + 1}/{args.repeats}] {name}: state "
                    f"{data['optimizer_state']['bytes'] / 2**20:,.1f} MiB, "
                    f"{data['seconds_per_step']:.2f} s/step",
                    file=sys.stderr,
                )
    rows = [summarize(name, runs[name]) for name in names]
    if args.json:
        with args.json.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    print(table(rows, finetune))


if __name__ == "__main__":
    main()
