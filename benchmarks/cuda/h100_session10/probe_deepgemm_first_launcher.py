"""Probe 2: our launcher of DeepGEMM's SM90 FP8 kernel (libmoe_dg.so) vs our CUTLASS pipeline, same inputs, one run."""
import ctypes, os, sys, time, statistics, traceback
import torch
sys.path[:0] = ['.', 'plugins/cuda']
T0 = time.time()
import triton
from moe_plugin_cuda import cutlass_ops as C
from moe_plugin_cuda import triton_kernels as K
lib = ctypes.CDLL(os.environ.get('DG_LIB', '/tmp/dgb/libmoe_dg.so'))
vp, u32 = ctypes.c_void_p, ctypes.c_uint32
lib.moe_dg_fp8_grouped_gemm.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, vp, u32, u32, u32, u32, vp]
lib.moe_dg_last_error.restype = ctypes.c_char_p
NV = lib.moe_dg_num_variants()
print('variants', NV, 'sms', lib.moe_dg_num_sms(), flush=True)
FP8 = torch.float8_e4m3fn
dev = torch.device('cuda')
PRESETS = {'qwen3-235b-a22b': (128, 8, 4096, 1536), 'deepseek-v3': (256, 8, 7168, 2048),
           'qwen3-30b-a3b': (128, 8, 2048, 768), 'mixtral-8x7b': (8, 2, 4096, 14336)}
TABLE = {('qwen3-235b-a22b', 4096): (1, 3), ('qwen3-235b-a22b', 16384): (6, 0), ('deepseek-v3', 4096): (4, 2),
         ('deepseek-v3', 16384): (1, 3), ('qwen3-30b-a3b', 4096): (1, 3), ('qwen3-30b-a3b', 16384): (1, 5),
         ('mixtral-8x7b', 4096): (6, 3), ('mixtral-8x7b', 16384): (6, 3)}
CELLS = [(p, int(t)) for p, t in (c.split(':') for c in os.environ.get(
    'CELLS', 'qwen3-235b-a22b:16384 deepseek-v3:16384 qwen3-30b-a3b:4096 qwen3-235b-a22b:4096').split())]
BUDGET = float(os.environ.get('BUDGET_S', 420))


def m_indices(R, m_sizes, row_start):
    rows = torch.arange(R, device=dev)
    idx = torch.searchsorted(row_start, rows, right=True) - 1
    ic = idx.clamp(min=0)
    valid = (idx >= 0) & (rows < row_start[ic] + m_sizes[ic])
    return torch.where(valid, idx, -1).to(torch.int32)


def dg_raw(a, sfa_t, b, b_scale, d, mi, variant):
    R, Kd = a.shape
    G, N, _ = b.shape
    rc = lib.moe_dg_fp8_grouped_gemm(variant, a.data_ptr(), sfa_t.data_ptr(), b.data_ptr(), b_scale.data_ptr(),
                                     d.data_ptr(), mi.data_ptr(), R, N, Kd, G, torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f'dg gemm rc={rc}: {lib.moe_dg_last_error().decode()}')


def dg_gemm(a, a_scale, b, b_scale, d, m_sizes, row_start, variant=None):
    mi = m_indices(a.shape[0], m_sizes, row_start)
    dg_raw(a, a_scale.t().contiguous(), b, b_scale, d, mi, variant or 0)


