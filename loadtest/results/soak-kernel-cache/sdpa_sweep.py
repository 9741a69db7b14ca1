"""torch's scaled_dot_product_attention alone, bf16, one thread: native memory in use
(mallinfo2) across key lengths 1..999 for a few query counts, with the keys as they are
(pad 0) or padded to a multiple of 64 and masked. From 64 folded query rows on, every new
key length compiles and keeps new oneDNN brgemm kernels.

    .venv/bin/python loadtest/results/soak-kernel-cache/sdpa_sweep.py 0 20,40,64,130
    .venv/bin/python loadtest/results/soak-kernel-cache/sdpa_sweep.py 64 20,40,64,130
"""
import ctypes, sys, torch, torch.nn.functional as F, threading
class M2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena","ordblks","smblks","hblks","hblkhd","usmblks","fsmblks","uordblks","fordblks","keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = M2
def inuse(): m = libc.mallinfo2(); return (m.uordblks + m.hblkhd) / 1e6
torch.set_num_threads(1)
H_kv, g, D = 2, 2, 16
pad = int(sys.argv[1]) if len(sys.argv) > 1 else 0
def run():
    for n in [int(x) for x in sys.argv[2].split(",")]:
        start = inuse()
        for L in range(n, 1000, 1):
            P = -(-L // pad) * pad if pad else L
            q = torch.randn(1, H_kv, g * n, D, dtype=torch.bfloat16)
            k = torch.zeros(1, H_kv, P, D, dtype=torch.bfloat16); v = torch.zeros_like(k)
            mask = None
            if P > L or n > 1:
                mask = torch.zeros(g * n, P, dtype=torch.bfloat16)
                cols = torch.arange(P)[None]; rows = torch.arange(n).repeat(g)[:, None]
                mask.masked_fill_(cols > rows + (L - n), float("-inf"))
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        print(f"pad {pad} n {n}: in-use {start:.1f} -> {inuse():.1f} MB", flush=True)
t = threading.Thread(target=run); t.start(); t.join()
