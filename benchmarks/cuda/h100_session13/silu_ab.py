"""The bf16 grouped pipeline's SiLU x up pass: the session-12 kernel (two stride-2 loads, every allocated row)
vs the new one (one contiguous run split in registers; with and without the used-rows bound), same inputs."""
import torch, triton, triton.language as tl, triton.testing
from moe_plugin_cuda import cutlass_ops


@triton.jit
def _old_silu_mul_kernel(d_ptr, h_ptr, inter, stride_d, stride_h, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    gate = tl.load(d_ptr + row * stride_d + 2 * offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(d_ptr + row * stride_d + 2 * offs + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * stride_h + offs, (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=m)


dev = torch.device("cuda")
# (name, allocated rows = T*K + min(T*K, E)*127, used rows ~ T*K + E*64, I)
CASES = [("qwen3-235b T=16384", 131072 + 128 * 127, 131072 + 128 * 64, 1536),
         ("deepseek-v3 T=16384", 131072 + 256 * 127, 131072 + 256 * 64, 2048),
         ("mixtral T=16384", 32768 + 8 * 127, 32768 + 8 * 64, 14336),
         ("qwen3-235b T=4096", 32768 + 128 * 127, 32768 + 128 * 64, 1536)]
for name, R, used_rows, inter in CASES:
    d1 = torch.randn(R, 2 * inter, device=dev, dtype=torch.bfloat16)
    used = torch.tensor([used_rows], dtype=torch.int32, device=dev)
    h_old = torch.empty(R, inter, device=dev, dtype=torch.bfloat16)
    block = min(1024, triton.next_power_of_2(inter))
    old = lambda: _old_silu_mul_kernel[(R, triton.cdiv(inter, block))](d1, h_old, inter, d1.stride(0), h_old.stride(0), BLOCK=block)
    new = lambda: cutlass_ops.silu_mul(d1, torch.bfloat16, True)
    bounded = lambda: cutlass_ops.silu_mul(d1, torch.bfloat16, True, used)
    old(); torch.cuda.synchronize()
    assert torch.equal(new(), h_old), name
    assert torch.equal(bounded()[:used_rows], h_old[:used_rows]), name
    t = {k: triton.testing.do_bench_cudagraph(f, rep=200, return_mode="median") * 1e3 for k, f in
         (("old", old), ("new", new), ("new bounded", bounded))}
    gbs = R * inter * 2 * 3 / t["old"] / 1e3
    print(f"{name}: rows {R} (used {used_rows}) x I={inter}: old {t['old']:.1f} us ({gbs:.0f} GB/s), "
          f"new {t['new']:.1f} us ({R * inter * 6 / t['new'] / 1e3:.0f} GB/s), bounded {t['new bounded']:.1f} us", flush=True)
    del d1, h_old
    torch.cuda.empty_cache()
