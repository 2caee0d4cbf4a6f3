// DeepGEMM's SM90 GEMM kernels (from the sgl-deep-gemm wheel's headers) launched as M-grouped contiguous
// GEMMs behind a plain C ABI: no torch headers, so no torch ABI. Two kernels:
//
//   FP8 block-scaled (sm90_fp8_gemm_1d2d_impl): d[r, :] = (a[r, :] * sfa[:, r]) @ (b[g] * sfb[g]).T
//   bf16 (sm90_bf16_gemm_impl):                 d[r, :] = a[r, :] @ b[g].T
// for the rows r of every expert g.
//
// FP8: a: e4m3 [M, K] K-major; sfa: fp32 [K/128, M] (MN-major: one row per 128-wide K group); b: e4m3
// [G, N, K]; sfb: fp32 [G, N/128, K/128]. bf16: a: bf16 [M, K], b: bf16 [G, N, K]. Both: d: bf16 [M, N].
// Expert g's rows are psum[g - 1] rounded up to a multiple of
// 128 .. psum[g] (psum: int32 [MOE_DG_MAX_GROUPS], the kernel's "psum layout"; entries past the last
// expert repeat its end, so they hold no rows): every 128-row tile belongs to one expert, and only the
// experts' tiles are scheduled. Rows of d outside every expert but inside a tile may be written. M, N, K
// are runtime; the kernels compiled are the variants below (tile, pipeline depth, TMA multicast).
// MOE_DG_NUM_SMS: the persistent grid (the GPU's SM count).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

#ifndef MOE_DG_NUM_SMS
#define MOE_DG_NUM_SMS 132
#endif
#define MOE_DG_MAX_GROUPS 1024

// The last error's text: one buffer for all the objects (defined by the API object).
extern thread_local char moe_dg_error[512];
#if !defined(MOE_DG_FP8_ONLY) && !defined(MOE_DG_BF16_ONLY)
thread_local char moe_dg_error[512] = "";
#endif

// (inline: nvcc gives these anonymous-namespace functions external linkage, and every object defines them)
namespace {

inline int fail(const char* what, int code) {
    std::snprintf(moe_dg_error, sizeof(moe_dg_error), "%s (%d)", what, code);
    return code ? code : -1;
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeFn encode_fn() {
    static EncodeFn fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status)
                != cudaSuccess || status != cudaDriverEntryPointSuccess)
            p = nullptr;
        return reinterpret_cast<EncodeFn>(p);
    }();
    return fn;
}

