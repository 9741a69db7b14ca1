"""Where a bf16 LlamaEngine forward's time goes, by the engine's own calls (2 threads).

The profiler in scripts/forward_breakdown.py sees one op when the decoder layers run in
one native call, so this times the engine's methods directly: with the native layers (the
default) and with the Python layer loop (each product, rotary, attention and norm timed).

    PYTHONPATH=shared:services .venv/bin/python \
        loadtest/results/blocked-20261206/forward_parts.py > forward_parts.txt
"""

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.prepare import target_dir

REPO = Path(__file__).resolve().parents[3]
torch.set_num_threads(2)
print("machine:", json.dumps(machine_facts()))
model = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.bfloat16).eval()
tokenizer = AutoTokenizer.from_pretrained(target_dir())
ids = tokenizer((REPO / "README.md").read_text()).input_ids

for native_layers in (True, False):
    engine = LlamaEngine(model, native_layers=native_layers)
    spent: dict[str, float] = {}

    def timed(owner: object, name: str, key: str) -> None:
        call = getattr(owner, name)

        def run(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            out = call(*args, **kwargs)
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started
            return out

        setattr(owner, name, run)

    if native_layers:
        timed(engine.native_layers, "run", "layers")
    else:
        timed(engine.native_attention, "attend", "attention")
        for layer in engine.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                timed(layer, name, name)
        timed(engine, "_rotary", "rotary")
        timed(engine, "_add_norm", "add_norm")
        timed(engine, "_silu_mul", "silu")
    timed(engine, "_rms_norm", "final_norm")
    timed(engine, "head", "head")
    for sessions, n in ((1, 1), (16, 1), (16, 5)):
        batch = []
        for i in range(sessions):  # 200-token prefixes of the README, staggered
            prompt = ids[i * 50 : i * 50 + 200]
            session_id = f"{native_layers}-{sessions}x{n}-{i}"
            engine.open(session_id, prompt[:-n])
            batch.append((session_id, prompt[-n:]))
        lengths = {session_id: engine.length(session_id) for session_id, _ in batch}
        walls, parts = [], []
        for repeat in range(15):
            spent.clear()
            started = time.perf_counter()
            engine.forward_new(batch, keep_rows=[n] * sessions)
            wall = time.perf_counter() - started
            for session_id, length in lengths.items():
                engine.truncate(session_id, length)
            if repeat:  # the first is a warm-up
                walls.append(wall)
                parts.append(dict(spent))
        medians = {key: 1e3 * statistics.median(p[key] for p in parts) for key in parts[0]}
        layers = "native layers" if native_layers else "Python layer loop"
        print(
            f"{layers:17s} {sessions:2d} x {n}: wall {1e3 * statistics.median(walls):5.1f} ms; "
            + ", ".join(f"{key} {ms:.1f}" for key, ms in medians.items())
        )
        for session_id, _ in batch:
            engine.close(session_id)
