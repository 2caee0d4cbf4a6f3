#!/usr/bin/env bash
# Session 16 (H100): measure sgl-deep-gemm 0.2.5's SM90 FP8 MegaMoE, which session 14 could not load.
# Builds torch_abi_shim.so (the two c10 symbols its prebuilt _C.so takes from a newer torch), lists what
# _C.so still lacks, then runs session 14's probe with the shim loaded first.
#   bash benchmarks/cuda/run_h100.sh OUT install; bash benchmarks/cuda/h100_session16/probe_mega_moe_shim.sh [preset:T ...]
set -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
DG=$(python3 -c "import importlib.util as u; print(u.find_spec('deep_gemm').submodule_search_locations[0])")
echo "torch 2.11 exports: $(nm -D --defined-only "$TL/libc10_cuda.so" | grep -o '_ZN3c104cuda29c10_cuda_check_implementation[A-Za-z0-9_]*')"
LINE_T=uint32_t
nm -D --defined-only "$TL/libc10_cuda.so" | grep -q 'c10_cuda_check_implementationEiPKcS2_ib$' && LINE_T=int
g++ -std=c++17 -O2 -DLINE_T=$LINE_T -fPIC -shared "$HERE/torch_abi_shim.cpp" -o /tmp/torch_abi_shim.so \
  -L"$TL" -lc10_cuda -Wl,-rpath,"$TL" || exit 1
CUDA_LIB=${CUDA_HOME:-/usr/local/cuda}/lib64
echo "symbols _C.so still lacks with the shim (Python's are resolved at import):"
LD_PRELOAD=/tmp/torch_abi_shim.so LD_LIBRARY_PATH="$TL:$CUDA_LIB:$LD_LIBRARY_PATH" ldd -r "$DG/_C.so" 2>&1 \
  | grep "undefined symbol" | grep -v "Py\|_Py" | c++filt | head -20
export MOE_TORCH_ABI_SHIM=/tmp/torch_abi_shim.so
python3 -c "
import ctypes, os, runpy, sys
ctypes.CDLL(os.environ['MOE_TORCH_ABI_SHIM'], mode=ctypes.RTLD_GLOBAL)
sys.argv = ['probe_mega_moe.py'] + sys.argv[1:]
runpy.run_path('$HERE/../h100_session14/probe_mega_moe.py', run_name='__main__')
" "$@"