// A 2-D tensor map: `outer` rows of `inner` elements, `row_bytes` apart; box `box_inner` x `box_outer`.
inline int make_map(CUtensorMap* map, CUtensorMapDataType dtype, const void* ptr, uint64_t inner, uint64_t outer,
             uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer, uint32_t swizzle_bytes) {
    EncodeFn encode = encode_fn();
    if (!encode)
        return fail("cuTensorMapEncodeTiled is not available from the driver", -2);
    const cuuint64_t dims[2] = {inner, outer};
    const cuuint64_t strides[1] = {row_bytes};
    const cuuint32_t box[2] = {box_inner, box_outer};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUtensorMapSwizzle swizzle = swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : swizzle_bytes == 64  ? CU_TENSOR_MAP_SWIZZLE_64B
                                     : swizzle_bytes == 32  ? CU_TENSOR_MAP_SWIZZLE_32B
                                                            : CU_TENSOR_MAP_SWIZZLE_NONE;
    const CUresult r = encode(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : fail("cuTensorMapEncodeTiled failed", static_cast<int>(r));
}

constexpr uint32_t swizzle_for(uint32_t bytes) {
    return bytes % 128 == 0 ? 128 : bytes % 64 == 0 ? 64 : bytes % 32 == 0 ? 32 : 0;
}

constexpr uint32_t align_up(uint32_t x, uint32_t a) { return (x + a - 1) / a * a; }

// The kernels' shared memory, laid out as sm90_fp8_gemm_1d2d_impl / sm90_bf16_gemm_impl lay it out.
template <uint32_t BM, uint32_t BN, uint32_t STAGES>
uint32_t fp8_smem_bytes(uint32_t k) {
    const uint32_t d = align_up(BM * BN * 2, 1024);
    const uint32_t per_stage = BM * 128 + BN * 128 + align_up(BM * 4, 128);
    const uint32_t sfb_rows = (128 % BN == 0) ? 1 : 2;
    const uint32_t sfb = align_up((k + 127) / 128 * sfb_rows * 4, 8);
    return d + STAGES * per_stage + sfb + 2 * STAGES * 8;
}

template <uint32_t BM, uint32_t BN, uint32_t STAGES>
constexpr uint32_t bf16_smem_bytes() {
    return align_up(BM * BN * 2, 1024) + STAGES * (BM + BN) * 64 * 2 + 2 * STAGES * 8;
}

// The checks both kernels need. The psum scheduler pairs consecutive tiles into a 2-CTA cluster; with an
// odd number of column tiles a pair can straddle two experts (or end alone), and the kernel then waits
// forever on its peer: a multicast variant needs an even column-tile count.
inline int check_shapes(uint32_t bm, uint32_t bn, uint32_t mc, uint32_t m, uint32_t n, uint32_t g) {
    if (m % bm || n % 8 || g > MOE_DG_MAX_GROUPS)
        return fail("shapes: M must be a multiple of 128, N of 8, at most 1024 experts", -3);
    if (mc > 1 && (n + bn - 1) / bn % 2)
        return fail("a multicast variant needs an even number of BLOCK_N column tiles", -6);
    return 0;
}

// A persistent launch over the grid, in clusters of `mc` CTAs.
template <typename Kernel, typename... Args>
int launch_persistent(Kernel kernel, uint32_t threads, uint32_t smem, uint32_t mc, cudaStream_t stream,
                      Args... args) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess)
        return fail(cudaGetErrorString(e), e);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(MOE_DG_NUM_SMS);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = mc;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    e = cudaLaunchKernelEx(&config, kernel, args...);
    return e == cudaSuccess ? 0 : fail(cudaGetErrorString(e), e);
}

template <uint32_t BM, uint32_t BN, uint32_t STAGES, uint32_t MC, bool MC_ON_A>
int launch_fp8(const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int* psum,
               uint32_t m, uint32_t n, uint32_t k, uint32_t g, cudaStream_t stream) {
    constexpr uint32_t kMathThreads = BM <= 64 ? 128 : 256;
    constexpr uint32_t kSwizzleD = swizzle_for(BN * 2);
    constexpr uint32_t kBoxD = kSwizzleD ? kSwizzleD / 2 : BN;
    auto kernel = deep_gemm::sm90_fp8_gemm_1d2d_impl<
        cute::UMMA::Major::K, 0, 0, 0, MOE_DG_MAX_GROUPS, BM, BN, 128, 128, 128, kSwizzleD, STAGES, 128, kMathThreads, MC,
        MC_ON_A, MOE_DG_NUM_SMS, deep_gemm::GemmType::MGroupedContiguousWithPsumLayout, cutlass::bfloat16_t>;
    int rc = check_shapes(BM, BN, MC, m, n, g);
    if (!rc && k % 128)
        rc = fail("shapes: the FP8 kernel's K must be a multiple of 128", -3);
    CUtensorMap map_a, map_b, map_d, map_sfa;
    rc = rc ? rc : make_map(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a, k, m, k, 128, BM, 128);
    rc = rc ? rc : make_map(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, b, k, uint64_t(g) * n, k, 128, BN, 128);
    rc = rc ? rc : make_map(&map_d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, d, n, m, uint64_t(n) * 2, kBoxD, BM, kSwizzleD);
    rc = rc ? rc : make_map(&map_sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sfa, m, k / 128, uint64_t(m) * 4, BM, 1, 0);
    if (rc)
        return rc;
    return launch_persistent(kernel, 128 + kMathThreads, fp8_smem_bytes<BM, BN, STAGES>(k), MC, stream,
                             const_cast<float*>(sfb), const_cast<int*>(psum), m, n, k, map_a, map_b, map_d, map_sfa);
}

