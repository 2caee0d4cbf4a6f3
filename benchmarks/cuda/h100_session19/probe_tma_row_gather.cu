// probe_tma_row_gather.cu -- can Hopper's TMA gather GEMM1's A rows (one 2-D box of 1 row x 64 bf16 per row)
// into the same 128B-swizzled shared-memory tile that one 128-row box writes, and at what bandwidth?
//
// Why: the cutlass backend copies the routed rows of x into expert order before GEMM1 (the "gather" pass,
// ~55 us at qwen3-30b T=4096, ~108 us at qwen3-235b T=4096 on the H100). CUTLASS's SM90 ptr-array mainloop
// loads A with one TMA box per stage; a producer that issues one box per row, at the rows' token indices,
// would remove the pass -- if the swizzle comes out the same and the TMA unit keeps up.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe probe_tma_row_gather.cu && ./probe
//
// Part 1 (layout): X [R, K] uint16 with X[r, k] = distinct values; idx = 128 random rows. Kernel A loads
// box {64, 128} at the top of G = X[idx] (gathered on the host); kernel B loads 128 boxes {64, 1} at rows
// idx[i] of X into smem + i*128 bytes. Both tiles are copied out and compared byte for byte.
// Part 2 (bandwidth): every CTA streams tiles of 128 rows x 64 columns (16 KB) through a 4-stage ring, either as
// one box of 128 consecutive rows or as 128 single-row boxes at random rows, issued by one warp (4 rows a lane) or
// by the CTA's 4 warps (one row a thread), or by cp.async from 4 warps (8 pieces of 16 bytes a thread: one row a
// thread, or 8 adjacent threads a row as Triton and CUTLASS lay out their copies) (each CTA keeps its 128 rows for
// 32 tiles, walking 2048 columns, as a GEMM1 M-tile walks K), over a 1 GiB matrix; GB/s of tile bytes landed in
// shared memory, 1-3 CTAs per SM.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <random>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;

static CUtensorMap make_map(void* base, uint64_t rows, uint64_t cols, uint32_t box_rows) {
  CUtensorMap m;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {cols * 2};
  cuuint32_t box[2] = {64, box_rows};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, dims, strides, box, estr,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("encode failed %d\n", (int)r); exit(1); }
  return m;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes));
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t phase) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               :: "r"(smem_u32(b)), "r"(phase));
}
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* m, int c0, int c1, uint64_t* b) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(smem_u32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(smem_u32(b)) : "memory");
}

// cp.async of one 16-byte piece; the barrier's arrive fires when this thread's earlier cp.asyncs have landed
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_u32(b)) : "memory");
}
// row r's 16-byte piece c of a 128-byte-wide tile, where the 128B swizzle puts it: piece c ^ (r % 8)
__device__ __forceinline__ uint8_t* swizzled(uint8_t* tile, int r, int c) { return tile + r * 128 + ((c ^ (r & 7)) << 4); }

// Part 1: one tile, either one 128-row box (gather=0, at row 0 of the map), 128 single-row boxes at idx[i] (1) or
// cp.async of rows idx[i] with the swizzle computed in software (2).
__global__ void load_tile(const __grid_constant__ CUtensorMap map, const int* idx, int gather, uint16_t* out,
                          const void* src_rows, int row_bytes) {
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t* tile = (uint8_t*)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) { mbar_init(&bar, gather == 2 ? 128 : 1); asm volatile("fence.proxy.async.shared::cta;"); }
  __syncthreads();
  if (gather == 2) {  // cp.async: thread r copies row idx[r]'s 8 pieces to their swizzled places (blockDim 128)
    const uint8_t* src = (const uint8_t*)src_rows + (size_t)idx[threadIdx.x] * row_bytes;
    for (int c = 0; c < 8; ++c) cp_async16(swizzled(tile, threadIdx.x, c), src + c * 16);
    cp_async_arrive(&bar);
  } else if (threadIdx.x == 0) mbar_expect(&bar, 128 * 128);
  __syncwarp();
  if (gather != 2 && threadIdx.x < 32) {
    if (gather) for (int i = threadIdx.x; i < 128; i += 32) tma_2d(tile + i * 128, &map, 0, idx[i], &bar);
    else if (threadIdx.x == 0) tma_2d(tile, &map, 0, 0, &bar);
  }
  mbar_wait(&bar, 0);
  for (int i = threadIdx.x; i < 128 * 64; i += blockDim.x) out[i] = ((uint16_t*)tile)[i];
}

