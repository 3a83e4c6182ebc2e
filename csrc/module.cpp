// Python bindings: fastpipe._C
//
// Python passes raw pointers (ints), byte counts and stream handles; nothing
// here knows about torch. See fastpipe/runtime/{device,transfer}.py for the
// torch-facing layer.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "cuda_driver.h"
#include "errors.h"
#include "host_pool.h"
#include "host_worker.h"
#include "predict.h"
#include "stream.h"

namespace py = pybind11;
using namespace fastpipe;

namespace {

bool backend_available(const std::string& name) {
  if (name == "host" || name == "cpu") return true;
  if (name == "cuda") return cu::driver() != nullptr;
  throw std::invalid_argument("unknown backend '" + name + "' (expected 'cuda' or 'host')");
}

void blocking_memcpy(uintptr_t dst, uintptr_t src, int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
  if (nbytes == 0) return;
  if (!dst || !src) throw std::invalid_argument("null pointer passed to memcpy");
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), static_cast<size_t>(nbytes));
}

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["requested_bytes"] = s.requested_bytes;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["cached_blocks"] = s.cached_blocks;
  d["blocks_in_use"] = s.blocks_in_use;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastpipe runtime: streams, events, pinned host pool, async copies (host and CUDA backends)";
  m.attr("version") = "0.1.0";

  // Translators run newest first, so CudaError is matched before its base.
  auto& error_type = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<CudaError>(m, "CudaError", error_type.ptr());

  m.def("backend_available", &backend_available, py::arg("name"),
        "True if the backend can be used: 'host' always; 'cuda' when libcuda.so.1 loads, cuInit "
        "succeeds and there is at least one device. The first call with 'cuda' initialises the driver.");
  m.def("cuda_device_count", &cu::device_count, "Number of CUDA devices the driver sees (0 without one).");
  m.def("cuda_load_error", &cu::load_error, "Why the CUDA backend is unavailable ('' when it is available).");
  m.def("cuda_make_current", &cu::make_current, py::arg("device"),
        "Make the device's primary context current in the calling thread (cuCtxSetCurrent).");
  m.def("cuda_enable_peer_access", &cu::enable_peer_access, py::arg("device"), py::arg("peer"),
        "Let `device` access `peer`'s memory directly, once per pair; False when the hardware cannot.");
  m.def("live_host_threads", &live_host_threads, "Host-stream worker threads currently alive.");
  m.def("memcpy", &blocking_memcpy, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::call_guard<py::gil_scoped_release>(), "Synchronous host memcpy (memmove), GIL released.");
  m.def("adam_predict_f32", &adam_predict_f32, py::arg("out"), py::arg("p"), py::arg("m"), py::arg("v"),
        py::arg("n"), py::arg("scale"), py::arg("eps"), py::arg("decay") = 0.0f,
        py::call_guard<py::gil_scoped_release>(),
        "out = p + scale * m / (sqrt(v) + eps) + decay * p over n contiguous float32s, in one pass, GIL "
        "released (weight prediction, fastpipe.asynchronous.direction).");
  m.def("_shutdown", &shutdown_host_workers, py::call_guard<py::gil_scoped_release>(),
        "Drain and join every host stream (registered with atexit).");

  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream",
                                              "A FIFO queue of asynchronous work. device=-1: host backend "
                                              "(one worker thread); device>=0: a new non-blocking CUDA stream.")
      .def(py::init<int>(), py::arg("device") = -1)
      .def_static("from_handle", &Stream::from_handle, py::arg("device"), py::arg("handle"),
                  "Wrap an existing CUstream (an int, e.g. torch.cuda.current_stream(d).cuda_stream; 0 is the "
                  "legacy default stream). The wrapper does not own the handle.")
      .def_property_readonly("device", &Stream::device)
      .def_property_readonly("backend", [](const Stream& s) { return std::string(s.backend()); })
      .def_property_readonly("handle", &Stream::handle)
      .def_property_readonly("owned", &Stream::owned)
      .def_property_readonly("closed", &Stream::closed)
      .def(
          "copy",
          [](Stream& s, uintptr_t dst, uintptr_t src, int64_t nbytes, const std::string& kind) {
            s.copy(dst, src, nbytes, parse_copy_kind(kind));
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("kind") = "default",
          py::call_guard<py::gil_scoped_release>(),  // a pageable CUDA copy may block
          "Enqueue an asynchronous copy of nbytes from src to dst. kind: 'h2d', 'd2h', 'd2d', 'h2h' or "
          "'default' (CUDA infers the direction from unified addresses). The caller keeps both buffers alive "
          "until an event recorded after the copy completes.")
      .def("copy_peer", &Stream::copy_peer, py::arg("dst"), py::arg("dst_device"), py::arg("src"),
           py::arg("src_device"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "Enqueue a copy between two CUDA devices (cuMemcpyPeerAsync).")
      .def(
          "record_event",
          [](Stream& s, std::shared_ptr<Event> e) {
            if (!e) e = std::make_shared<Event>(false);
            e->record(s);
            return e;
          },
          py::arg("event") = nullptr, "Record `event` (or a new one) on this stream and return it.")
      .def(
          "wait_event", [](Stream& s, Event& e) { e.wait(s); }, py::arg("event"),
          "Make work enqueued on this stream from now on wait for `event`.")
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Stream::query, "True when all work enqueued so far has completed.")
      .def("close", &Stream::close, py::call_guard<py::gil_scoped_release>(),
           "Finish queued work, stop the worker (host) or destroy the stream (owned CUDA). Idempotent.")
      .def("delay", &Stream::delay, py::arg("seconds"), "Host streams only: enqueue a sleep (for tests, benches).")
      .def("__enter__", [](std::shared_ptr<Stream> s) { return s; })
      .def("__exit__", [](Stream& s, py::args) {
        py::gil_scoped_release nogil;
        s.close();
      })
      .def("__repr__", [](const Stream& s) {
        return "<fastpipe._C.Stream backend=" + std::string(s.backend()) + " device=" + std::to_string(s.device()) +
               " handle=" + std::to_string(s.handle()) + (s.closed() ? " closed" : "") + ">";
      });

  py::class_<Event, std::shared_ptr<Event>>(m, "Event",
                                            "A point in a stream's work. Created unbound; bound to the backend "
                                            "and device of the first stream it is recorded on. An event never "
                                            "recorded counts as complete.")
      .def(py::init<bool>(), py::arg("enable_timing") = false)
      .def("record", &Event::record, py::arg("stream"))
      .def("wait", &Event::wait, py::arg("stream"), "Make `stream` wait for this event (does not block the caller).")
      .def("query", &Event::query)
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("elapsed_time", &Event::elapsed_time, py::arg("end"), "Milliseconds from this event to `end`.")
      .def_property_readonly("recorded", &Event::recorded)
      .def_property_readonly("timing", &Event::timing)
      .def_property_readonly("device", &Event::device, "-1 host, >=0 CUDA ordinal, -2 never recorded.");

  py::class_<HostBlock>(m, "HostBlock", py::buffer_protocol(),
                        "A block from a HostBufferPool. Supports the buffer protocol (uint8, nbytes long). Goes back "
                        "to the pool on release() or when garbage collected.")
      .def_property_readonly("ptr", &HostBlock::ptr)
      .def_property_readonly("nbytes", &HostBlock::nbytes)
      .def_property_readonly("capacity", &HostBlock::capacity)
      .def_property_readonly("released", &HostBlock::released)
      .def("release", &HostBlock::release)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](HostBlock& b, py::args) { b.release(); })
      .def_buffer([](HostBlock& b) -> py::buffer_info {
        return py::buffer_info(reinterpret_cast<void*>(b.ptr()), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {static_cast<py::ssize_t>(1)});
      });

  py::class_<HostBufferPool, std::shared_ptr<HostBufferPool>>(
      m, "HostBufferPool",
      "Reusable host blocks: pinned (cuMemHostAlloc, portable) for device>=0, 4096-byte aligned otherwise.")
      .def(py::init<int>(), py::arg("device") = -1)
      .def("acquire", &HostBufferPool::acquire, py::arg("nbytes"))
      .def("empty_cache", &HostBufferPool::empty_cache, "Free every cached (not in use) block.")
      .def("stats", [](HostBufferPool& p) { return stats_dict(p.stats()); })
      .def_property_readonly("device", &HostBufferPool::device)
      .def_static("size_class", &PoolState::size_class, py::arg("nbytes"), "Capacity a request of nbytes gets.");

  py::module_::import("atexit").attr("register")(m.attr("_shutdown"));
}
