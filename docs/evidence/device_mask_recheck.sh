#!/usr/bin/env bash
# Second device run: re-check the mask gate's backend prediction for 256-wide heads after the
# cuDNN gate was fixed from the first run's disagreement, and run the CUDA-only mask tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
EVIDENCE="$OUT/evidence"
mkdir -p "$EVIDENCE"
python3 -m pytest -q -p no:cacheprovider tests/test_mask_backend.py 2>&1 | tail -5 | tee "$EVIDENCE/pytest_mask_backend.txt"
for name in gemma-3-270m:.device/model/config.json gemma-3-27b:config/models/gemma-3-27b-it/config.json; do
  timeout 120 python3 scripts/step0_mask.py --model-config "${name#*:}" \
    --outdir "$EVIDENCE/mask-${name%%:*}" --log "$EVIDENCE/mask-${name%%:*}.log" \
    > "$EVIDENCE/mask-${name%%:*}.stdout" 2>&1
  echo "mask ${name%%:*}: exit $?"
  python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['confirm']; print({k: c.get(k) for k in ('ran','agree','calls_checked')}, c.get('disagreements', [])[:3])" \
    "$EVIDENCE/mask-${name%%:*}/gate.json" 2>&1
done
tar -czf "$OUT/evidence.tar.gz" -C "$OUT" evidence && rm -rf "$EVIDENCE"
