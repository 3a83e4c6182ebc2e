// One-pass fp32 weight prediction (see predict.cpp).
#pragma once

#include <cstdint>

namespace fastpipe {

// out[i] = p[i] + scale * m[i] / (sqrt(v[i]) + eps) + decay * p[i], for i < n (fp32, contiguous).
void adam_predict_f32(uintptr_t out, uintptr_t p, uintptr_t m, uintptr_t v, int64_t n, float scale, float eps,
                      float decay);

}  // namespace fastpipe
