// cutlass_grouped.cu -- CUTLASS 3.x-API (CUTLASS 4.2.0 headers) Hopper sm_90a ptr-array grouped GEMMs behind a
// plain C ABI (no torch headers): FP8 with DeepSeek-style block scaling, and bf16.
//
//   FP8:  D[g] (bf16 or fp32, row-major M_g x N) = sum_k  A[g][m,k] * SFA[g](m, k/128) * B[g][n,k] * SFB[g](n/128, k/128)
//   bf16: D[g] (bf16, row-major M_g x N)         = sum_k  A[g][m,k] * B[g][n,k]           (fp32 accumulation)
//
// Operands, per group g (all pointers are DEVICE pointers, read from device pointer arrays):
//   A[g]   e4m3 (float8_e4m3fn) or bf16 (per variant), row-major [M_g, K]   (K contiguous, "T")
//   B[g]   as A, each expert's weight row-major [N, K] (K contiguous, "N" in BLAS terms => "TN")
//   D[g]   bf16 or fp32 (per variant), row-major [M_g, N] (N contiguous); no C operand (beta = 0, C is never read)
//   SFA[g] fp32 activation scales, one per (token, 128-wide K group)     (FP8 variants; bf16 ones ignore it)
//   SFB[g] fp32 weight scales, one per 128x128 (N, K) block               (FP8 variants; bf16 ones ignore it)
//
// Scale layouts (verified against include/cutlass/detail/blockwise_scale_layout.hpp,
// Sm1xxBlockwiseScaleConfig::tile_atom_to_shape_SFA/SFB, CUTLASS 4.2.0):
//   SFB, every variant (K-major): row-major [ceil(N/128), ceil(K/128)] per expert, i.e. exactly the
//        DeepSeek-V3 `weight_scale_inv` layout; a stacked [E, N/128, K/128] tensor works with
//        sfb_ptrs[g] = base + g * ceil(N/128) * ceil(K/128).
//   SFA (K-major): row-major [M_g, ceil(K/128)] per group, i.e. the natural output of a per-token-group
//        quantizer; with a stacked [M_total, K/128] tensor and groups contiguous in rows,
//        sfa_ptrs[g] = base + row_offset_g * ceil(K/128). (SGLang's sgl-kernel uses this layout on sm90:
//        Sm90BlockwiseScaleConfig<1,128,128,GMMA::Major::K,GMMA::Major::K>.)
//
// Variants (the `variant` argument; measured on an H100: docs/decisions.md, "The CUDA plugin's measured defaults"):
//   0: FP8, tile 128x128x128, KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, cluster 1x1x1, bf16 D
//   1: as 0 with an fp32 D
//   2: FP8, tile  64x128x128, KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,    cluster 1x1x1, bf16 D
//   3: FP8, tile 128x128x128, cooperative, cluster 1x2x1 (TMA multicast of A; SGLang's H100 config), bf16 D
//   4: as 2 with an fp32 D (pingpong: one warpgroup's epilogue overlaps the other's mainloop, which the
//      cooperative kernel's fp32 stores do not)
//   5: FP8, tile 128x128x128, cooperative, cluster 2x1x1 (TMA multicast of B: two M tiles share each weight tile), bf16 D
//   6: as 5 with an fp32 D
//   7: FP8, tile  64x128x128, pingpong, cluster 2x1x1, fp32 D
//   8: as 7 with a bf16 D
//   9: bf16, tile 128x256x64, KernelPtrArrayTmaWarpSpecializedCooperative, cluster 1x1x1, bf16 D
//  10: bf16, tile  64x256x64, KernelPtrArrayTmaWarpSpecializedPingpong,    cluster 1x1x1, bf16 D
//  11: bf16, tile 128x256x64, cooperative, cluster 2x1x1, bf16 D
//  12: bf16, tile 128x128x64, cooperative, cluster 1x1x1, bf16 D
//  13: as 9 with the SwiGLU epilogue: D = silu(gate) * up, bf16 [M_g, N/2] (see SwigluEpilogueArray)
//  14: as 10 with the SwiGLU epilogue
// (bf16 tiles: a probe found 128x256 and 64x256 6-21% faster than DeepGEMM's bf16 kernels on ~256-row experts;
// 128x128 is there for narrow N.)
//
// Per-group CUTLASS stride/layout arrays are built ON DEVICE by a tiny kernel (one thread per group) from
// problem_sizes_dev, inside the caller-provided workspace, on the caller's stream: nothing syncs to the host.
// Pass flags bit 0 (MOE_CUTLASS_FLAG_REUSE_META) to skip that kernel when the SAME workspace was used by the
// previous call with the same num_groups, same variant and the same N,K per group (strides depend on N,K
// only; M is read by CUTLASS from problem_sizes_dev directly).
//
// Requirements / limitations:
//   * K % 16 == 0 and N % 8 == 0 (16-byte TMA row alignment for e4m3 / bf16 A/B and bf16 D);
//     K and N need NOT be multiples of the tile (scale tensors use ceil_div; partial tiles are predicated).
//   * every A/B/D pointer 16-byte aligned; scale pointers 4-byte aligned.
//   * M_g may be 0 (group is skipped; its pointers are never dereferenced).
//   * problem_sizes_dev: int32 [G, 3] = (M, N, K) per group, device memory, must stay valid until the
//     kernel has run (stream order).  Pointer arrays: device arrays of G 64-bit pointers.
//   * Accumulation fp32; FP8 scales applied per 128-K block in fp32 ("software" promotion).
//
// Build: moe_plugin_cuda.cutlass.lib compiles one object per variant (-DMOE_VARIANT_MASK=<bit> -DMOE_NO_API)
// + one API object (-DMOE_VARIANT_MASK=0), -fvisibility=hidden, and links them with a static cudart and
// -Xlinker --exclude-libs,ALL -Bsymbolic, so only moe_* is exported and this library's cudart calls can never
// bind to another copy of cudart loaded in the process (e.g. torch's). ~1-2 min per object on one core.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <string>
#include <cuda_runtime.h>
#include "cutlass/version.h"