template <uint32_t BM, uint32_t BN, uint32_t STAGES, uint32_t MC, bool MC_ON_A>
int launch_bf16(const void* a, const void* b, void* d, const int* psum, uint32_t m, uint32_t n, uint32_t k,
                uint32_t g, cudaStream_t stream) {
    constexpr uint32_t kMathThreads = 256;
    constexpr uint32_t kBlockK = 64;  // one 128-byte swizzle atom of bf16
    constexpr uint32_t kSwizzleD = swizzle_for(BN * 2);
    constexpr uint32_t kBoxD = kSwizzleD ? kSwizzleD / 2 : BN;
    auto kernel = deep_gemm::sm90_bf16_gemm_impl<
        cute::UMMA::Major::K, cute::UMMA::Major::K, 0, 0, 0, MOE_DG_MAX_GROUPS, BM, BN, kBlockK, 128, 128, kSwizzleD,
        STAGES, 128, kMathThreads, MC, MC_ON_A, MOE_DG_NUM_SMS, deep_gemm::GemmType::MGroupedContiguousWithPsumLayout,
        false, cutlass::bfloat16_t>;
    int rc = check_shapes(BM, BN, MC, m, n, g);
    if (!rc && k % 8)  // TMA: rows 16-byte aligned (a K tail inside the last 64-wide block reads zeros)
        rc = fail("shapes: the bf16 kernel's K must be a multiple of 8", -3);
    CUtensorMap map_a, map_b, map_d;
    rc = rc ? rc : make_map(&map_a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, k, m, uint64_t(k) * 2, kBlockK, BM, 128);
    rc = rc ? rc : make_map(&map_b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, b, k, uint64_t(g) * n, uint64_t(k) * 2, kBlockK,
                            BN, 128);
    rc = rc ? rc : make_map(&map_d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, d, n, m, uint64_t(n) * 2, kBoxD, BM, kSwizzleD);
    if (rc)
        return rc;
    return launch_persistent(kernel, 128 + kMathThreads, bf16_smem_bytes<BM, BN, STAGES>(), MC, stream,
                             const_cast<int*>(psum), m, n, k, map_a, map_b, map_d);
}

}  // namespace

// The variants: (BLOCK_M, BLOCK_N, stages, TMA multicast, multicast on A). Keep in step with
// deepgemm_lib.FP8_VARIANTS / BF16_VARIANTS. BLOCK_M is 128 throughout (the psum layout aligns experts to
// BLOCK_M).
struct Variant { uint32_t bm, bn, stages, multicast; bool multicast_on_a; };
// FP8: BLOCK_N must be <= 128 or share BLOCK_N - 128 with 128 (the kernel's B-scale rule): 128, 144, 160,
// 192. 256 spills registers.
constexpr Variant kFp8Variants[] = {
    {128, 128, 5, 1, false}, {128, 128, 5, 2, false}, {128, 144, 5, 2, false}, {128, 160, 5, 2, false},
    {128, 192, 4, 2, false}, {128, 128, 5, 2, true},  {128, 160, 5, 2, true},  {128, 192, 4, 2, true},
};
// bf16: as many 64-wide K stages as fit next to the output tile in 227 KB of shared memory.
constexpr Variant kBf16Variants[] = {
    {128, 128, 6, 1, false}, {128, 128, 6, 2, false}, {128, 160, 5, 2, false}, {128, 192, 4, 2, false},
    {128, 256, 3, 2, false}, {128, 128, 6, 2, true},  {128, 192, 4, 2, true},  {128, 256, 3, 2, true},
};
constexpr int kNumFp8Variants = sizeof(kFp8Variants) / sizeof(kFp8Variants[0]);
constexpr int kNumBf16Variants = sizeof(kBf16Variants) / sizeof(kBf16Variants[0]);
#define MOE_BF16_SMEM_CHECK(i) \
    static_assert(bf16_smem_bytes<kBf16Variants[i].bm, kBf16Variants[i].bn, kBf16Variants[i].stages>() <= 232448);
MOE_BF16_SMEM_CHECK(0) MOE_BF16_SMEM_CHECK(1) MOE_BF16_SMEM_CHECK(2) MOE_BF16_SMEM_CHECK(3)
MOE_BF16_SMEM_CHECK(4) MOE_BF16_SMEM_CHECK(5) MOE_BF16_SMEM_CHECK(6) MOE_BF16_SMEM_CHECK(7)

