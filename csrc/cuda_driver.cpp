#include "cuda_driver.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <vector>

#include "errors.h"

namespace fastpipe {
namespace cu {
namespace {

struct Loader {
  Driver drv{};
  bool ok = false;
  std::string error;
  int count = 0;

  template <typename F>
  bool sym(void* lib, F& out, std::initializer_list<const char*> names) {
    for (const char* name : names) {
      if (void* p = dlsym(lib, name)) {
        out = reinterpret_cast<F>(p);
        return true;
      }
    }
    error = std::string("libcuda lacks symbol ") + *names.begin();
    return false;
  }

  Loader() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      error = std::string("cannot load libcuda.so.1: ") + (e ? e : "unknown error");
      lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
      if (!lib) return;
      error.clear();
    }
    // Versioned names first where the driver has them (the plain names are kept
    // for old binaries and may have older semantics).
    bool all = sym(lib, drv.cuInit, {"cuInit"}) && sym(lib, drv.cuDeviceGetCount, {"cuDeviceGetCount"}) &&
               sym(lib, drv.cuDeviceGet, {"cuDeviceGet"}) &&
               sym(lib, drv.cuDevicePrimaryCtxRetain, {"cuDevicePrimaryCtxRetain"}) &&
               sym(lib, drv.cuCtxPushCurrent, {"cuCtxPushCurrent_v2", "cuCtxPushCurrent"}) &&
               sym(lib, drv.cuCtxPopCurrent, {"cuCtxPopCurrent_v2", "cuCtxPopCurrent"}) &&
               sym(lib, drv.cuCtxSetCurrent, {"cuCtxSetCurrent"}) &&
               sym(lib, drv.cuDeviceCanAccessPeer, {"cuDeviceCanAccessPeer"}) &&
               sym(lib, drv.cuCtxEnablePeerAccess, {"cuCtxEnablePeerAccess"}) &&
               sym(lib, drv.cuStreamCreate, {"cuStreamCreate"}) &&
               sym(lib, drv.cuStreamDestroy, {"cuStreamDestroy_v2", "cuStreamDestroy"}) &&
               sym(lib, drv.cuStreamSynchronize, {"cuStreamSynchronize"}) &&
               sym(lib, drv.cuStreamQuery, {"cuStreamQuery"}) &&
               sym(lib, drv.cuStreamWaitEvent, {"cuStreamWaitEvent"}) &&
               sym(lib, drv.cuEventCreate, {"cuEventCreate"}) &&
               sym(lib, drv.cuEventDestroy, {"cuEventDestroy_v2", "cuEventDestroy"}) &&
               sym(lib, drv.cuEventRecord, {"cuEventRecord"}) && sym(lib, drv.cuEventQuery, {"cuEventQuery"}) &&
               sym(lib, drv.cuEventSynchronize, {"cuEventSynchronize"}) &&
               sym(lib, drv.cuEventElapsedTime, {"cuEventElapsedTime_v2", "cuEventElapsedTime"}) &&
               sym(lib, drv.cuMemcpyAsync, {"cuMemcpyAsync"}) &&
               sym(lib, drv.cuMemcpyHtoDAsync, {"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"}) &&
               sym(lib, drv.cuMemcpyDtoHAsync, {"cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"}) &&
               sym(lib, drv.cuMemcpyDtoDAsync, {"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"}) &&
               sym(lib, drv.cuMemcpyPeerAsync, {"cuMemcpyPeerAsync"}) &&
               sym(lib, drv.cuMemHostAlloc, {"cuMemHostAlloc"}) &&
               sym(lib, drv.cuMemFreeHost, {"cuMemFreeHost"}) &&
               sym(lib, drv.cuGetErrorName, {"cuGetErrorName"}) &&
               sym(lib, drv.cuGetErrorString, {"cuGetErrorString"});
    if (!all) return;  // keep the library loaded; it is harmless
    CUresult r = drv.cuInit(0);
    if (r != CUDA_SUCCESS) {
      error = "cuInit failed: " + describe(r);
      return;
    }
    r = drv.cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS || count <= 0) {
      error = r != CUDA_SUCCESS ? "cuDeviceGetCount failed: " + describe(r) : "no CUDA device";
      count = 0;
      return;
    }
    ok = true;
  }