#ifndef MOE_VARIANT_MASK
#define MOE_VARIANT_MASK 0x7FFF
#endif

#define MOE_NUM_VARIANTS 15
#define MOE_API __attribute__((visibility("default")))
#define MOE_CUTLASS_FLAG_REUSE_META 1

// Internal per-variant entry points (C linkage so separately-compiled objects link without name issues).
#define MOE_RUN_ARGS                                                                                      \
  int, const int*, const int*, const void* const*, const void* const*, void* const*, const float* const*, \
      const float* const*, void*, size_t, cudaStream_t, int, char*, size_t
#define MOE_DECLARE_VARIANT(k)            \
  int moe_cutlass_run_v##k(MOE_RUN_ARGS);   \
  size_t moe_cutlass_ws_v##k(int, int);
extern "C" {
typedef int (*moe_cutlass_run_fn)(MOE_RUN_ARGS);
typedef size_t (*moe_cutlass_ws_fn)(int, int);
MOE_DECLARE_VARIANT(0)
MOE_DECLARE_VARIANT(1)
MOE_DECLARE_VARIANT(2)
MOE_DECLARE_VARIANT(3)
MOE_DECLARE_VARIANT(4)
MOE_DECLARE_VARIANT(5)
MOE_DECLARE_VARIANT(6)
MOE_DECLARE_VARIANT(7)
MOE_DECLARE_VARIANT(8)
MOE_DECLARE_VARIANT(9)
MOE_DECLARE_VARIANT(10)
MOE_DECLARE_VARIANT(11)
MOE_DECLARE_VARIANT(12)
MOE_DECLARE_VARIANT(13)
MOE_DECLARE_VARIANT(14)
}

#if MOE_VARIANT_MASK != 0

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/default_epilogue_array.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

using namespace cute;

