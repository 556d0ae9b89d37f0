// The C++ half of libgmlake.so. PyTorch calls the allocator through C++ std::function objects:
// an allocation failure must surface as a C++ exception (returning NULL would hand PyTorch a
// null tensor and poison the CUDA context later), and begin-allocate-to-pool passes a
// std::function filter by value. Rust cannot throw or hold either, so these few functions do.
#include <cstddef>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>

// cudaStream_t is `CUstream_st*`; declaring the struct spares a dependency on CUDA's headers
// while keeping the filter's type exactly PyTorch's std::function<bool(cudaStream_t)>.
struct CUstream_st;

namespace {

// The message starts like PyTorch's own, so code that looks for "CUDA out of memory." in a
// RuntimeError (batch-size finders, for example) recognises it.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using StreamFilter = std::function<bool(CUstream_st*)>;

}  // namespace

extern "C" {

// Throws the allocator's failure as a C++ exception; never returns.
[[noreturn]] void gmlake_cxx_throw(int out_of_memory, const char* message) {
  std::string text = message != nullptr ? message : "glake: allocation failed";
  if (out_of_memory != 0) {
    throw OutOfMemory(text);
  }
  throw std::runtime_error(text);
}

// Moves a filter out of the caller's by-value parameter into a heap object the allocator
// keeps until the routing ends. NULL when memory is exhausted.
void* gmlake_cxx_filter_take(void* filter) {
  auto* source = static_cast<StreamFilter*>(filter);
  return new (std::nothrow) StreamFilter(std::move(*source));
}

// 1 when the filter selects `stream`, 0 when not, -1 when the filter is empty or threw.
int gmlake_cxx_filter_call(void* filter, void* stream) {
  auto* f = static_cast<StreamFilter*>(filter);
  if (f == nullptr || !*f) {
    return -1;
  }
  try {
    return (*f)(static_cast<CUstream_st*>(stream)) ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

void gmlake_cxx_filter_drop(void* filter) { delete static_cast<StreamFilter*>(filter); }

}  // extern "C"
