#!/usr/bin/env bash
# One prepared GPU run of the profile stage (no Snakemake needed), for the evidence in this folder.
#
# Run from the repository root on a machine with one idle CUDA GPU, after copying in
#   resources/model/gemma-3-270m   (rule default_model)
#   results/padding/lengths.parquet (rule padding)
#   results/bucket/recommendation.json (rule bucket_sweep; optional, recorded if present)
# Needs python3 with torch, transformers, peft, pandas, pyarrow, pyyaml, tqdm.
# Writes everything under $OUT (default docs/evidence/gpu-run) and prints the key numbers.
# Budget: about 1-3 minutes on an H100/H200; hard stop at 330 s so the outputs still come back.
set -uo pipefail

OUT="${OUT:-docs/evidence/gpu-run}"
MODEL="${MODEL:-resources/model/gemma-3-270m}"
LENGTHS="${LENGTHS:-results/padding/lengths.parquet}"
RECOMMENDATION="${RECOMMENDATION:-results/bucket/recommendation.json}"
DEVICE="${DEVICE:-cuda}"                          # DEVICE=cpu SEQ_LENGTHS="64 128 256" to rehearse
SEQ_LENGTHS="${SEQ_LENGTHS:-2048 4096 8192 16384}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

for need in "$MODEL/config.json" "$MODEL/model.safetensors" "$LENGTHS"; do
  if [[ ! -f "$need" ]]; then
    echo "missing $need: copy it in first (see the header of $0)" | tee "$OUT/ERROR.txt"
    exit 2
  fi
done

{
  echo "## host"
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu,driver_version \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 || true
  python3 -c 'import sys, torch, transformers, peft; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("transformers", transformers.__version__, "peft", peft.__version__)'
} 2>&1 | tee "$OUT/environment.txt"

# 4 lengths up to 16k: least squares over 4 points leaves residuals to judge the fit by.
start=$(date +%s)
timeout 330 python3 scripts/step1_profile.py \
  --device "$DEVICE" \
  --model-path "$MODEL" \
  --lengths "$LENGTHS" \
  --recommendation "$RECOMMENDATION" \
  --seq-lengths $SEQ_LENGTHS \
  --warmup 2 --repeats 5 --kernel-steps 3 \
  --idle-timeout 60 \
  --out-dir "$OUT/profile" \
  --log "$OUT/profile.log" > "$OUT/stdout.txt" 2>&1
rc=$?
end=$(date +%s)
echo "exit code $rc after $((end - start)) s" | tee "$OUT/exit.txt"

if [[ $rc -ne 0 ]]; then
  echo "## last lines of the log"
  tail -n 60 "$OUT/stdout.txt"
  exit $rc
fi

# the key numbers: everything in profile-output.txt above the raw key_averages() table
echo "## key numbers (full evidence: $OUT/profile/profile-output.txt)"
sed -n '1,/^=== torch.profiler key_averages/p' "$OUT/profile/profile-output.txt"
python3 - "$OUT/profile" <<'PY'
import json, sys
from pathlib import Path

import pandas as pd

out = Path(sys.argv[1])
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 20)
scaling = pd.read_parquet(out / "scaling.parquet")
print(scaling[["seq_len", "batch", "status", "time_s", "time_std_s", "peak_mem_bytes",
               "quadratic_share", "residual_s", "mfu", "mfu_frozen_base"]].to_string(index=False))
print(pd.read_parquet(out / "fit.parquet")[["a", "b", "c", "method", "condition_number",
                                             "residual_rms_s", "max_rel_residual"]].to_string(index=False))
control = json.loads((out / "control.json").read_text())
print("controls passed:", control["passed"],
      {c["name"]: c["passed"] for c in control["checks"]})
print("double count:", control["observed"]["kernel_sum_within_wall_time"])
PY