namespace moe_cutlass {

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // <M,N,K> per group

// SwiGLU epilogue (bf16 GEMM1 over gate/up-interleaved weights: B row 2j = gate j, row 2j+1 = up j, as
// moe-plugin-cuda keeps bf16 w13): D[m, j] = silu(acc[m, 2j]) * acc[m, 2j+1] in fp32, written as bf16 to a
// row-major [M_g, N/2] D. Why: the separate pass read GEMM1's [M, N] output back and wrote h, and rounded gate
// and up to bf16 before the product. wgmma's accumulator fragment (PTX m64nNk16 D layout) holds register
// 4j + 2r + e of a thread at row 8r + lane/4 and column 8j + 2(lane%4) + e: a gate and its up are registers
// i and i + 1 of one thread, so the product needs no data movement. Each thread then has one output per
// 8 columns of two rows; a 4x4 transpose within each quad of lanes and an exchange of rows between lane
// pairs (shuffles) give it 8 adjacent outputs of one row, stored as 16 bytes: whole 32-byte sectors (the first
// version stored 4-byte pieces and moved twice the DRAM bytes of the TMA-epilogue kernel: docs/decisions.md,
// "The CUDA plugin's measured defaults"). Stores go straight from registers (the NoSmem epilogue: no smem carve-out, the mainloop keeps
// its stages); rows past M_g (the next expert's, rows are packed) and columns past N are never written.
CUTLASS_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  const cutlass::bfloat16_t a(lo), b(hi);
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

template <class ElementD_, class StrideD_>
class SwigluEpilogueArray
    : public cutlass::epilogue::collective::DefaultEpilogueArray<
          void, StrideD_, StrideD_,
          cutlass::epilogue::thread::LinearCombination<ElementD_, 1, float, float,
                                                       cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling,
                                                       cutlass::FloatRoundStyle::round_to_nearest, ElementD_>,
          cutlass::epilogue::PtrArrayNoSmemWarpSpecialized> {
 public:
  using Base = cutlass::epilogue::collective::DefaultEpilogueArray<
      void, StrideD_, StrideD_,
      cutlass::epilogue::thread::LinearCombination<ElementD_, 1, float, float,
                                                   cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling,
                                                   cutlass::FloatRoundStyle::round_to_nearest, ElementD_>,
      cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>;
  CUTLASS_HOST_DEVICE SwigluEpilogueArray(typename Base::Params const& params) : Base(params), ptr_d_(params.ptr_D) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kJ = size(FrgLayout{}) / 4;  // 8-column blocks per thread
    // the fragment as described above, one wgmma atom per thread (a layout change fails here, not in the numbers)
    static_assert(std::is_same_v<FrgLayout, Layout<Shape<Shape<_2, _2, Int<kJ>>, _1, _1>,
                                                   Stride<Stride<_1, _2, _4>, _0, _0>>>,
                  "unexpected accumulator layout for the SwiGLU epilogue");
    static_assert(kJ % 4 == 0, "whole quads of 8-column blocks");
    static_assert(std::is_same_v<ElementD_, cutlass::bfloat16_t>, "bf16 h (packed in pairs)");
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    // each accumulator's (row, column) in the group's M x N output
    auto tile = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto coords = thr_mma.partition_C(tile);
    const int q = thread_idx % 4;                     // lane within its quad
    const int n_base = get<1>(coords(0)) - 2 * q;     // the tile's first column
    const int m0 = get<0>(coords(0)), m1 = get<0>(coords(2));  // this lane's rows (8 apart)
    const bool odd = q & 1;
    const int m = odd ? m1 : m0;  // the row this lane stores, after the exchange below
    ElementD_* out = ptr_d_[l_coord];
    const int64_t ld = N / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int jb = 0; jb < kJ; jb += 4) {
      uint32_t packed[2][2];  // [row][pair]: this lane's 4 outputs of each row after the quad transpose, bf16x2
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        float v[4];  // outputs of 8-column blocks jb..jb+3 of row r: output column 4 * (jb + t) + q
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < 4; ++t) {
          const float g = acc(4 * (jb + t) + 2 * r), u = acc(4 * (jb + t) + 2 * r + 1);
          v[t] = __fdividef(g, 1.0f + __expf(-g)) * u;  // silu(g) * u (0 where exp overflows)
        }
        // 4x4 transpose within the quad: lane q gets block jb + q of every lane s, output columns 4 * (jb + q) + s
        float w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < 4; ++t) w[t] = v[t];
        CUTLASS_PRAGMA_UNROLL
        for (int x = 1; x < 4; ++x) {
          const int p = q ^ x;
          const float send = p == 0 ? v[0] : p == 1 ? v[1] : p == 2 ? v[2] : v[3];
          const float got = __shfl_xor_sync(0xffffffffu, send, x);
          CUTLASS_PRAGMA_UNROLL
          for (int t = 0; t < 4; ++t) w[t] = t == p ? got : w[t];
        }
        const float mine = q == 0 ? v[0] : q == 1 ? v[1] : q == 2 ? v[2] : v[3];
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < 4; ++t) w[t] = t == q ? mine : w[t];
        packed[r][0] = pack_bf16x2(w[0], w[1]);
        packed[r][1] = pack_bf16x2(w[2], w[3]);
      }
      // lanes q and q ^ 1 hold adjacent 4-output chunks of both rows: the even lane takes row m0's 8 outputs,
      // the odd one row m1's, so each lane stores 16 contiguous bytes (a lane pair a whole 32-byte sector)
      const uint32_t s0 = __shfl_xor_sync(0xffffffffu, odd ? packed[0][0] : packed[1][0], 1);
      const uint32_t s1 = __shfl_xor_sync(0xffffffffu, odd ? packed[0][1] : packed[1][1], 1);
      const uint4 chunk = odd ? make_uint4(s0, s1, packed[1][0], packed[1][1])
                              : make_uint4(packed[0][0], packed[0][1], s0, s1);
      const int col = n_base / 2 + 4 * (jb + (q & ~1));  // 8 outputs from here: input columns 2 * col .. + 15
      if (m < M && 2 * col < N) {
        *reinterpret_cast<uint4*>(out + m * ld + col) = chunk;
      }
    }
  }

 private:
  ElementD_** ptr_d_;  // (the base's params are private)
};

