// Stream and Event: one API over two backends.
//
//   device >= 0  -> CUDA backend (driver API, primary context of that device)
//   device == -1 -> host backend (a worker thread per stream, see host_worker.h)
//
// Semantics shared by both backends (the CUDA ones, mirrored on the host):
//  * work on one stream runs in FIFO order;
//  * Event::record(s) captures all work enqueued on s so far; re-recording
//    replaces the captured point for later calls (earlier waits keep theirs);
//  * Event::wait(s) makes work enqueued on s afterwards wait for that point;
//  * an event never recorded counts as complete (query() true, wait() no-op).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_driver.h"
#include "host_worker.h"

namespace fastpipe {

enum class CopyKind { Default, HostToDevice, DeviceToHost, DeviceToDevice, HostToHost };
CopyKind parse_copy_kind(const std::string& s);

class Event;

class Stream {
 public:
  // A new stream: host (device == -1) or a non-blocking CUDA stream on `device`.
  explicit Stream(int device = -1);
  // Wraps an existing CUstream (e.g. torch.cuda.current_stream().cuda_stream);
  // 0 is the legacy default stream. The wrapper never destroys the handle.
  static std::shared_ptr<Stream> from_handle(int device, uintptr_t handle);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  bool is_host() const { return device_ < 0; }
  const char* backend() const { return is_host() ? "host" : "cuda"; }
  // CUstream for CUDA; a process-unique id for host streams.
  uintptr_t handle() const { return handle_; }
  bool owned() const { return owned_; }
  bool closed() const;

  void copy(uintptr_t dst, uintptr_t src, int64_t nbytes, CopyKind kind);
  void copy_peer(uintptr_t dst, int dst_device, uintptr_t src, int src_device, int64_t nbytes);
  void synchronize();
  bool query();
  void close();
  // Host only: a task that sleeps (to make ordering visible in tests and benches).
  void delay(double seconds);

  // Throws fastpipe::Error when the stream is closed (or is a host stream
  // inherited through fork()).
  void check_open() const;

  // Backend internals used by Event.
  HostWorker& worker();
  cu::CUstream cu_stream();

 private:
  Stream(int device, uintptr_t handle, bool owned);

  int device_;
  uintptr_t handle_ = 0;
  bool owned_ = true;
  std::atomic<bool> closed_{false};
  std::unique_ptr<HostWorker> worker_;
};

class Event {
 public:
  explicit Event(bool enable_timing = false) : timing_(enable_timing) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream& stream);
  void wait(Stream& stream);
  bool query();
  void synchronize();
  // Milliseconds from this event to `end`; both recorded with timing and complete.
  double elapsed_time(Event& end);

  bool recorded();
  bool timing() const { return timing_; }
  int device();  // -1 host, >= 0 CUDA, -2 never recorded

 private:
  struct CudaHandle;

  bool timing_;
  std::mutex mu_;
  int device_ = -2;
  std::shared_ptr<HostEventState> host_;
  std::shared_ptr<CudaHandle> cuda_;
  bool cuda_recorded_ = false;
};

}  // namespace fastpipe
