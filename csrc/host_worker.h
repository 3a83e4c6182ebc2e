// Host backend: a stream is one worker thread draining a FIFO queue of tasks.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fastpipe {

// Threads started by HostWorker and not yet finished (for leak tests).
int live_host_threads();

// Completion flag of one event record on a host stream. A record enqueues a
// marker task; the marker sets `done` (and the time) when the worker reaches it,
// i.e. after everything enqueued on that stream before the record.
class HostEventState {
 public:
  void mark();
  void wait();
  bool query();
  std::chrono::steady_clock::time_point time();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point time_;
};

class HostWorker {
 public:
  HostWorker();
  ~HostWorker();
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // Appends a task; throws fastpipe::Error once closed.
  void enqueue(std::function<void()> task);
  // Blocks until every task enqueued before the call has run. Rethrows (once) the
  // first error a task raised since the last synchronize, like CUDA's sticky errors.
  void synchronize();
  bool query();
  // Runs what is queued, then joins the thread. Idempotent.
  void close();
  bool closed();
  // True in a child process forked after this worker started: the thread does not
  // exist there, so every operation raises (close() is a no-op).
  bool forked() const { return forked_.load(); }
  void abandon_after_fork();

 private:
  void check_not_forked() const;
  void run();

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  bool stopping_ = false;
  bool joined_ = false;
  std::string error_;
  std::thread thread_;
  std::mutex join_mu_;
  std::atomic<bool> forked_{false};
};

// Closes every live HostWorker (called from a Python atexit hook).
void shutdown_host_workers();

}  // namespace fastpipe
