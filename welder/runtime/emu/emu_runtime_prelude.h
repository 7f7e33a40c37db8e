// emu_runtime_prelude.h -- what an emulated runtime's sources (nnfusion_rt.cu, kernels_N.cu)
// include before their own code, as one header that welder build precompiles once in its
// cache and forces into each of them (CMake's WELDER_EMU_PCH): the standard headers, the
// emulator's host API and the kernel prelude are most of each file's compile.
//
// It holds every standard header those sources include before the prelude (runtime/preamble.j2,
// emu_cublas.h, nnfusion_rt.h), and in the same order relative to the prelude: its qualifier
// macros (__noinline__, __shared__, ...) must not reach them.  A source's own includes of these
// headers afterwards are no-ops.
#pragma once

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "emu_host.h"

#include "welder_prelude.cuh"
#include "welder_math.cuh"
