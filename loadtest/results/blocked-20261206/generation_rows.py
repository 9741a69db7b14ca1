"""One distillation generation step at 64, 128 and 256 rows (bf16 LlamaEngine, 2 threads):
the forward, the top-K labels and the blocked-CDF draw, in ms, and the tokens/s they allow.

    PYTHONPATH=shared:services .venv/bin/python \
        loadtest/results/blocked-20261206/generation_rows.py > generation_rows.txt
"""
import sys, time, torch
sys.path.insert(0, "/work/main/scripts")
import distill_draft as d
from asymspec.backends.hardware import resolve_dtype
from asymspec.backends.loading import session_lm
torch.set_num_threads(2)
model, tok = d.load_target(resolve_dtype("auto", "cpu"))
lm = session_lm(model, int(tok.pad_token_id or 0))
prompt = tok("Explain how a hash map works, with an example in Python, and discuss collisions.").input_ids
for B in (64, 128, 256):
    sessions = [f"s{i}" for i in range(B)]
    for s in sessions: lm.open(s, [])
    lm.forward_new([(s, list(prompt)) for s in sessions], keep_rows=[1]*B)
    # grow context to ~150
    g = torch.Generator().manual_seed(0)
    tf = tl = ts = 0.0; n = 0
    for step in range(40):
        t0 = time.perf_counter()
        rows = lm.forward_new([(s, [int(torch.randint(100, 20000, (1,)))]) for s in sessions], keep_rows=[1]*B)
        logits = torch.cat(rows)
        t1 = time.perf_counter()
        ids, lp = d.labels_from_logits(logits)
        t2 = time.perf_counter()
        tokn = d.sample_blocked_cdf(torch.softmax(logits.float() / 0.7, -1), g)
        t3 = time.perf_counter()
        if step >= 10:
            tf += t1-t0; tl += t2-t1; ts += t3-t2; n += 1
    for s in sessions: lm.close(s)
    print(f"B={B}: forward {1e3*tf/n:.1f} ms, labels {1e3*tl/n:.1f} ms, sample {1e3*ts/n:.1f} ms -> {B/((tf+tl+ts)/n):.0f} tok/s", flush=True)
