#!/bin/bash
# The GPU check of 2026-12-04 (README: "On a GPU" sections), one prepared script for a lent GPU
# machine that has torch, transformers and accelerate but no network. Run from the repo root:
#
#   O=/tmp/o PHASES="1 2 3" bash scripts/gpu_check.sh    # results under $O
#
# It expects, under .gpu/ (ignored by git; carried to the machine):
#   wheels/    py3.12 wheels of what the machine lacks (datasets, dill, multiprocess, torchao,
#              pytorch_optimizer, lion-pytorch, apollo-torch, adam-mini, schedulefree, torch-optimi)
#   fallback/  datasets 4.4.1 + dill 0.4.0 + multiprocess 0.70.18, for an older pyarrow
#   site/      bitsandbytes' package folder with only libbitsandbytes_cpu.so and the .so of the
#              machine's CUDA (cuda130 for torch 2.11+cu130): the full wheel is 125 MB
#   minilm16/  the packaged all-MiniLM-L6-v2 with its weights saved as fp16 (45 MB instead of 91,
#              under the 64 MiB a call may carry); it is trained as fp32 on both sides
#   data/pl-sentences/  from scripts/finetune_data.py
# Phases: 1 vs_trainer on the GPU (bf16 autocast; ~33 s per process there, so 2 repeats of 3
# pairs take ~400 s), 2 every optimizer fine-tunes MiniLM (4 at a time) and the demo, 3 levers,
# estimate_check, FSDP2 at world size 1 and the GPU-sensitive tests, in parallel.
set -u
O=${O:-/tmp/o}
mkdir -p "$O"/ft "$O"/misc
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
T0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }

stamp setup
if [ -z "${LOCAL_TEST:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl || echo "pip install failed"
  cp -r .gpu/site/* /tmp/site/
  export PYTHONPATH=/tmp/site:$PWD
  if ! $PY -c "import datasets" 2>"$O/misc/datasets-import.txt"; then
    echo "datasets 5.2 does not import here (see misc/datasets-import.txt); falling back to 4.4.1"
    rm -rf /tmp/site/datasets* /tmp/site/dill* /tmp/site/multiprocess* /tmp/site/_multiprocess*
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/fallback/*.whl
  fi
else
  export PYTHONPATH=${LOCAL_PYTHONPATH:-}:$PWD
fi
nvidia-smi -L 2>&1 | head -2
$PY - <<'EOF'
import importlib
for m in ["torch", "transformers", "accelerate", "datasets", "pyarrow", "bitsandbytes", "torchao", "peft", "tensorboard", "huggingface_hub"]:
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "FAILED", type(exc).__name__, str(exc)[:200])
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
EOF
# The packaged MiniLM travelled as fp16 (45 MB instead of 91); both sides train the same fp32 copy.
$PY - <<'EOF'
import shutil, os
from safetensors.torch import load_file, save_file
os.makedirs("/tmp/minilm", exist_ok=True)
sd = load_file(".gpu/minilm16/model.safetensors")
save_file({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, "/tmp/minilm/model.safetensors", metadata={"format": "pt"})
for f in os.listdir(".gpu/minilm16"):
    if f != "model.safetensors":
        shutil.copy(os.path.join(".gpu/minilm16", f), "/tmp/minilm/")
print("minilm fp32 at /tmp/minilm")
EOF
TASK=.gpu/data/pl-sentences
PHASES=${PHASES:-1 2 3}
phase() { [[ " $PHASES " == *" $1 "* ]]; }

if phase 1; then
stamp "1. vs_trainer on the GPU, bf16 autocast"
VS_ARGS=${VS_ARGS:---device cuda --mixed-precision bf16 --repeats 2}
VS_PAIRS=${VS_PAIRS:-adamw_torch:adamw adafactor:adafactor-hf adamw_bnb_8bit:adamw-8bit+fp32-embedding-state}
timeout 450 $PY scripts/vs_trainer.py --model /tmp/minilm --task $TASK --epochs 1 $VS_ARGS \
  --pairs $VS_PAIRS \
  --json "$O/vs_trainer_gpu.json" 2>&1 | tee "$O/vs_trainer_gpu.txt"
echo "rc ${PIPESTATUS[0]}"
fi

if phase 2; then
stamp "2. every optimizer fine-tunes MiniLM on pl-sentences, bf16, 2 epochs (4 at a time), and the demo"
ft() {
  name=$1
  EFFITRAIN_DEBUG=1 timeout 200 $PY -m effitrain train --quiet --model /tmp/minilm --train-file $TASK/train.csv \
    --validation-file $TASK/dev.csv --optim "$name" --epochs 2 --batch-size 32 \
    $MP --save-strategy no --output-dir "/tmp/ft/$name" \
    --metrics-json "$O/ft/$name.json" >"$O/ft/$name.log" 2>&1
  echo "$name rc $?"
}
MP=${MP---mixed-precision bf16}
export -f ft; export O TASK PY MP
(
  timeout 120 $PY -m effitrain train --metrics-json "$O/misc/demo.json" --output-dir /tmp/demo >"$O/misc/demo.log" 2>&1
  echo "demo rc $?"
) &
OPTIMS=${OPTIMS:-"adamw-4bit adamw-fp8 adamw-8bit-ao adamw adafactor adafactor-hf adamw-8bit sgd adam-mini muon galore apollo apollo-mini lion lion-8bit came adamw-schedule-free"}
printf '%s\n' $OPTIMS | xargs -P 4 -I{} bash -c 'ft {}'
wait
$PY - <<'EOF'
import json, os, glob
O = os.environ.get("O", "/tmp/o")
rows = []
for f in sorted(glob.glob(f"{O}/ft/*.json")):
    d = json.load(open(f))
    rows.append((d["optimizer"], d["eval"]["accuracy"], d["eval"]["f1"], d["lr"], d["seconds_per_step"] * 1000,
                 d["optimizer_state"]["bytes"], d["peak_memory_bytes"], d["peak_memory_kind"],
                 (d.get("step_memory") or {}).get("peak_tensor_bytes")))
print("| optimizer | accuracy | F1 | lr | ms/step | state bytes | CUDA peak (run) MiB | step peak MiB |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r[0]} | {r[1]:.4f} | {r[2]:.4f} | {r[3]:g} | {r[4]:.1f} | {r[5]:,} | {r[6]/2**20:.1f} ({r[7]}) | {(r[8] or 0)/2**20:.1f} |")
try:
    d = json.load(open(f"{O}/misc/demo.json"))
    print("demo:", d["optimizer"], d["eval"], d["peak_memory_bytes"], d["peak_memory_kind"], d["seconds_per_step"])
except Exception as exc:
    print("demo: no metrics", exc)
EOF
fi

if phase 3; then
stamp "3. levers, estimate check, FSDP2 at world size 1, GPU-relevant tests (in parallel)"
( timeout 150 $PY scripts/levers.py --steps 4 --json "$O/misc/levers.jsonl" >"$O/misc/levers.txt" 2>&1; echo "levers rc $?" ) &
( timeout 150 $PY scripts/estimate_check.py --settings 8x128 32x128 --optims adamw adafactor adamw-8bit \
    >"$O/misc/estimate_check.txt" 2>&1; echo "estimate_check rc $?" ) &
(
  for o in adamw adamw-8bit-ao adafactor; do
    EFFITRAIN_DEBUG=1 timeout 90 accelerate launch --config_file configs/accelerate/fsdp2-full-shard.yaml --num_processes 1 \
      -m effitrain train --optim $o --epochs 1 --save-strategy no --output-dir /tmp/fsdp-$o \
      --metrics-json "$O/misc/fsdp2-$o.json" >"$O/misc/fsdp2-$o.log" 2>&1
    echo "fsdp2 $o rc $?"
  done
) &
( timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_step_memory.py tests/test_memory.py tests/test_bf16.py \
    >"$O/misc/pytest.txt" 2>&1; echo "pytest rc $?" ) &
wait
tail -3 "$O/misc/pytest.txt"
cat "$O/misc/levers.txt" | tail -15
cat "$O/misc/estimate_check.txt" | tail -12
for f in "$O"/misc/fsdp2-*.log; do echo "--- $f"; tail -4 "$f"; done
fi
stamp done
