"""The engine's torch attention with and without padded keys: native memory in use (glibc's
mallinfo2) before and after two sweeps of prompt lengths 1..899, each followed by a
40-token forward, on the tiny bf16 pair (torch attention: its head size is the native
kernel's no). Run on a thread other than the main one, as the services do.

    PYTHONPATH=.:shared:services .venv/bin/python \
        loadtest/results/soak-kernel-cache/kernel_cache_sweep.py 0   # keys as they are
    ... kernel_cache_sweep.py 1                                       # padded (the fix)
"""
import ctypes, sys, tempfile, threading, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from tests.services.tiny_models import save_tiny_pair
from asymspec.backends.llama import LlamaEngine
class M2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena","ordblks","smblks","hblks","hblkhd","usmblks","fsmblks","uordblks","fordblks","keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = M2
def inuse(): m = libc.mallinfo2(); return (m.uordblks + m.hblkhd) / 1e6
torch.set_num_threads(1)
target, _ = save_tiny_pair(Path(tempfile.mkdtemp()))
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
eng = LlamaEngine(model)
eng.pads_torch_keys = sys.argv[1] == "1"
def run():
    for sweep in range(2):
        start = inuse()
        for L in range(1, 900, 1):
            eng.open("s", [5] * L)
            eng.forward_new([("s", [7] * 40)], keep_rows=[1])
            eng.close("s")
        print(f"pads {eng.pads_torch_keys} sweep {sweep}: in-use {start:.1f} -> {inuse():.1f} MB", flush=True)
t = threading.Thread(target=run); t.start(); t.join()
