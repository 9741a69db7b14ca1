#!/bin/bash
cd /work/main
for r in 1 2; do
  .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-old --label "f77201a r$r" --concurrency 1 16 --requests-per-slot 2 --out /tmp/exp4/ab --append > /tmp/exp4/old-r$r.log 2>&1
  .venv/bin/python scripts/bench_make_run.py --repo /work/main --label "new r$r" --concurrency 1 16 --requests-per-slot 2 --out /tmp/exp4/ab --append > /tmp/exp4/new-r$r.log 2>&1
done
echo done > /tmp/exp4/DONE