def padded_layout(topk_ids, E, align):
    T, Kt = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    key = torch.where((ids >= 0) & (ids < E), ids, E)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (counts + align - 1) // align * align
    start_p = torch.cumsum(padded, 0) - padded
    start_u = torch.cumsum(counts, 0) - counts
    e = key[order].clamp(max=E - 1)
    rows_sorted = start_p[e] + torch.arange(T * Kt, device=dev) - start_u[e]
    row_of_slot = torch.empty_like(order).scatter_(0, order, rows_sorted)
    return counts, start_p, row_of_slot, -(-(T * Kt + E * (align - 1)) // align) * align


def q_into_rows(hidden, topk_ids, row_of_slot, E, R):
    T, H = hidden.shape
    top_k, g = topk_ids.shape[1], H // 128
    a = torch.empty((R, H), dtype=FP8, device=dev)
    s = torch.empty((R, g), dtype=torch.float32, device=dev)
    groups = min(8, triton.next_power_of_2(g))
    K._quantize_into_rows_kernel[(T, triton.cdiv(g, groups))](
        hidden, s, a, s, topk_ids.to(torch.int32).contiguous(), row_of_slot, E, H,
        hidden.stride(0), s.stride(0), a.stride(0), s.stride(0), K=top_k, GROUPS=groups, QUANTIZE=True)
    return a, s


def dg_pipeline(hidden, w13, w2, s13, s2, tw, ids, align=128, variants=(0, 0)):
    T, H = hidden.shape
    E, top_k = w13.shape[0], ids.shape[1]
    counts, start, row_of_slot, R = padded_layout(ids, E, align)
    a, a_s = q_into_rows(hidden, ids, row_of_slot, E, R)
    y = C._experts(a, a_s, w13, s13, w2, s2, counts, start, dg_gemm, torch.bfloat16, FP8, torch.bfloat16,
                  variants)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    block_h = min(1024, triton.next_power_of_2(H))
    K._moe_reduce_kernel[(T, triton.cdiv(H, block_h))](
        y, ids.to(torch.int32).contiguous(), out, H, 1.0, E, row_of_slot, tw.float().contiguous(),
        K=top_k, BLOCK_H=block_h, MAPPED=True)
    return out


def rand_fp8(*shape):
    out = torch.empty(shape, dtype=FP8, device=dev)
    flat = out.view(shape[0], -1)
    for i in range(0, shape[0], 8):
        flat[i:i + 8] = torch.randn(flat[i:i + 8].shape, device=dev, dtype=torch.float16).to(FP8)
    return out


def bench(fn, iters=10, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / iters * 1000)
    return statistics.median(ts)


# ---- correctness of every variant on a small grouped problem (odd counts, an empty expert, N % BN != 0)
torch.manual_seed(0)
for (G, N, Kd, counts) in [(3, 384, 512, [100, 0, 200]), (4, 1536, 768, [1, 129, 64, 300])]:
    cnt = torch.tensor(counts, device=dev)
    pad = (cnt + 127) // 128 * 128
    start = torch.cumsum(pad, 0) - pad
    R = int(pad.sum()) + 128
    x = torch.randn(R, Kd, device=dev)
    a, a_s = C.quantize_fp8_groups(x) if hasattr(C, 'quantize_fp8_groups') else (None, None)
    b = rand_fp8(G, N, Kd)
    bs = torch.rand(G, N // 128, Kd // 128, device=dev) + 0.5
    ref = torch.zeros(R, N, device=dev)
    C.reference_gemm(a, a_s, b, bs, ref, cnt, start)
    mi = m_indices(R, cnt, start)
    valid = mi >= 0
    for v in range(NV):
        d = torch.full((R, N), float('nan'), device=dev, dtype=torch.bfloat16)
        try:
            dg_raw(a, a_s.t().contiguous(), b, bs, d, mi, v); torch.cuda.synchronize()
            err = ((d[valid].float() - ref[valid]).norm() / ref[valid].norm()).item()
            print(f'correctness G={G} N={N} K={Kd} variant {v}: rel err {err:.2e}', flush=True)
        except Exception as e:
            print(f'correctness G={G} N={N} K={Kd} variant {v}: FAILED {e!r}', flush=True)

for preset, T in CELLS:
    if time.time() - T0 > BUDGET:
        print('budget reached, skipping', preset, T); continue
    try:
        E, top_k, H, I = PRESETS[preset]
        torch.manual_seed(T)
        w13, w2 = rand_fp8(E, 2 * I, H), rand_fp8(E, H, I)
        s13 = torch.rand(E, 2 * I // 128, H // 128, device=dev) * 1e-2 + 5e-3
        s2 = torch.rand(E, H // 128, I // 128, device=dev) * 1e-2 + 5e-3
        hidden = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device=dev).topk(top_k, dim=1).indices.to(torch.int32)
        tw = torch.softmax(torch.randn(T, top_k, device=dev), 1)
        v = TABLE.get((preset, T), (1, 0))
        counts, start_p, ros_p, R = padded_layout(ids, E, 128)
        a_p, as_p = q_into_rows(hidden, ids, ros_p, E, R)
        sfa_p = as_p.t().contiguous()
        mi = m_indices(R, counts, start_p)
        d1p = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
        dg_raw(a_p, sfa_p, w13, s13, d1p, mi, 0)
        h_p, hs_p = C.silu_mul_quant(d1p)
        hsf_p = hs_p.t().contiguous()
        d2p = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
        start_u = torch.cumsum(counts, 0) - counts
        order = torch.argsort(ids.reshape(-1).long(), stable=True)
        ros_u = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))
        a_u, as_u = C.quantize_into_rows(hidden, None, ids, ros_u, E)
        d1u = torch.empty(T * top_k, 2 * I, dtype=torch.float32, device=dev)
        g1c = lambda: C.cutlass_gemm(a_u, as_u, w13, s13, d1u, counts, start_u, variant=v[0])
        g1c()
        h_u, hs_u = C.silu_mul_quant(d1u)
        d2u = torch.empty(T * top_k, H, dtype=torch.bfloat16, device=dev)
        g2c = lambda: C.cutlass_gemm(h_u, hs_u, w2, s2, d2u, counts, start_u, variant=v[1])
        torch.cuda.synchronize()
        rel1 = ((d1p[ros_p].float() - d1u[ros_u]).norm() / d1u.norm()).item()
        print(f'{preset} T={T} rows {T * top_k} padded-bound {R}: GEMM1 rel diff dg(bf16) vs cutlass(fp32) {rel1:.2e}', flush=True)
        f1 = 2 * T * top_k * 2 * I * H
        t1c, t2c = bench(g1c), bench(g2c)
        best = []
        for gi, (f, mk) in enumerate(((f1, lambda vv: (lambda: dg_raw(a_p, sfa_p, w13, s13, d1p, mi, vv))),
                                      (f1 / 2, lambda vv: (lambda: dg_raw(h_p, hsf_p, w2, s2, d2p, mi, vv))))):
            ts = []
            for vv in range(NV):
                try:
                    ts.append(bench(mk(vv), iters=5, reps=3))
                except Exception as e:
                    ts.append(float('inf')); print('  variant', vv, 'failed', repr(e)[:200])
            tc = t1c if gi == 0 else t2c
            print(f'  GEMM{gi + 1}: cutlass v{v[gi]} {tc:8.1f} us ({f / tc / 1e6:6.1f} TF) | dg ' +
                  ' '.join(f'v{k}:{t:7.1f}' for k, t in enumerate(ts)) +
                  f' | best v{ts.index(min(ts))} {min(ts):8.1f} us ({f / min(ts) / 1e6:6.1f} TF) ratio {tc / min(ts):.2f}', flush=True)
            best.append(ts.index(min(ts)))
        cut = lambda: C.fused_experts(hidden, None, w13, w2, s13, s2, tw, ids, routed_scaling_factor=1.0,
                                      out_dtype=torch.bfloat16, variants=v)
        dgp = lambda: dg_pipeline(hidden, w13, w2, s13, s2, tw, ids, variants=tuple(best))
        ref, out = cut(), dgp()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        res = {}
        for rep in range(2):
            for name, fn in (('cutlass pipeline', cut), ('dg pipeline', dgp)):
                res.setdefault(name, []).append(bench(fn))
        print(f'  pipelines (rel diff {rel:.2e}): ' + ' | '.join(f'{n} ' + ' '.join(f'{x:8.1f}' for x in ts) for n, ts in res.items()), flush=True)
        del w13, w2, a_p, a_u, d1p, d1u, d2p, d2u, h_p, h_u
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()
print('total %.0fs' % (time.time() - T0))
