// bf16_grouped_probe.cu -- a probe, not part of the plugin: CUTLASS 4.2 sm_90a ptr-array grouped GEMM in bf16
// (D[g] = A[g] @ B[g]^T, A row-major [M_g, K], B each expert's row-major [N, K], D bf16 [M_g, N], fp32
// accumulation), cooperative and ping-pong schedules, to test whether an epilogue-overlapped (ping-pong)
// grouped GEMM beats DeepGEMM's / Triton's bf16 GEMMs on ~256-row experts (session 14).
// One variant per build: nvcc ... -DVARIANT=k -o libbf16g_v<k>.so; C ABI moe_bf16g_run / moe_bf16g_ws.
//   0: coop 128x128x64  1: coop 128x256x64  2: ping 64x128x64  3: ping 64x256x64
//   4: coop 128x256x64 cluster 2x1 (B multicast)  5: ping 64x256x64 cluster 2x1
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

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

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using EpiCoop = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using EpiPing = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

#if VARIANT == 0
using TileShape = Shape<_128, _128, _64>; using Cluster = Shape<_1, _1, _1>; using KS = Coop; using ES = EpiCoop;
#elif VARIANT == 1
using TileShape = Shape<_128, _256, _64>; using Cluster = Shape<_1, _1, _1>; using KS = Coop; using ES = EpiCoop;
#elif VARIANT == 2
using TileShape = Shape<_64, _128, _64>; using Cluster = Shape<_1, _1, _1>; using KS = Ping; using ES = EpiPing;
#elif VARIANT == 3
using TileShape = Shape<_64, _256, _64>; using Cluster = Shape<_1, _1, _1>; using KS = Ping; using ES = EpiPing;
#elif VARIANT == 4
using TileShape = Shape<_128, _256, _64>; using Cluster = Shape<_2, _1, _1>; using KS = Coop; using ES = EpiCoop;
#else
using TileShape = Shape<_64, _256, _64>; using Cluster = Shape<_2, _1, _1>; using KS = Ping; using ES = EpiPing;
#endif

using Elem = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;  // (N, K), K contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int Align = 8;
using FusionOp = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Elem, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch>;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, Align, Elem, LayoutD*, Align, ES,
    FusionOp>::CollectiveOp;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, LayoutA*, Align, Elem, LayoutB*, Align, float, TileShape,
    Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KS>::CollectiveOp;
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;

__global__ void strides_kernel(int G, const int* ps, StrideA* sa, StrideB* sb, StrideD* sd) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G) return;
  StrideA a{}; StrideB b{}; StrideD d{};
  cute::get<0>(a) = static_cast<int64_t>(ps[3 * i + 2]);
  cute::get<0>(b) = static_cast<int64_t>(ps[3 * i + 2]);
  cute::get<0>(d) = static_cast<int64_t>(ps[3 * i + 1]);
  sa[i] = a; sb[i] = b; sd[i] = d;
}

static size_t up(size_t x) { return (x + 255) / 256 * 256; }

static Gemm::Arguments make_args(int G, const int* ps, const void* const* a, const void* const* b, void* const* d,
                                 uint8_t* meta) {
  auto* sa = reinterpret_cast<StrideA*>(meta);
  auto* sb = reinterpret_cast<StrideB*>(meta + up(sizeof(StrideA) * G));
  auto* sd = reinterpret_cast<StrideD*>(meta + up(sizeof(StrideA) * G) + up(sizeof(StrideB) * G));
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, hw.device_id);
  typename GemmKernel::MainloopArguments mainloop{reinterpret_cast<const Elem**>(const_cast<const void**>(a)), sa,
                                                  reinterpret_cast<const Elem**>(const_cast<const void**>(b)), sb};
  typename GemmKernel::EpilogueArguments epilogue{{}, nullptr, sd, reinterpret_cast<Elem**>(const_cast<void**>(d)), sd};
  using UPS = typename ProblemShape::UnderlyingProblemShape;
  return Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                         {G, reinterpret_cast<UPS*>(const_cast<int*>(ps)), nullptr}, mainloop, epilogue, hw};
}

static size_t meta_bytes(int G) { return up(sizeof(StrideA) * G) + up(sizeof(StrideB) * G) + up(sizeof(StrideD) * G); }

extern "C" __attribute__((visibility("default"))) size_t moe_bf16g_ws(int G) {
  auto args = make_args(G, nullptr, nullptr, nullptr, nullptr, nullptr);
  return meta_bytes(G) + up(Gemm::get_workspace_size(args)) + 256;
}

extern "C" __attribute__((visibility("default"))) int moe_bf16g_run(int G, const int* ps, const void* const* a,
                                                                   const void* const* b, void* const* d, void* ws,
                                                                   cudaStream_t stream) {
  uint8_t* meta = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ws) + 255) / 256 * 256);
  strides_kernel<<<(G + 127) / 128, 128, 0, stream>>>(
      G, ps, reinterpret_cast<StrideA*>(meta), reinterpret_cast<StrideB*>(meta + up(sizeof(StrideA) * G)),
      reinterpret_cast<StrideD*>(meta + up(sizeof(StrideA) * G) + up(sizeof(StrideB) * G)));
  auto args = make_args(G, ps, a, b, d, meta);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 4;
  if (gemm.initialize(args, meta + meta_bytes(G), stream) != cutlass::Status::kSuccess) return 5;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 6;
  return 0;
}
