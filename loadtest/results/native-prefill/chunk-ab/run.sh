#!/bin/bash
# The long-prompt checks only, make run's services with the prefill chunk at 256 (default)
# and 128 tokens, two rounds in turn, five repeats each.
cd /work/main
OUT=loadtest/results/native-prefill/chunk-ab
for r in 1 2; do
  for chunk in 256 128; do
    ASYMSPEC_CLOUD_PREFILL_CHUNK_TOKENS=$chunk .venv/bin/python scripts/bench_make_run.py --prefill --prefill-repeats 5 \
      --label "chunk$chunk r$r" --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
  done
done
echo DONE
