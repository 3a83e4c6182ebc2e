// HostBufferPool: reusable host blocks, page-locked (pinned) when the pool
// belongs to a CUDA device, 4096-byte aligned host memory otherwise.
//
// Size classes keep slack under 12.5%: a request of n bytes with
// 2^k <= n < 2^(k+1) is rounded up to a multiple of max(64, 2^(k-3)) (and to
// at least 512 bytes).
// A released block goes back to the free list of its class and is handed out
// again (LIFO, so the most recently used block comes back first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace fastpipe {

struct PoolStats {
  size_t reserved_bytes = 0;  // all blocks the pool holds (in use + cached)
  size_t in_use_bytes = 0;    // capacity of blocks handed out and not yet released
  size_t requested_bytes = 0; // bytes asked for by blocks in use
  uint64_t hits = 0;          // acquires served from the cache
  uint64_t misses = 0;        // acquires that allocated
  size_t cached_blocks = 0;
  size_t blocks_in_use = 0;
};

class PoolState {
 public:
  explicit PoolState(int device) : device_(device) {}
  ~PoolState();
  void* acquire(size_t nbytes, size_t* capacity);
  void release(void* ptr, size_t capacity, size_t nbytes);
  void empty_cache();
  PoolStats stats();
  int device() const { return device_; }

  static size_t size_class(size_t nbytes);

 private:
  void* allocate(size_t capacity);
  void free_block(void* ptr) noexcept;

  int device_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  PoolStats stats_;
};

// One block handed out by a pool; returns itself to the pool on release() or
// destruction. Keeps the pool's state alive while it exists.
class HostBlock {
 public:
  HostBlock(std::shared_ptr<PoolState> pool, size_t nbytes);
  ~HostBlock();
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  uintptr_t ptr() const;
  size_t nbytes() const { return nbytes_; }
  size_t capacity() const { return capacity_; }
  bool released() const { return ptr_ == nullptr; }
  void release();

 private:
  std::shared_ptr<PoolState> pool_;
  void* ptr_ = nullptr;
  size_t nbytes_;
  size_t capacity_ = 0;
};

class HostBufferPool {
 public:
  explicit HostBufferPool(int device = -1);
  std::unique_ptr<HostBlock> acquire(int64_t nbytes);
  void empty_cache() { state_->empty_cache(); }
  PoolStats stats() { return state_->stats(); }
  int device() const { return state_->device(); }

 private:
  std::shared_ptr<PoolState> state_;
};

}  // namespace fastpipe