// Part 2: stream `tiles` tiles per CTA through a 4-stage ring (loads only: no consumer math).
constexpr int STAGES = 4;
__global__ void stream_tiles(const __grid_constant__ CUtensorMap map, const int* rows, int tiles, int gather,
                             int total_rows, unsigned long long* sink, const void* src_base, int row_bytes) {
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t* ring = (uint8_t*)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  __shared__ uint64_t full[STAGES];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], gather >= 3 ? 128 : 1);
    asm volatile("fence.proxy.async.shared::cta;");
  }
  __syncthreads();
  unsigned long long acc = 0;
  auto issue = [&](int t) {
    int s = t % STAGES;
    uint8_t* tile = ring + s * 128 * 128;
    int col = (t % 32) * 64;  // walk K in 64-column steps (the map is 2048 columns wide)
    if (gather >= 3) {  // cp.async, 8 pieces of 16 bytes a thread
      const int base = (blockIdx.x * 7 + t / 32) * 128;
      if (gather == 3) {  // thread r copies all of row r (a warp's instruction touches 32 rows)
        const uint8_t* src = (const uint8_t*)src_base + (size_t)rows[(base + threadIdx.x) % total_rows] * row_bytes + col * 2;
        for (int c = 0; c < 8; ++c) cp_async16(swizzled(tile, threadIdx.x, c), src + c * 16);
      } else {  // 8 adjacent threads copy one row's 128 bytes (a warp's instruction: 4 whole rows)
        const int c = threadIdx.x & 7;
        for (int j = 0; j < 8; ++j) {
          const int r = (threadIdx.x >> 3) + 16 * j;
          cp_async16(swizzled(tile, r, c), (const uint8_t*)src_base + (size_t)rows[(base + r) % total_rows] * row_bytes + col * 2 + c * 16);
        }
      }
      cp_async_arrive(&full[s]);
      return;
    }
    if (threadIdx.x == 0) mbar_expect(&full[s], 128 * 128);
    if (gather == 2) {  // every thread of the CTA (4 warps) issues one row's box
      tma_2d(tile + threadIdx.x * 128, &map, col, rows[((blockIdx.x * 7 + t / 32) * 128 + threadIdx.x) % total_rows], &full[s]);
      return;
    }
    __syncwarp();
    if (gather) {
      // the same 128 rows for 32 tiles (a GEMM1 M-tile walking K), as the box case below
      for (int i = threadIdx.x; i < 128; i += 32)
        tma_2d(tile + i * 128, &map, col, rows[((blockIdx.x * 7 + t / 32) * 128 + i) % total_rows], &full[s]);
    } else if (threadIdx.x == 0) {
      tma_2d(tile, &map, col, ((blockIdx.x * 7 + t / 32) * 128) % (total_rows - 128), &full[s]);
    }
  };
  const bool issuer = gather >= 2 || threadIdx.x < 32;
  if (issuer) for (int t = 0; t < STAGES - 1 && t < tiles; ++t) issue(t);
  for (int t = 0; t < tiles; ++t) {
    if (issuer && t + STAGES - 1 < tiles) issue(t + STAGES - 1);  // the slot freed last iteration
    mbar_wait(&full[t % STAGES], (t / STAGES) & 1);
    acc += ring[(t % STAGES) * 128 * 128 + threadIdx.x * 4];
    __syncthreads();  // every warp is done with this slot before warp 0 refills it
  }
  if (threadIdx.x == 0) atomicAdd(sink, acc);
}

