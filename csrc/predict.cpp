// Weight prediction for fastpipe.asynchronous (XPipe / PipeOptim), fp32 on the host.
//
// out = p + scale * m / (sqrt(v) + eps) + decay * p, in one pass over the four arrays.
// torch needs three passes for the same (sqrt, add, addcdiv: eight array accesses per element
// against four here), and on a CPU the prediction is memory-bound and lies on the critical path
// of a stage once per mini-batch. The order of the float operations is torch's: sqrt, + eps,
// m / that, * scale, + p, then + decay * p.
#include "predict.h"

#include <cmath>
#include <stdexcept>

namespace fastpipe {

// The loop is bound by sqrt and division throughput, not memory, with SSE2's four lanes (the
// x86-64 baseline); an AVX2 clone doubles the lanes where the CPU has them, picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void adam_predict_f32(uintptr_t out, uintptr_t p, uintptr_t m, uintptr_t v, int64_t n, float scale, float eps,
                      float decay) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (n == 0) return;
  if (!out || !p || !m || !v) throw std::invalid_argument("null pointer passed to adam_predict_f32");
  float* __restrict o = reinterpret_cast<float*>(out);
  const float* w = reinterpret_cast<const float*>(p);
  const float* __restrict first = reinterpret_cast<const float*>(m);
  const float* __restrict second = reinterpret_cast<const float*>(v);
  // `out` may alias neither input except `v` (a caller writing over a scratch copy); the
  // loop reads every input element before writing the same index, so that is safe too.
  if (decay == 0.0f) {
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] + scale * (first[i] / (std::sqrt(second[i]) + eps));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float x = w[i] + scale * (first[i] / (std::sqrt(second[i]) + eps));
      o[i] = x + decay * w[i];
    }
  }
}

}  // namespace fastpipe