// kSwiglu_: GEMM1's SwiGLU epilogue (bf16 operands only) in place of CUTLASS's TMA epilogue
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_, class ElementAB_,
          class ElementD_, bool kSwiglu_ = false>
struct Config {
  // FP8 operands carry block scales (the mainloop reads SFA/SFB), bf16 ones none
  static constexpr bool kBlockScaled = std::is_same_v<ElementAB_, cutlass::float_e4m3_t>;
  using ElementA = ElementAB_;
  using ElementB = ElementAB_;
  using ElementC = void;                    // no C operand
  using ElementD = ElementD_;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;     // A [M,K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // B as (N,K) with K contiguous == weight row-major [N,K]
  using LayoutD = cutlass::layout::RowMajor;     // D [M,N]
  static constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using ArchTag = cutlass::arch::Sm90;
  using OperatorClass = cutlass::arch::OpClassTensorOp;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  static constexpr auto RoundStyle = cutlass::FloatRoundStyle::round_to_nearest;
  // D = acc (converted to bf16); C never loaded.
  using FusionOp = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, ElementAccumulator,
                                             RoundStyle>,
      cutlass::epilogue::fusion::Sm90AccFetch>;

  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OperatorClass, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator, ElementC, LayoutD*, AlignmentD, ElementD, LayoutD*, AlignmentD,
      EpilogueSchedule_, FusionOp>::CollectiveOp;
  static_assert(!kSwiglu_ || (!kBlockScaled && std::is_same_v<ElementD_, cutlass::bfloat16_t>),
                "the SwiGLU epilogue is for bf16 GEMM1s");
  using CollectiveEpilogue = std::conditional_t<
      kSwiglu_,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
          SwigluEpilogueArray<ElementD, cutlass::detail::TagToStrideC_t<LayoutD*>>>,
      BuiltEpilogue>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OperatorClass, ElementA,
      std::conditional_t<kBlockScaled, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>, AlignmentA, ElementB,
      std::conditional_t<kBlockScaled, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>, AlignmentB, ElementAccumulator,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

static inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

template <class Cfg>
struct Meta {
  // layout of the metadata region at the start of the workspace
  static size_t off_sa(int) { return 0; }
  static size_t off_sb(int G) { return align_up(off_sa(G) + sizeof(typename Cfg::StrideA) * G, 256); }
  static size_t off_sd(int G) { return align_up(off_sb(G) + sizeof(typename Cfg::StrideB) * G, 256); }
  static size_t off_lsfa(int G) { return align_up(off_sd(G) + sizeof(typename Cfg::StrideD) * G, 256); }
  static size_t off_lsfb(int G) { return align_up(off_lsfa(G) + sizeof(typename Cfg::LayoutSFA) * G, 256); }
  static size_t bytes(int G) { return align_up(off_lsfb(G) + sizeof(typename Cfg::LayoutSFB) * G, 256); }
};

template <class Cfg>
__global__ void build_meta_kernel(int G, const int* __restrict__ ps, typename Cfg::StrideA* sa,
                                  typename Cfg::StrideB* sb, typename Cfg::StrideD* sd,
                                  typename Cfg::LayoutSFA* lsfa, typename Cfg::LayoutSFB* lsfb) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G) return;
  int M = ps[3 * i + 0], N = ps[3 * i + 1], K = ps[3 * i + 2];
  typename Cfg::StrideA a{};
  typename Cfg::StrideB b{};
  typename Cfg::StrideD d{};
  cute::get<0>(a) = static_cast<int64_t>(K);  // A (M,K,L): stride (K, 1, 0)
  cute::get<0>(b) = static_cast<int64_t>(K);  // B (N,K,L): stride (K, 1, 0)
  cute::get<0>(d) = static_cast<int64_t>(N);  // D (M,N,L): stride (N, 1, 0)
  sa[i] = a;
  sb[i] = b;
  sd[i] = d;
  // Not read by the CUTLASS 4.2 sm90 ptr-array blockwise mainloop (it rebuilds the layouts from the
  // problem shape), but filled for completeness / newer CUTLASS versions.
  lsfa[i] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(M, N, K, 1));
  lsfb[i] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(M, N, K, 1));
}

