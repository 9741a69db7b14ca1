#!/bin/bash
for r in 1 2; do
  (cd /tmp/wt-old && PYTHONPATH=/tmp/wt-old/shared:/tmp/wt-old/services:/tmp/wt-old /work/main/.venv/bin/python -m loadtest.bench --models embedded --concurrency 16 --requests 48 --modes asymspec,target-only --profiles weak,strong --out /tmp/exp3/old-r$r > /tmp/exp3/old-r$r.log 2>&1)
  (cd /work/main && .venv/bin/python -m loadtest.bench --models embedded --concurrency 16 --requests 48 --modes asymspec --profiles weak,strong --out /tmp/exp3/new-r$r > /tmp/exp3/new-r$r.log 2>&1)
done
echo done > /tmp/exp3/DONE
