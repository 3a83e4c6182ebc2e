#include "stream.h"

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace fastpipe {
namespace {

std::atomic<uintptr_t> g_next_host_id{1};

void check_copy_args(uintptr_t dst, uintptr_t src, int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0, got " + std::to_string(nbytes));
  if (nbytes > 0 && (dst == 0 || src == 0))
    throw std::invalid_argument(std::string("null ") + (dst == 0 ? "destination" : "source") +
                                " pointer for a copy of " + std::to_string(nbytes) + " bytes");
}

}  // namespace

CopyKind parse_copy_kind(const std::string& s) {
  if (s == "default" || s == "auto") return CopyKind::Default;
  if (s == "h2d") return CopyKind::HostToDevice;
  if (s == "d2h") return CopyKind::DeviceToHost;
  if (s == "d2d") return CopyKind::DeviceToDevice;
  if (s == "h2h") return CopyKind::HostToHost;
  throw std::invalid_argument("unknown copy kind '" + s + "' (expected default, h2d, d2h, d2d or h2h)");
}

// ---------------------------------------------------------------- Stream

Stream::Stream(int device) : device_(device) {
  if (device < -1) throw std::invalid_argument("device must be -1 (host) or a CUDA ordinal");
  if (is_host()) {
    worker_ = std::make_unique<HostWorker>();
    handle_ = g_next_host_id.fetch_add(1);
  } else {
    cu::ContextGuard guard(device);
    cu::CUstream s = nullptr;
    cu::check(cu::require_driver().cuStreamCreate(&s, cu::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    handle_ = reinterpret_cast<uintptr_t>(s);
  }
}

Stream::Stream(int device, uintptr_t handle, bool owned) : device_(device), handle_(handle), owned_(owned) {}

std::shared_ptr<Stream> Stream::from_handle(int device, uintptr_t handle) {
  if (device < 0)
    throw std::invalid_argument("Stream.from_handle wraps CUDA streams only (device must be >= 0)");
  cu::primary_context(device);  // validates the driver and the ordinal
  return std::shared_ptr<Stream>(new Stream(device, handle, false));
}

Stream::~Stream() {
  if (worker_ && worker_->forked()) {
    // In a child of fork(): the worker's thread is gone but its condition variable still
    // counts it as a waiter, so destroying it would block forever (pthread_cond_destroy).
    // Leak the worker; the process that owns its thread frees it.
    static_cast<void>(worker_.release());
    return;
  }
  try {
    close();
  } catch (...) {
    // Destructors must not throw (e.g. driver already torn down at exit).
  }
}

bool Stream::closed() const { return closed_ || (worker_ && worker_->forked()); }

void Stream::check_open() const {
  if (worker_ && worker_->forked())
    throw Error("host stream was created before fork(); its worker thread does not exist in this process");
  if (closed_) throw Error(std::string("stream is closed (") + backend() + " stream)");
}

HostWorker& Stream::worker() {
  check_open();
  return *worker_;
}

cu::CUstream Stream::cu_stream() {
  check_open();
  return reinterpret_cast<cu::CUstream>(handle_);
}

void Stream::close() {
  if (closed_.exchange(true)) return;
  if (is_host()) {
    worker_->close();
  } else if (owned_ && cu::driver()) {
    // Safe with work pending: the driver frees the stream once it drains.
    cu::ContextGuard guard(device_);
    cu::check(cu::driver()->cuStreamDestroy(reinterpret_cast<cu::CUstream>(handle_)), "cuStreamDestroy");
  }
}

void Stream::copy(uintptr_t dst, uintptr_t src, int64_t nbytes, CopyKind kind) {
  check_open();
  check_copy_args(dst, src, nbytes);
  if (nbytes == 0) return;
  const size_t n = static_cast<size_t>(nbytes);
  if (is_host()) {
    // Every kind is a plain memory copy here; memmove tolerates overlap.
    worker_->enqueue([dst, src, n] { std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n); });
    return;
  }
  const cu::Driver& d = cu::require_driver();
  cu::ContextGuard guard(device_);
  cu::CUstream s = reinterpret_cast<cu::CUstream>(handle_);
  switch (kind) {
    case CopyKind::HostToDevice:
      cu::check(d.cuMemcpyHtoDAsync(dst, reinterpret_cast<const void*>(src), n, s), "cuMemcpyHtoDAsync");
      break;
    case CopyKind::DeviceToHost:
      cu::check(d.cuMemcpyDtoHAsync(reinterpret_cast<void*>(dst), src, n, s), "cuMemcpyDtoHAsync");
      break;
    case CopyKind::DeviceToDevice:
      cu::check(d.cuMemcpyDtoDAsync(dst, src, n, s), "cuMemcpyDtoDAsync");
      break;
    case CopyKind::Default:
    case CopyKind::HostToHost:
      // Unified addressing: the driver infers the direction.
      cu::check(d.cuMemcpyAsync(dst, src, n, s), "cuMemcpyAsync");
      break;
  }
}

void Stream::copy_peer(uintptr_t dst, int dst_device, uintptr_t src, int src_device, int64_t nbytes) {
  check_open();
  check_copy_args(dst, src, nbytes);
  if (nbytes == 0) return;
  if (is_host()) {
    if (dst_device >= 0 || src_device >= 0)
      throw std::invalid_argument("a host stream cannot copy between CUDA devices");
    copy(dst, src, nbytes, CopyKind::HostToHost);
    return;
  }
  const cu::Driver& d = cu::require_driver();
  cu::CUcontext dst_ctx = cu::primary_context(dst_device);
  cu::CUcontext src_ctx = cu::primary_context(src_device);
  // Without peer access the driver stages a peer copy through host memory.
  cu::enable_peer_access(dst_device, src_device);
  cu::enable_peer_access(src_device, dst_device);
  cu::ContextGuard guard(device_);
  cu::check(d.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, static_cast<size_t>(nbytes),
                                reinterpret_cast<cu::CUstream>(handle_)),
            "cuMemcpyPeerAsync");
}

void Stream::synchronize() {
  check_open();
  if (is_host()) {
    worker_->synchronize();
    return;
  }
  cu::ContextGuard guard(device_);
  cu::check(cu::require_driver().cuStreamSynchronize(reinterpret_cast<cu::CUstream>(handle_)),
            "cuStreamSynchronize");
}

bool Stream::query() {
  check_open();
  if (is_host()) return worker_->query();
  cu::ContextGuard guard(device_);
  cu::CUresult r = cu::require_driver().cuStreamQuery(reinterpret_cast<cu::CUstream>(handle_));
  if (r == cu::CUDA_ERROR_NOT_READY) return false;
  cu::check(r, "cuStreamQuery");
  return true;
}

void Stream::delay(double seconds) {
  check_open();
  if (!is_host()) throw std::invalid_argument("Stream.delay is only available on host streams");
  if (seconds < 0) throw std::invalid_argument("delay must be >= 0");
  worker_->enqueue([seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
}

// ---------------------------------------------------------------- Event

struct Event::CudaHandle {
  int device;
  cu::CUevent ev = nullptr;
  CudaHandle(int dev, bool timing) : device(dev) {
    cu::ContextGuard guard(dev);
    cu::check(cu::require_driver().cuEventCreate(&ev, timing ? cu::CU_EVENT_DEFAULT : cu::CU_EVENT_DISABLE_TIMING),
              "cuEventCreate");
  }
  ~CudaHandle() {
    if (const cu::Driver* d = cu::driver()) {
      try {
        cu::ContextGuard guard(device);
        d->cuEventDestroy(ev);
      } catch (...) {
      }
    }
  }
};

Event::~Event() = default;

void Event::record(Stream& stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_ != -2 && device_ != stream.device())
    throw std::invalid_argument("event was recorded on device " + std::to_string(device_) +
                                " and cannot be recorded on device " + std::to_string(stream.device()));
  if (stream.is_host()) {
    auto state = std::make_shared<HostEventState>();
    stream.worker().enqueue([state] { state->mark(); });
    host_ = state;
  } else {
    cu::CUstream s = stream.cu_stream();
    if (!cuda_) cuda_ = std::make_shared<CudaHandle>(stream.device(), timing_);
    cu::ContextGuard guard(stream.device());
    cu::check(cu::require_driver().cuEventRecord(cuda_->ev, s), "cuEventRecord");
    cuda_recorded_ = true;
  }
  device_ = stream.device();
}

void Event::wait(Stream& stream) {
  std::shared_ptr<HostEventState> host;
  std::shared_ptr<CudaHandle> cuda;
  {
    std::lock_guard<std::mutex> lock(mu_);
    host = host_;
    cuda = cuda_recorded_ ? cuda_ : nullptr;
  }
  stream.check_open();
  if (!host && !cuda) return;  // never recorded: nothing to wait for
  if (stream.is_host()) {
    if (host) {
      stream.worker().enqueue([host] { host->wait(); });
    } else {
      // A host stream waiting on GPU work: its worker blocks on the CUDA event.
      stream.worker().enqueue([cuda] {
        cu::ContextGuard guard(cuda->device);
        cu::check(cu::require_driver().cuEventSynchronize(cuda->ev), "cuEventSynchronize");
      });
    }
    return;
  }
  if (host)
    throw std::invalid_argument("a CUDA stream cannot wait on an event recorded on a host stream");
  cu::CUstream s = stream.cu_stream();
  cu::ContextGuard guard(stream.device());
  cu::check(cu::require_driver().cuStreamWaitEvent(s, cuda->ev, 0), "cuStreamWaitEvent");
}

bool Event::query() {
  std::shared_ptr<HostEventState> host;
  std::shared_ptr<CudaHandle> cuda;
  {
    std::lock_guard<std::mutex> lock(mu_);
    host = host_;
    cuda = cuda_recorded_ ? cuda_ : nullptr;
  }
  if (host) return host->query();
  if (!cuda) return true;
  cu::ContextGuard guard(cuda->device);
  cu::CUresult r = cu::require_driver().cuEventQuery(cuda->ev);
  if (r == cu::CUDA_ERROR_NOT_READY) return false;
  cu::check(r, "cuEventQuery");
  return true;
}

void Event::synchronize() {
  std::shared_ptr<HostEventState> host;
  std::shared_ptr<CudaHandle> cuda;
  {
    std::lock_guard<std::mutex> lock(mu_);
    host = host_;
    cuda = cuda_recorded_ ? cuda_ : nullptr;
  }
  if (host) {
    host->wait();
  } else if (cuda) {
    cu::ContextGuard guard(cuda->device);
    cu::check(cu::require_driver().cuEventSynchronize(cuda->ev), "cuEventSynchronize");
  }
}

double Event::elapsed_time(Event& end) {
  if (&end == this) return 0.0;
  std::shared_ptr<HostEventState> h0, h1;
  std::shared_ptr<CudaHandle> c0, c1;
  {
    std::lock(mu_, end.mu_);
    std::lock_guard<std::mutex> a(mu_, std::adopt_lock);
    std::lock_guard<std::mutex> b(end.mu_, std::adopt_lock);
    if (!timing_ || !end.timing_) throw Error("elapsed_time needs two events created with enable_timing=True");
    if (device_ == -2 || end.device_ == -2) throw Error("elapsed_time: event was never recorded");
    if (device_ != end.device_) throw Error("elapsed_time: events were recorded on different devices");
    h0 = host_;
    h1 = end.host_;
    c0 = cuda_;
    c1 = end.cuda_;
  }
  if (h0 && h1) {
    if (!h0->query() || !h1->query()) throw Error("elapsed_time: event has not completed yet");
    return std::chrono::duration<double, std::milli>(h1->time() - h0->time()).count();
  }
  float ms = 0.f;
  cu::ContextGuard guard(c0->device);
  cu::check(cu::require_driver().cuEventElapsedTime(&ms, c0->ev, c1->ev), "cuEventElapsedTime");
  return ms;
}

bool Event::recorded() {
  std::lock_guard<std::mutex> lock(mu_);
  return device_ != -2;
}

int Event::device() {
  std::lock_guard<std::mutex> lock(mu_);
  return device_;
}

}  // namespace fastpipe