static int sm_count_cached() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (cached[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cached[dev] = n;
  }
  return cached[dev];
}

template <class Cfg>
typename Cfg::Gemm::Arguments make_args(int G, const int* ps_dev, const int* ps_host, const void* const* a,
                                        const void* const* b, void* const* d, const float* const* sfa,
                                        const float* const* sfb, uint8_t* meta) {
  using Gemm = typename Cfg::Gemm;
  using UPS = typename ProblemShape::UnderlyingProblemShape;
  using M = Meta<Cfg>;
  auto* sa = reinterpret_cast<typename Cfg::StrideA*>(meta + M::off_sa(G));
  auto* sb = reinterpret_cast<typename Cfg::StrideB*>(meta + M::off_sb(G));
  auto* sd = reinterpret_cast<typename Cfg::StrideD*>(meta + M::off_sd(G));
  auto* lsfa = reinterpret_cast<typename Cfg::LayoutSFA*>(meta + M::off_lsfa(G));
  auto* lsfb = reinterpret_cast<typename Cfg::LayoutSFB*>(meta + M::off_lsfb(G));

  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count_cached();

  [[maybe_unused]] auto* a_ptrs = reinterpret_cast<const typename Cfg::ElementA**>(const_cast<const void**>(a));
  [[maybe_unused]] auto* b_ptrs = reinterpret_cast<const typename Cfg::ElementB**>(const_cast<const void**>(b));
  typename Gemm::GemmKernel::MainloopArguments mainloop;
  if constexpr (Cfg::kBlockScaled) {
    mainloop = {a_ptrs, sa, b_ptrs, sb, const_cast<const float**>(sfa), lsfa, const_cast<const float**>(sfb), lsfb};
  } else {
    mainloop = {a_ptrs, sa, b_ptrs, sb};
  }
  typename Gemm::GemmKernel::EpilogueArguments epilogue{
      {}, nullptr, sd, reinterpret_cast<typename Cfg::ElementD**>(const_cast<void**>(d)), sd};

  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {G, reinterpret_cast<UPS*>(const_cast<int*>(ps_dev)),
                                 reinterpret_cast<UPS const*>(ps_host)},
                                mainloop,
                                epilogue,
                                hw};
  return args;
}

