// What this build of the CPU kernels may use, decided once from the compiler's target (-march, which
// engine/kernels/cpu_ops.py sets from INFERMESH_CPU_MARCH): every kernel tests these macros, never the
// compiler's own. At run time `bf16_path()` (cpu_vec.h) may take a slower bf16 path than the build has
// (INFERMESH_CPU_BF16), and every kernel with a bf16 path of its own honours it.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define INFERMESH_AVX512 1  // 16-lane float32 vectors
#endif
#if defined(__AVX2__)
#define INFERMESH_AVX2 1  // 8-lane integer and float32 vectors
#endif
#if defined(__FMA__)
#define INFERMESH_FMA 1  // fused multiply-add on vectors
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFERMESH_BF16_DOT 1  // VDPBF16PS, with the masked 16-bit loads of a step's tail (AVX512-BW)
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFERMESH_AMX 1  // bf16 tiles (Sapphire Rapids and later)
#endif
