#include "host_pool.h"

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#include "cuda_driver.h"
#include "errors.h"

namespace fastpipe {

constexpr size_t kMinClass = 512;
constexpr size_t kMinGranule = 64;
constexpr size_t kHostAlignment = 4096;

size_t PoolState::size_class(size_t n) {
  if (n <= kMinClass) return kMinClass;
  size_t k = 63 - static_cast<size_t>(__builtin_clzll(static_cast<unsigned long long>(n)));
  size_t granule = k >= 3 ? (size_t{1} << (k - 3)) : 1;
  if (granule < kMinGranule) granule = kMinGranule;
  return (n + granule - 1) / granule * granule;
}

PoolState::~PoolState() {
  for (auto& kv : free_)
    for (void* p : kv.second) free_block(p);
}

void* PoolState::allocate(size_t capacity) {
  if (device_ < 0) {
    void* p = nullptr;
    if (posix_memalign(&p, kHostAlignment, capacity) != 0) throw std::bad_alloc();
    return p;
  }
  cu::ContextGuard guard(device_);
  void* p = nullptr;
  cu::check(cu::require_driver().cuMemHostAlloc(&p, capacity, cu::CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
  return p;
}

void PoolState::free_block(void* ptr) noexcept {
  if (device_ < 0) {
    std::free(ptr);
  } else if (const cu::Driver* d = cu::driver()) {
    d->cuMemFreeHost(ptr);  // errors ignored: may run at exit after driver teardown
  }
}

void* PoolState::acquire(size_t nbytes, size_t* capacity) {
  const size_t cls = size_class(nbytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.hits++;
      stats_.cached_blocks--;
      stats_.in_use_bytes += cls;
      stats_.requested_bytes += nbytes;
      stats_.blocks_in_use++;
      *capacity = cls;
      return p;
    }
  }
  void* p = nullptr;
  try {
    p = allocate(cls);
  } catch (const std::bad_alloc&) {
    empty_cache();  // give cached blocks back, then try once more
    p = allocate(cls);
  } catch (const CudaError&) {
    empty_cache();
    p = allocate(cls);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.misses++;
  stats_.reserved_bytes += cls;
  stats_.in_use_bytes += cls;
  stats_.requested_bytes += nbytes;
  stats_.blocks_in_use++;
  *capacity = cls;
  return p;
}

void PoolState::release(void* ptr, size_t capacity, size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  free_[capacity].push_back(ptr);
  stats_.cached_blocks++;
  stats_.in_use_bytes -= capacity;
  stats_.requested_bytes -= nbytes;
  stats_.blocks_in_use--;
}

void PoolState::empty_cache() {
  std::map<size_t, std::vector<void*>> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(free_);
    for (auto& kv : drop) stats_.reserved_bytes -= kv.first * kv.second.size();
    stats_.cached_blocks = 0;
  }
  for (auto& kv : drop)
    for (void* p : kv.second) free_block(p);
}

PoolStats PoolState::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

HostBlock::HostBlock(std::shared_ptr<PoolState> pool, size_t nbytes) : pool_(std::move(pool)), nbytes_(nbytes) {
  ptr_ = pool_->acquire(nbytes, &capacity_);
}

HostBlock::~HostBlock() { release(); }

uintptr_t HostBlock::ptr() const {
  if (!ptr_) throw Error("HostBlock was released");
  return reinterpret_cast<uintptr_t>(ptr_);
}

void HostBlock::release() {
  if (!ptr_) return;
  void* p = ptr_;
  ptr_ = nullptr;
  pool_->release(p, capacity_, nbytes_);
}

HostBufferPool::HostBufferPool(int device) {
  if (device < -1) throw std::invalid_argument("device must be -1 (host) or a CUDA ordinal");
  if (device >= 0) cu::primary_context(device);  // validate early, with a clear error
  state_ = std::make_shared<PoolState>(device);
}

std::unique_ptr<HostBlock> HostBufferPool::acquire(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0, got " + std::to_string(nbytes));
  return std::make_unique<HostBlock>(state_, static_cast<size_t>(nbytes));
}

}  // namespace fastpipe
