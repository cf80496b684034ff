"""step15's prefill kernel against torch SDPA on a GPU, for a few tile configurations (the default rule, 128/128/8/2
and 64/64/4/3 as block_m/block_n/num_warps/num_stages), sequences 512-8192, blocks of 16 (and 64 at 4096).
The outputs docs/data/raw/h200_step15_tune_v*.txt came from this script and its earlier versions (more configs).
Run on the GPU machine from the repository root: python3 docs/data/tune_step15_tiles.py"""
import sys, torch, triton
sys.path.insert(0, ".")
from steps.step15.kernels.attention import paged_attention, attention_reference
from tests.test_part6 import make_case
torch.manual_seed(0)
H, KVH, D = 16, 8, 128
sdpa = torch.nn.functional.scaled_dot_product_attention
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(200):  # raise the clocks before the first measurement
    a @ a
torch.cuda.synchronize()
for S in (512, 1024, 2048, 4096, 8192):
    for bs in ((16, 64) if S == 4096 else (16,)):
        q, k, v, tables, cu, lens = make_case([S], [0], bs, H, KVH, D, torch.bfloat16, device="cuda")
        nb = -(-S // bs)
        keys = k[tables[0, :nb].long()].reshape(-1, KVH, D)[:S]
        vals = v[tables[0, :nb].long()].reshape(-1, KVH, D)[:S]
        qs, ks, vs = (x.transpose(0, 1)[None].contiguous() for x in (q, keys, vals))
        flops = 4 * S * S * D * H / 2
        t_sdpa = triton.testing.do_bench(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
        ref = sdpa(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        line = f"S={S} bs={bs} sdpa {flops/t_sdpa/1e9:.0f} TF/s |"
        for cfg in (dict(), dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
                    dict(block_m=64, block_n=64, num_warps=4, num_stages=3)):
            try:
                f = lambda: paged_attention(q, k, v, tables, cu, lens, D ** -0.5, S, **cfg)
                err = (f().float() - ref.float()).abs().max().item()
                t = triton.testing.do_bench(f)
                line += f" {cfg.get('block_m','d')}/{cfg.get('block_n','d')}/{cfg.get('num_warps','d')}/{cfg.get('num_stages','d')}: {flops/t/1e9:.0f} ({flops/t/1e9/(flops/t_sdpa/1e9):.2f}x, err {err:.1e})"
            except Exception as e:
                line += f" {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}"
        print(line, flush=True)