  std::string describe(CUresult code) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (drv.cuGetErrorName) drv.cuGetErrorName(code, &name);
    if (drv.cuGetErrorString) drv.cuGetErrorString(code, &text);
    std::string out = name ? name : "CUDA_ERROR_" + std::to_string(code);
    if (text) out += std::string(" (") + text + ")";
    return out;
  }
};

Loader& loader() {
  static Loader instance;  // C++11 guarantees thread-safe one-time init
  return instance;
}

}  // namespace

const Driver* driver() {
  Loader& l = loader();
  return l.ok ? &l.drv : nullptr;
}

std::string load_error() { return loader().ok ? std::string() : loader().error; }

int device_count() { return loader().ok ? loader().count : 0; }

const Driver& require_driver() {
  const Driver* d = driver();
  if (!d) throw Error("CUDA backend unavailable: " + load_error());
  return *d;
}

void throw_error(CUresult code, const char* where) {
  const Driver* d = &loader().drv;
  const char* name = nullptr;
  const char* text = nullptr;
  if (d->cuGetErrorName) d->cuGetErrorName(code, &name);
  if (d->cuGetErrorString) d->cuGetErrorString(code, &text);
  std::string msg = name ? name : "CUDA_ERROR_" + std::to_string(code);
  msg += std::string(" in ") + where + ": " + (text ? text : "unknown error");
  throw CudaError(code, msg);
}

CUcontext primary_context(int device) {
  const Driver& d = require_driver();
  static std::mutex mu;
  static std::vector<CUcontext> contexts;
  if (device < 0 || device >= device_count())
    throw std::invalid_argument("invalid CUDA device " + std::to_string(device) + " (have " +
                                std::to_string(device_count()) + ")");
  std::lock_guard<std::mutex> lock(mu);
  if (contexts.empty()) contexts.assign(static_cast<size_t>(device_count()), nullptr);
  CUcontext& ctx = contexts[static_cast<size_t>(device)];
  if (!ctx) {
    CUdevice dev = 0;
    check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
    check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  }
  return ctx;
}

void make_current(int device) {
  check(require_driver().cuCtxSetCurrent(primary_context(device)), "cuCtxSetCurrent");
}

bool enable_peer_access(int device, int peer) {
  const Driver& d = require_driver();
  if (device == peer) return true;
  static std::mutex mu;
  static std::map<std::pair<int, int>, bool> done;
  CUcontext peer_ctx = primary_context(peer);
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find({device, peer});
  if (it != done.end()) return it->second;
  CUdevice dev = 0, peer_dev = 0;
  check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(d.cuDeviceGet(&peer_dev, peer), "cuDeviceGet");
  int can = 0;
  check(d.cuDeviceCanAccessPeer(&can, dev, peer_dev), "cuDeviceCanAccessPeer");
  bool on = false;
  if (can) {
    ContextGuard guard(device);
    CUresult r = d.cuCtxEnablePeerAccess(peer_ctx, 0);
    // torch's allocator may have enabled it already; any other refusal (e.g. too many
    // peers) leaves the copy on its staged path, which is still correct.
    on = r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  }
  done[{device, peer}] = on;
  return on;
}

ContextGuard::ContextGuard(int device) : drv_(&require_driver()) {
  check(drv_->cuCtxPushCurrent(primary_context(device)), "cuCtxPushCurrent");
}

ContextGuard::~ContextGuard() {
  CUcontext ignored = nullptr;
  drv_->cuCtxPopCurrent(&ignored);
}

}  // namespace cu
}  // namespace fastpipe