// One object per variant (MOE_DG_FP8_ONLY=i or MOE_DG_BF16_ONLY=i, compiled in parallel) defines
// fp8_variant<i> or bf16_variant<i>; the API object (neither set) dispatches to them.
template <int I>
int fp8_variant(const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int* psum,
                uint32_t m, uint32_t n, uint32_t k, uint32_t g, cudaStream_t stream);
template <int I>
int bf16_variant(const void* a, const void* b, void* d, const int* psum, uint32_t m, uint32_t n, uint32_t k,
                 uint32_t g, cudaStream_t stream);

#if defined(MOE_DG_FP8_ONLY)
template <>
int fp8_variant<MOE_DG_FP8_ONLY>(const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                                 const int* psum, uint32_t m, uint32_t n, uint32_t k, uint32_t g, cudaStream_t stream) {
    constexpr Variant v = kFp8Variants[MOE_DG_FP8_ONLY];
    return launch_fp8<v.bm, v.bn, v.stages, v.multicast, v.multicast_on_a>(a, sfa, b, sfb, d, psum, m, n, k, g,
                                                                           stream);
}
#elif defined(MOE_DG_BF16_ONLY)
template <>
int bf16_variant<MOE_DG_BF16_ONLY>(const void* a, const void* b, void* d, const int* psum, uint32_t m, uint32_t n,
                                   uint32_t k, uint32_t g, cudaStream_t stream) {
    constexpr Variant v = kBf16Variants[MOE_DG_BF16_ONLY];
    return launch_bf16<v.bm, v.bn, v.stages, v.multicast, v.multicast_on_a>(a, b, d, psum, m, n, k, g, stream);
}
#else
template <int... I>
int dispatch_fp8(int variant, std::integer_sequence<int, I...>, const void* a, const float* sfa, const void* b,
                 const float* sfb, void* d, const int* psum, uint32_t m, uint32_t n, uint32_t k, uint32_t g,
                 cudaStream_t s) {
    if (variant < 0 || variant >= kNumFp8Variants)
        return fail("unknown FP8 variant", -5);
    int rc = 0;
    ((variant == I ? (rc = fp8_variant<I>(a, sfa, b, sfb, d, psum, m, n, k, g, s), 0) : 0), ...);
    return rc;
}

template <int... I>
int dispatch_bf16(int variant, std::integer_sequence<int, I...>, const void* a, const void* b, void* d,
                  const int* psum, uint32_t m, uint32_t n, uint32_t k, uint32_t g, cudaStream_t s) {
    if (variant < 0 || variant >= kNumBf16Variants)
        return fail("unknown bf16 variant", -5);
    int rc = 0;
    ((variant == I ? (rc = bf16_variant<I>(a, b, d, psum, m, n, k, g, s), 0) : 0), ...);
    return rc;
}

extern "C" {
__attribute__((visibility("default"))) int moe_dg_num_fp8_variants() { return kNumFp8Variants; }
__attribute__((visibility("default"))) int moe_dg_num_bf16_variants() { return kNumBf16Variants; }
__attribute__((visibility("default"))) int moe_dg_num_sms() { return MOE_DG_NUM_SMS; }
__attribute__((visibility("default"))) int moe_dg_max_groups() { return MOE_DG_MAX_GROUPS; }
__attribute__((visibility("default"))) const char* moe_dg_last_error() { return moe_dg_error; }

__attribute__((visibility("default"))) int moe_dg_fp8_grouped_gemm(
        int variant, const void* a, const float* sfa, const void* b, const float* sfb, void* d, const int* psum,
        uint32_t m, uint32_t n, uint32_t k, uint32_t g, void* stream) {
    return dispatch_fp8(variant, std::make_integer_sequence<int, kNumFp8Variants>(), a, sfa, b, sfb, d, psum, m, n,
                        k, g, static_cast<cudaStream_t>(stream));
}

__attribute__((visibility("default"))) int moe_dg_bf16_grouped_gemm(
        int variant, const void* a, const void* b, void* d, const int* psum, uint32_t m, uint32_t n, uint32_t k,
        uint32_t g, void* stream) {
    return dispatch_bf16(variant, std::make_integer_sequence<int, kNumBf16Variants>(), a, b, d, psum, m, n, k, g,
                         static_cast<cudaStream_t>(stream));
}
}
#endif
