// Calls libgmlake.so the way PyTorch does, with torch 2.x's C++ signatures (std::function
// filter by value, MempoolId_t as a pair), on the host backend. Exits nonzero on the first
// failed check.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
using cudaStream_t = CUstream_st*;
using MempoolId = std::pair<unsigned long long, unsigned long long>;

extern "C" {
void* gmlake_malloc(size_t size, int device, cudaStream_t stream);
void gmlake_free(void* ptr, size_t size, int device, cudaStream_t stream);
void gmlake_init(int device_count);
void gmlake_reset();
void gmlake_memory_fraction(double fraction, int device);
void* gmlake_base_alloc(void* ptr, size_t* size);
void gmlake_record_stream(void* ptr, cudaStream_t stream);
void gmlake_begin_allocate_to_pool(int device, MempoolId id, std::function<bool(cudaStream_t)> filter);
void gmlake_end_allocate_to_pool(int device, MempoolId id);
void gmlake_release_pool(int device, MempoolId id);
int gmlake_stats_json(int device, char** out);
void glake_string_free(char* text);
}

static int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

static long long stat(const char* key) {
  char* json = nullptr;
  if (gmlake_stats_json(0, &json) != 0) return -1;
  std::string text(json);
  glake_string_free(json);
  std::string needle = std::string("\"") + key + "\":";
  size_t at = text.find(needle);
  return at == std::string::npos ? -1 : std::atoll(text.c_str() + at + needle.size());
}

int main() {
  const size_t MiB = 1 << 20;
  gmlake_init(1);

  // Plain allocations; an empty tensor gets NULL, and freeing NULL is harmless.
  void* a = gmlake_malloc(3 * MiB + 5, 0, nullptr);
  CHECK(a != nullptr);
  CHECK(gmlake_malloc(0, 0, nullptr) == nullptr);
  gmlake_free(nullptr, 0, 0, nullptr);
  // Rounded to 512 bytes, not to the 2 MiB granule.
  const long long rounded = 3 * MiB + 512;
  CHECK(stat("allocated_bytes.all.current") == rounded);
  size_t base_size = 0;
  CHECK(gmlake_base_alloc(static_cast<char*>(a) + 100, &base_size) == a);
  CHECK(base_size == static_cast<size_t>(rounded));
  gmlake_free(a, 3 * MiB + 5, 0, nullptr);
  CHECK(stat("allocated_bytes.all.current") == 0);
  CHECK(stat("allocated_bytes.all.peak") == rounded);

  // Misuse: a free of a stray pointer is ignored (free never throws); the others throw.
  gmlake_free(reinterpret_cast<void*>(0x1000), 1, 0, nullptr);
  bool threw = false;
  try {
    gmlake_record_stream(reinterpret_cast<void*>(0x1000), nullptr);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    gmlake_memory_fraction(1.5, 0);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);

  // Out of memory is a C++ exception reading like PyTorch's; the next allocation works.
  gmlake_memory_fraction(0.5, 0);
  threw = false;
  try {
    gmlake_malloc(static_cast<size_t>(1) << 40, 0, nullptr);
  } catch (const std::runtime_error& e) {
    threw = std::strncmp(e.what(), "CUDA out of memory.", 19) == 0;
  }
  CHECK(threw);
  CHECK(stat("num_ooms") == 1);
  void* b = gmlake_malloc(MiB, 0, nullptr);
  CHECK(b != nullptr);
  gmlake_free(b, MiB, 0, nullptr);
  gmlake_memory_fraction(1.0, 0);

  // A graph pool: requests on streams the filter selects go to the pool's own memory, which
  // stays apart until the pool is released.
  MempoolId id{5, 0};
  int filter_calls = 0;
  gmlake_begin_allocate_to_pool(0, id, [&](cudaStream_t stream) {
    ++filter_calls;
    return stream == nullptr;
  });
  void* captured = gmlake_malloc(8 * MiB, 0, nullptr);
  CHECK(filter_calls == 1);
  gmlake_free(captured, 8 * MiB, 0, nullptr);
  gmlake_reset();  // empty_cache during a capture releases nothing
  gmlake_end_allocate_to_pool(0, id);
  void* outside = gmlake_malloc(8 * MiB, 0, nullptr);
  CHECK(outside != captured);
  CHECK(filter_calls == 1);  // no routing after the end: the filter is not asked
  gmlake_release_pool(0, id);
  // A replay queued before the release may still use the pool's memory: with `outside` still
  // live, a request gets new memory, not the released 8 MiB.
  void* fresh = gmlake_malloc(8 * MiB, 0, nullptr);
  CHECK(fresh != captured);
  gmlake_free(fresh, 8 * MiB, 0, nullptr);
  gmlake_free(outside, 8 * MiB, 0, nullptr);
  gmlake_release_pool(0, MempoolId{99, 99});  // unknown: logged, never thrown

  threw = false;
  try {
    gmlake_end_allocate_to_pool(0, MempoolId{77, 0});
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);

  gmlake_reset();
  CHECK(stat("reserved_bytes.all.current") == 0);
  if (failures == 0) std::printf("plug-in ABI checks passed\n");
  return failures == 0 ? 0 : 1;
}