template <class Cfg>
size_t workspace_size(int G) {
  using Gemm = typename Cfg::Gemm;
  auto args = make_args<Cfg>(G, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
  size_t cutlass_ws = Gemm::get_workspace_size(args);
  return Meta<Cfg>::bytes(G) + align_up(cutlass_ws, 256) + 256;
}

static void set_err(char* err, size_t n, const char* what, const char* detail) {
  if (err && n) snprintf(err, n, "%s%s%s", what, detail ? ": " : "", detail ? detail : "");
}

template <class Cfg>
int run(int G, const int* ps_dev, const int* ps_host, const void* const* a, const void* const* b, void* const* d,
        const float* const* sfa, const float* const* sfb, void* workspace, size_t ws_bytes, cudaStream_t stream,
        int flags, char* err, size_t errn) {
  using Gemm = typename Cfg::Gemm;
  if (G <= 0) return 0;
  size_t need = workspace_size<Cfg>(G);
  if (ws_bytes < need || workspace == nullptr) {
    char buf[128];
    snprintf(buf, sizeof(buf), "need %zu bytes, got %zu", need, ws_bytes);
    set_err(err, errn, "workspace too small", buf);
    return 2;
  }
  uint8_t* base = reinterpret_cast<uint8_t*>(align_up(reinterpret_cast<uintptr_t>(workspace), 256));
  uint8_t* meta = base;
  uint8_t* cutlass_ws = base + Meta<Cfg>::bytes(G);

  if (!(flags & MOE_CUTLASS_FLAG_REUSE_META)) {
    using M = Meta<Cfg>;
    int threads = 128, blocks = (G + threads - 1) / threads;
    build_meta_kernel<Cfg><<<blocks, threads, 0, stream>>>(
        G, ps_dev, reinterpret_cast<typename Cfg::StrideA*>(meta + M::off_sa(G)),
        reinterpret_cast<typename Cfg::StrideB*>(meta + M::off_sb(G)),
        reinterpret_cast<typename Cfg::StrideD*>(meta + M::off_sd(G)),
        reinterpret_cast<typename Cfg::LayoutSFA*>(meta + M::off_lsfa(G)),
        reinterpret_cast<typename Cfg::LayoutSFB*>(meta + M::off_lsfb(G)));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      set_err(err, errn, "build_meta_kernel launch failed", cudaGetErrorString(e));
      return 3;
    }
  }

  auto args = make_args<Cfg>(G, ps_dev, ps_host, a, b, d, sfa, sfb, meta);
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    set_err(err, errn, "can_implement failed", cutlassGetStatusString(st));
    return 4;
  }
  st = gemm.initialize(args, cutlass_ws, stream);
  if (st != cutlass::Status::kSuccess) {
    set_err(err, errn, "initialize failed", cutlassGetStatusString(st));
    return 5;
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    set_err(err, errn, "run failed", e != cudaSuccess ? cudaGetErrorString(e) : cutlassGetStatusString(st));
    return 6;
  }
  return 0;
}

using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using Ping = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
using CoopBf16 = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using PingBf16 = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using E4M3 = cutlass::float_e4m3_t;
using Bf16 = cutlass::bfloat16_t;
using EpiCoop = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// moe-plugin-cuda runs an fp32-D variant for GEMM1 (its output is quantized again after the activation, as the
// reference does: a bf16 rounding first could flip FP8 codes) and a bf16-D one for GEMM2; which ones, per T, is
// in its tuned table (default 1 and 0)
using Cfg0 = Config<Shape<_128, _128, _128>, Shape<_1, _1, _1>, Coop, EpiCoop, E4M3, Bf16>;
using Cfg1 = Config<Shape<_128, _128, _128>, Shape<_1, _1, _1>, Coop, EpiCoop, E4M3, float>;
using Cfg2 = Config<Shape<_64, _128, _128>, Shape<_1, _1, _1>, Ping, EpiPing, E4M3, Bf16>;
using Cfg3 = Config<Shape<_128, _128, _128>, Shape<_1, _2, _1>, Coop, EpiCoop, E4M3, Bf16>;
using Cfg4 = Config<Shape<_64, _128, _128>, Shape<_1, _1, _1>, Ping, EpiPing, E4M3, float>;
using Cfg5 = Config<Shape<_128, _128, _128>, Shape<_2, _1, _1>, Coop, EpiCoop, E4M3, Bf16>;
using Cfg6 = Config<Shape<_128, _128, _128>, Shape<_2, _1, _1>, Coop, EpiCoop, E4M3, float>;
using Cfg7 = Config<Shape<_64, _128, _128>, Shape<_2, _1, _1>, Ping, EpiPing, E4M3, float>;
using Cfg8 = Config<Shape<_64, _128, _128>, Shape<_2, _1, _1>, Ping, EpiPing, E4M3, Bf16>;
// bf16 (no scales): K tile 64, the same bytes per stage as FP8's 128
using Cfg9 = Config<Shape<_128, _256, _64>, Shape<_1, _1, _1>, CoopBf16, EpiCoop, Bf16, Bf16>;
using Cfg10 = Config<Shape<_64, _256, _64>, Shape<_1, _1, _1>, PingBf16, EpiPing, Bf16, Bf16>;
using Cfg11 = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, CoopBf16, EpiCoop, Bf16, Bf16>;
using Cfg12 = Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>, CoopBf16, EpiCoop, Bf16, Bf16>;
// bf16 GEMM1 with the SwiGLU epilogue: D = silu(gate) * up, [M, N/2]
using Cfg13 = Config<Shape<_128, _256, _64>, Shape<_1, _1, _1>, CoopBf16, EpiCoop, Bf16, Bf16, true>;
using Cfg14 = Config<Shape<_64, _256, _64>, Shape<_1, _1, _1>, PingBf16, EpiPing, Bf16, Bf16, true>;

}  // namespace moe_cutlass