int main() {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&encode, cudaEnableDefault, &q));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, sms);

  // ---- part 1
  const int R = 4096, K = 128;
  std::vector<uint16_t> X(R * K), G(128 * K);
  for (int r = 0; r < R; ++r) for (int k = 0; k < K; ++k) X[r * K + k] = (uint16_t)((r * 131 + k * 7 + 1) & 0xffff);
  std::mt19937 rng(1234);
  std::vector<int> idx(128);
  for (int i = 0; i < 128; ++i) idx[i] = rng() % R;
  for (int i = 0; i < 128; ++i) for (int k = 0; k < K; ++k) G[i * K + k] = X[idx[i] * K + k];
  uint16_t *dX, *dG, *o1, *o2; int* dIdx;
  CK(cudaMalloc(&dX, X.size() * 2)); CK(cudaMalloc(&dG, G.size() * 2));
  CK(cudaMalloc(&o1, 128 * 64 * 2)); CK(cudaMalloc(&o2, 128 * 64 * 2)); CK(cudaMalloc(&dIdx, 128 * 4));
  CK(cudaMemcpy(dX, X.data(), X.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dG, G.data(), G.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dIdx, idx.data(), 128 * 4, cudaMemcpyHostToDevice));
  CUtensorMap mG = make_map(dG, 128, K, 128), mX = make_map(dX, R, K, 1);
  size_t smem1 = 128 * 128 + 1024;
  uint16_t* o3; CK(cudaMalloc(&o3, 128 * 64 * 2));
  load_tile<<<1, 128, smem1>>>(mG, dIdx, 0, o1, nullptr, 0);
  load_tile<<<1, 128, smem1>>>(mX, dIdx, 1, o2, nullptr, 0);
  load_tile<<<1, 128, smem1>>>(mX, dIdx, 2, o3, dX, K * 2);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> h1(128 * 64), h2(128 * 64), h3(128 * 64);
  CK(cudaMemcpy(h1.data(), o1, h1.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h2.data(), o2, h2.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h3.data(), o3, h3.size() * 2, cudaMemcpyDeviceToHost));
  int diff = 0, diff_cp = 0, swizzled = 0;
  for (int i = 0; i < 128 * 64; ++i) diff += h1[i] != h2[i];
  for (int i = 0; i < 128 * 64; ++i) diff_cp += h1[i] != h3[i];
  printf("layout: %d of %d elements differ between one 128-row box and cp.async rows with the swizzle in software\n",
         diff_cp, 128 * 64);
  for (int r = 0; r < 128; ++r) swizzled += h1[r * 64] != G[r * K];  // row r's first 8 elements moved (r % 8 != 0)
  printf("layout: %d of %d elements differ between one 128-row box and 128 single-row boxes "
         "(the box tile is swizzled in %d of 128 rows: the 128B pattern moves 7 of every 8)\n", diff, 128 * 64, swizzled);

  // ---- part 2
  const int RB = 262144, KB = 2048;  // 1 GiB of bf16: far past L2
  uint16_t* dB; CK(cudaMalloc(&dB, (size_t)RB * KB * 2)); CK(cudaMemset(dB, 1, (size_t)RB * KB * 2));
  std::vector<int> rows(RB);
  for (int i = 0; i < RB; ++i) rows[i] = rng() % RB;
  int* dRows; CK(cudaMalloc(&dRows, RB * 4)); CK(cudaMemcpy(dRows, rows.data(), RB * 4, cudaMemcpyHostToDevice));
  unsigned long long* sink; CK(cudaMalloc(&sink, 8));
  CUtensorMap mBox = make_map(dB, RB, KB, 128), mRow = make_map(dB, RB, KB, 1);
  size_t smem2 = STAGES * 128 * 128 + 1024;
  CK(cudaFuncSetAttribute(stream_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem2));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int ctas_per_sm : {1, 2, 3}) {
    for (int gather : {0, 1, 2, 3, 4}) {
      int tiles = 512, grid = sms * ctas_per_sm;
      stream_tiles<<<grid, 128, smem2>>>(gather ? mRow : mBox, dRows, 32, gather, RB, sink, dB, KB * 2);  // warm-up
      CK(cudaEventRecord(a));
      for (int rep = 0; rep < 5; ++rep)
        stream_tiles<<<grid, 128, smem2>>>(gather ? mRow : mBox, dRows, tiles, gather, RB, sink, dB, KB * 2);
      CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
      float ms; cudaEventElapsedTime(&ms, a, b);
      double bytes = 5.0 * grid * tiles * 128 * 128;
      printf("stream: %d CTA/SM, %-22s %8.1f GB/s (%.0f us per 5 x %d tiles/CTA)\n", ctas_per_sm,
             gather == 4 ? "cp.async, 8 lanes a row" : gather == 3 ? "cp.async, a lane a row"
                 : gather == 2 ? "rows, issued by 4 warps"
                 : gather ? "rows, issued by 1 warp" : "one 128-row box",
             bytes / ms / 1e6, ms * 1e3, tiles);
    }
  }
  return 0;
}
