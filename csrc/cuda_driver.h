// Minimal run-time binding to the CUDA driver API (libcuda.so.1).
//
// We declare the handful of types and prototypes we need ourselves, so building
// fastpipe._C needs no cuda.h, no CUDA toolkit and no cudart. The driver is
// dlopen()ed the first time a CUDA object is made; on a host without a driver
// (or without a GPU) driver() returns nullptr and the host backend is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpipe {
namespace cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // 64-bit on every platform we support
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704;
constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
constexpr unsigned CU_EVENT_DEFAULT = 0x0;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x1;

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice);
  CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
};

// The loaded driver, or nullptr when libcuda cannot be loaded or cuInit fails.
// Loading happens once (thread-safe); never at module import.
const Driver* driver();
// Why driver() is nullptr ("" when it is not).
std::string load_error();
// Number of CUDA devices (0 without a driver).
int device_count();
// The driver, or throw fastpipe::Error explaining why it is unavailable.
const Driver& require_driver();

// Throws fastpipe::CudaError: "CUDA_ERROR_X in <where>: <description>".
[[noreturn]] void throw_error(CUresult code, const char* where);
inline void check(CUresult code, const char* where) {
  if (code != CUDA_SUCCESS) throw_error(code, where);
}

// The device's primary context (the one the CUDA runtime, hence torch, uses).
// Retained once per device and kept for the life of the process.
CUcontext primary_context(int device);

// Makes the device's primary context the calling thread's current context, for good.
// A new thread has none: the CUDA runtime binds one lazily, but libraries that ask the
// driver first (cuBLAS) warn and then bind it themselves.
void make_current(int device);

// Lets `device`'s primary context read and write `peer`'s memory directly (NVLink or
// PCIe P2P), so cuMemcpyPeerAsync need not stage through host memory. Done once per
// ordered pair; returns whether direct access is on (false: the hardware cannot).
bool enable_peer_access(int device, int peer);

// Makes the device's primary context current for the scope of the guard.
class ContextGuard {
 public:
  explicit ContextGuard(int device);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const Driver* drv_;
};

}  // namespace cu
}  // namespace fastpipe