#define MOE_DEFINE_VARIANT(k)                                                                                  \
  extern "C" int moe_cutlass_run_v##k(int G, const int* ps_dev, const int* ps_host, const void* const* a,       \
                                    const void* const* b, void* const* d, const float* const* sfa,            \
                                    const float* const* sfb, void* ws, size_t wsb, cudaStream_t s, int flags, \
                                    char* err, size_t errn) {                                                 \
    return moe_cutlass::run<moe_cutlass::Cfg##k>(G, ps_dev, ps_host, a, b, d, sfa, sfb, ws, wsb, s, flags, err,   \
                                             errn);                                                           \
  }                                                                                                           \
  extern "C" size_t moe_cutlass_ws_v##k(int G, int) { return moe_cutlass::workspace_size<moe_cutlass::Cfg##k>(G); }

#if (MOE_VARIANT_MASK & 1)
MOE_DEFINE_VARIANT(0)
#endif
#if (MOE_VARIANT_MASK & 2)
MOE_DEFINE_VARIANT(1)
#endif
#if (MOE_VARIANT_MASK & 4)
MOE_DEFINE_VARIANT(2)
#endif
#if (MOE_VARIANT_MASK & 8)
MOE_DEFINE_VARIANT(3)
#endif
#if (MOE_VARIANT_MASK & 16)
MOE_DEFINE_VARIANT(4)
#endif
#if (MOE_VARIANT_MASK & 32)
MOE_DEFINE_VARIANT(5)
#endif
#if (MOE_VARIANT_MASK & 64)
MOE_DEFINE_VARIANT(6)
#endif
#if (MOE_VARIANT_MASK & 128)
MOE_DEFINE_VARIANT(7)
#endif
#if (MOE_VARIANT_MASK & 256)
MOE_DEFINE_VARIANT(8)
#endif
#if (MOE_VARIANT_MASK & 512)
MOE_DEFINE_VARIANT(9)
#endif
#if (MOE_VARIANT_MASK & 1024)
MOE_DEFINE_VARIANT(10)
#endif
#if (MOE_VARIANT_MASK & 2048)
MOE_DEFINE_VARIANT(11)
#endif
#if (MOE_VARIANT_MASK & 4096)
MOE_DEFINE_VARIANT(12)
#endif
#if (MOE_VARIANT_MASK & 8192)
MOE_DEFINE_VARIANT(13)
#endif
#if (MOE_VARIANT_MASK & 16384)
MOE_DEFINE_VARIANT(14)
#endif

#endif  // MOE_VARIANT_MASK != 0

// ------------------------------------------------------------------------------------------------
// Public C ABI
// ------------------------------------------------------------------------------------------------
#ifndef MOE_NO_API

static thread_local char g_last_error[512] = "";

static const char* kVariantNames[MOE_NUM_VARIANTS] = {
    "v0_coop_128x128x128_c1x1_bf16out",
    "v1_coop_128x128x128_c1x1_fp32out",
    "v2_ping_64x128x128_c1x1_bf16out",
    "v3_coop_128x128x128_c1x2_bf16out",
    "v4_ping_64x128x128_c1x1_fp32out",
    "v5_coop_128x128x128_c2x1_bf16out",
    "v6_coop_128x128x128_c2x1_fp32out",
    "v7_ping_64x128x128_c2x1_fp32out",
    "v8_ping_64x128x128_c2x1_bf16out",
    "v9_bf16_coop_128x256x64_c1x1_bf16out",
    "v10_bf16_ping_64x256x64_c1x1_bf16out",
    "v11_bf16_coop_128x256x64_c2x1_bf16out",
    "v12_bf16_coop_128x128x64_c1x1_bf16out",
    "v13_bf16_coop_128x256x64_c1x1_swigluout",
    "v14_bf16_ping_64x256x64_c1x1_swigluout",
};

