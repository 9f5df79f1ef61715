#!/usr/bin/env bash
# The one prepared script for a lent H200 (see docs/evidence/README.md). The device machine has
# torch/transformers/peft/pandas/pyarrow/jinja2 but not snakemake, so the stages run standalone
# from scripts/ (PYTHONPATH, nothing installed).
#
# Carried in .device/: the default model's config.json and tokenizer files (the 537 MB weights
# cannot travel: the device tool carries at most 64 MiB), and results/{mask,padding,bucket} of a
# CPU run of the workflow (lengths, plans, recommendation, gate). The GPU stages therefore run the
# real Gemma 3 270M *architecture* with random-init bf16 weights: step time, memory and kernels
# depend on shapes, not weight values.
#
#   run(command="bash docs/evidence/device_run.sh", carry=[".device"], timeout_s=570)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
EVIDENCE="$OUT/evidence"
mkdir -p "$EVIDENCE"

python3 - <<'PY' 2>&1 | tee "$EVIDENCE/model_build.txt"
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(".device/model")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained("/tmp/gemma-3-270m-random")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    src = f".device/model/{name}"
    import os
    if os.path.exists(src):
        shutil.copy(src, "/tmp/gemma-3-270m-random")
print("built", type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters (random init)")
PY

# 0) the CUDA-only tests (backend confirmation against what torch dispatched)
python3 -m pytest -q -p no:cacheprovider tests/unit/mask/test_backend.py 2>&1 | tail -5 \
  | tee "$EVIDENCE/pytest_mask_backend.txt"

# 1) profile + replay + realize + report, on the random-init model with the CPU run's lengths and plans
OUT="$EVIDENCE/gpu-run" MODEL=/tmp/gemma-3-270m-random RESULTS=.device/results \
  bash docs/evidence/run_gpu_profile.sh 2>&1 | tee "$EVIDENCE/gpu_console.txt"

# 1b) the embedded default as users train it (issue 27): the SFTTrainer of examples/sft_trainer.py
# through profile + replay (its step-level changes included: gradient checkpointing, eager vs
# sdpa, the micro-batch size; flash/flex where installed) + realize (trainer.train() itself), on
# the random-init weights and the carried chitchat data, with the CPU trainer run's lengths and
# plans (.device/results-trainer: the trainer's row numbers as example ids). The device image has
# no trl/datasets: their wheels travel in .device/wheels (docs/evidence/README.md says how).
pip install -q --no-index --no-deps .device/wheels/*.whl > "$EVIDENCE/wheels.txt" 2>&1 \
  || echo "wheels: not installed (see wheels.txt)"
if python3 -c "import trl, datasets" 2>/dev/null && [[ -d .device/results-trainer ]]; then
  PROBES_DEFAULT_MODEL=/tmp/gemma-3-270m-random PROBES_DEFAULT_DATA=.device/chitchat.parquet \
    OUT="$EVIDENCE/gpu-trainer" MODEL=/tmp/gemma-3-270m-random RESULTS=.device/results-trainer \
    EXTRA_SETTINGS="--set trainer.factory=examples/sft_trainer.py:build_trainer" \
    bash docs/evidence/run_gpu_profile.sh 2>&1 | tee "$EVIDENCE/gpu_trainer_console.txt"
else
  echo "trainer run skipped: trl/datasets not importable or .device/results-trainer missing"
fi

# 2) the mask gate with CUDA confirmation of the predicted backends (default and 27B configs)
for name in gemma-3-270m:.device/model/config.json gemma-3-27b:config/models/gemma-3-27b-it/config.json; do
  timeout 120 python3 scripts/run_mask.py --set "model.config_path=${name#*:}" \
    --results "$EVIDENCE/mask-${name%%:*}" --log "$EVIDENCE/mask-${name%%:*}.log" \
    > "$EVIDENCE/mask-${name%%:*}.stdout" 2>&1
  echo "mask ${name%%:*}: exit $?"
  python3 -c "import json,sys; g=json.load(open(sys.argv[1])); print(json.dumps({k: g.get(k) for k in ('passed','headline','confirm','target')}, default=str)[:1500])" \
    "$EVIDENCE/mask-${name%%:*}/mask/gate.json" 2>&1
done

# 3) data parallel (issue 22). On this one-GPU machine the single-GPU path above is unchanged:
# training.world_size stays 1 and the data_parallel stage does not run. A machine with N >= 2
# GPUs would add, on the same carried plans (NCCL, one rank per GPU, the harness's loss in DDP):
#   python3 scripts/run_data_parallel.py --results .device/results \
#     --set training.world_size=N --set model.path=/tmp/gemma-3-270m-random \
#     --output steps=$EVIDENCE/dp/steps.parquet --output summary=$EVIDENCE/dp/summary.json
# giving, per strategy, the real DDP step against max over ranks + all-reduce, the all-reduce's
# share of the step and each rank's straggler wait. Here W=2 on NCCL is refused with one message
# (probes.distributed: 2 CUDA devices needed, 1 present); gloo on the 16 CPU cores is what
# bench/ddp_step.py measures without a GPU.

# 4) the headline (issue 20): whole epochs of the real Trainer with the settings recommendations.json
# emits, against the replay's promise, on the default Gemma architecture (random init, bf16) on
# the GPU. Last, and bounded: it must not cost the steps above. TRL packing runs only where trl
# and datasets are installed (the device image has neither: the table then says so).
timeout 240 python3 bench/realized_vs_promised.py --device cuda --architecture .device/model \
  --lengths .device/results/padding/lengths.parquet \
  --recommendation .device/results/bucket/recommendation.json \
  --examples 300 --cap 2048 --repeats 2 --budget-s 45 --out "$EVIDENCE/realized_vs_promised.md" \
  > "$EVIDENCE/realized_vs_promised.log" 2>&1
echo "realized_vs_promised: exit $?"; cat "$EVIDENCE/realized_vs_promised.md" 2>/dev/null

# 4b) the same headline in trainer mode (issues 27, 29): the promise is the replay through an
# SFTTrainer factory, every configuration (step-level changes too) realized by that trainer
if python3 -c "import trl, datasets" 2>/dev/null; then
  timeout 200 python3 bench/realized_vs_promised.py --trainer sft --device cuda \
    --architecture .device/model --lengths .device/results/padding/lengths.parquet \
    --recommendation .device/results/bucket/recommendation.json \
    --examples 300 --cap 2048 --repeats 2 --budget-s 40 \
    --out "$EVIDENCE/realized_vs_promised_sft.md" > "$EVIDENCE/realized_vs_promised_sft.log" 2>&1
  echo "realized_vs_promised --trainer sft: exit $?"
  cat "$EVIDENCE/realized_vs_promised_sft.md" 2>/dev/null
  # 4c) torch_compile where it can pay off (issue 43): its promise (compile time per shape the
  # plan meets, amortized; break-even) against the Trainer's own train_runtime, compile included
  timeout 150 python3 bench/realized_vs_promised.py --trainer sft --device cuda \
    --architecture .device/model --lengths .device/results/padding/lengths.parquet \
    --recommendation .device/results/bucket/recommendation.json \
    --changes torch_compile,torch_compile_pad_to_multiple_of_64 \
    --examples 300 --cap 2048 --repeats 2 --budget-s 40 \
    --out "$EVIDENCE/realized_vs_promised_compile.md" \
    > "$EVIDENCE/realized_vs_promised_compile.log" 2>&1
  echo "realized_vs_promised --changes torch_compile*: exit $?"
  cat "$EVIDENCE/realized_vs_promised_compile.md" 2>/dev/null
fi

# files back are limited (8 files, 2 folders down): one archive holds everything
tar -czf "$OUT/evidence.tar.gz" -C "$OUT" evidence && rm -rf "$EVIDENCE"
ls -la "$OUT"
