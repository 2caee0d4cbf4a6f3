// Two c10 symbols that sgl-deep-gemm 0.2.5's prebuilt deep_gemm/_C.so imports from a newer torch than
// the device's 2.11 (where it fails with "undefined symbol: c10::cuda::CUDAErrorLogCapture()"), so that
// the probe can measure its MegaMoE kernel. Newer torch passes a capture of the CUDA driver's error log
// to c10_cuda_check_implementation; 2.11 has the same function without it: forward, drop the log.
// Loaded with RTLD_GLOBAL before `import deep_gemm`; a probe aid only, never part of the plugin.
#include <cstdint>
#include <cstring>

namespace c10::cuda {

// torch 2.11's own (libc10_cuda.so)
void c10_cuda_check_implementation(int32_t err, const char* filename, const char* function_name,
                                   LINE_T line_number, bool include_device_assertions);

struct CUDAErrorLogCapture {
  CUDAErrorLogCapture() noexcept;
  unsigned char state_[8];  // newer torch: a CUlogIterator (4 bytes) and an `enabled_` flag
};

CUDAErrorLogCapture::CUDAErrorLogCapture() noexcept { std::memset(state_, 0, sizeof(state_)); }

void c10_cuda_check_implementation(int32_t err, const char* filename, const char* function_name,
                                   uint32_t line_number, bool include_device_assertions,
                                   CUDAErrorLogCapture*) {
  c10_cuda_check_implementation(err, filename, function_name, static_cast<LINE_T>(line_number),
                                include_device_assertions);
}

}  // namespace c10::cuda
