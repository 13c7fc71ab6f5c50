/* Stub for the CPU emulation of CUDA (kernels/cuda): see emu.h. */
#include "emu.h"