static moe_cutlass_run_fn run_fns[MOE_NUM_VARIANTS] = {moe_cutlass_run_v0, moe_cutlass_run_v1, moe_cutlass_run_v2,
                                                     moe_cutlass_run_v3, moe_cutlass_run_v4, moe_cutlass_run_v5,
                                                     moe_cutlass_run_v6, moe_cutlass_run_v7, moe_cutlass_run_v8,
                                                     moe_cutlass_run_v9, moe_cutlass_run_v10, moe_cutlass_run_v11,
                                                     moe_cutlass_run_v12, moe_cutlass_run_v13, moe_cutlass_run_v14};
static moe_cutlass_ws_fn ws_fns[MOE_NUM_VARIANTS] = {moe_cutlass_ws_v0, moe_cutlass_ws_v1, moe_cutlass_ws_v2,
                                                   moe_cutlass_ws_v3, moe_cutlass_ws_v4, moe_cutlass_ws_v5,
                                                   moe_cutlass_ws_v6, moe_cutlass_ws_v7, moe_cutlass_ws_v8,
                                                   moe_cutlass_ws_v9, moe_cutlass_ws_v10, moe_cutlass_ws_v11,
                                                   moe_cutlass_ws_v12, moe_cutlass_ws_v13, moe_cutlass_ws_v14};

extern "C" {

MOE_API int moe_cutlass_num_variants() { return MOE_NUM_VARIANTS; }

MOE_API const char* moe_cutlass_variant_name(int variant) {
  return (variant >= 0 && variant < MOE_NUM_VARIANTS) ? kVariantNames[variant] : "invalid";
}

MOE_API const char* moe_cutlass_last_error() { return g_last_error; }

// Workspace bytes for `num_groups` groups on the CURRENT device (depends on its SM count); 0 on error.
MOE_API size_t moe_cutlass_workspace_size(int num_groups, int variant) {
  if (variant < 0 || variant >= MOE_NUM_VARIANTS) {
    snprintf(g_last_error, sizeof(g_last_error), "invalid variant %d", variant);
    return 0;
  }
  return ws_fns[variant](num_groups < 1 ? 1 : num_groups, 0);
}

// Returns 0 on success, non-zero on error (message via moe_cutlass_last_error()).
// The launch is asynchronous on `stream`; errors inside the kernel surface at the next sync.
MOE_API int moe_cutlass_grouped_gemm(int num_groups, const int* problem_sizes_dev,
                                   const int* problem_sizes_host_or_null, const void* const* a_ptrs_dev,
                                   const void* const* b_ptrs_dev, void* const* d_ptrs_dev,
                                   const float* const* sfa_ptrs_dev, const float* const* sfb_ptrs_dev,
                                   void* workspace, size_t workspace_bytes, void* stream, int variant, int flags) {
  g_last_error[0] = 0;
  if (variant < 0 || variant >= MOE_NUM_VARIANTS) {
    snprintf(g_last_error, sizeof(g_last_error), "invalid variant %d", variant);
    return 1;
  }
  return run_fns[variant](num_groups, problem_sizes_dev, problem_sizes_host_or_null, a_ptrs_dev, b_ptrs_dev,
                          d_ptrs_dev, sfa_ptrs_dev, sfb_ptrs_dev, workspace, workspace_bytes,
                          reinterpret_cast<cudaStream_t>(stream), flags, g_last_error, sizeof(g_last_error));
}

MOE_API const char* moe_cutlass_build_info() {
  static char buf[256];
  snprintf(buf, sizeof(buf), "nvcc %d.%d, CUTLASS %d.%d.%d, sm_90a", __CUDACC_VER_MAJOR__, __CUDACC_VER_MINOR__,
           CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH);
  return buf;
}

}  // extern "C"
#endif  // MOE_NO_API
