/* Fast-path kernels of kernels/cpu/convert.c (internal; AVX2/F16C, call only
 * when kvd__cpu_fast() is true). */
#ifndef KVDEPOT_CONVERT_IMPL_H
#define KVDEPOT_CONVERT_IMPL_H

#include <stdint.h>

#include "kvdepot/tensor.h"

void kvd__convert_row_avx2(void *dst, kvd_dtype td, const void *src, kvd_dtype ts, int64_t n);
void kvd__fwht_avx2(float *x, int64_t n, float norm);
void kvd__scale_row_avx2(float *y, const float *x, const float *s, int64_t n, int divide);

#endif /* KVDEPOT_CONVERT_IMPL_H */
