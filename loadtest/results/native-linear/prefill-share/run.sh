#!/bin/bash
cd /work/main
OUT=/tmp/probe/share-ab
mkdir -p $OUT
for r in 1 2; do
  for sh in 0.3 0.2; do
    ASYMSPEC_CLOUD_PREFILL_SHARE=$sh .venv/bin/python scripts/bench_make_run.py --prefill --prefill-repeats 5 --label "share$sh r$r" \
      --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append > /tmp/probe/share-$sh-$r.log 2>&1
    echo "share $sh r$r rc=$? $(date)" >> /tmp/probe/share-progress.txt
  done
done
