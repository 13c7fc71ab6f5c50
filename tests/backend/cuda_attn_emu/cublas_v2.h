/* Stub for the CPU emulation of kernels/cuda/attn.cu: see emu.h. */
#include "emu.h"
