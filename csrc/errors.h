// Exceptions thrown by the runtime. module.cpp maps them to Python:
//   fastpipe::Error      -> fastpipe._C.Error (a RuntimeError)
//   fastpipe::CudaError  -> fastpipe._C.CudaError (a subclass of fastpipe._C.Error)
//   std::invalid_argument -> ValueError (pybind11's default mapping)
#pragma once

#include <stdexcept>
#include <string>

namespace fastpipe {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CudaError : Error {
  CudaError(int error_code, const std::string& msg) : Error(msg), code(error_code) {}
  int code;
};

}  // namespace fastpipe
