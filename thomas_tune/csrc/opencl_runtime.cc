// thomas_tune's OpenCL runtime for the pinned apache-tvm wheel (built with USE_OPENCL=OFF).
//
// It registers what TVM looks up by name when it meets OpenCL:
//   device_api.opencl                    the device API (discovery, memory, copies, sync, attrs)
//   ffi.Module.load_from_bytes.opencl    the loader of the "opencl" module that tvm.compile
//                                        embeds in an exported library
//   thomas_tune.opencl.*                 device listing and selection helpers for Python
//
// Device selection: environment variable THOMAS_TUNE_OPENCL_PLATFORM (index or a substring of
// the platform name, e.g. "Portable" for PoCL, "NVIDIA"), else every platform's devices in
// order. tvm.opencl(i) is the i-th device of the selected platforms.
//
// Memory: a device pointer is the cl_mem handle itself; views with a byte offset are not used
// by thomas_tune's graphs and are refused with a clear error.
//
// Programs: one per group of kernels. TVM's code generator marks each kernel with a
// "// Function: NAME" line; the sidecar deals the kernels into kProgramGroups groups by a hash of
// their names, contraction kernels (convolutions, matrix products) into groups of their own,
// and a group's program is the module's shared header (what precedes the first kernel's
// definition, less the kernel prototypes) and its kernels' definitions in name order, built the
// first time one of them is used. Why groups: a program costs a fixed ~0.2 s to build on PoCL
// whatever it holds, and PoCL compiles a kernel at its first launch from the whole program that
// holds it, so one program of a training step's ~500 kernels costs time quadratic in its size.
// Why by name: two modules that hold the same kernels then build the same programs for every
// group their differences miss, which the caches below and the driver's own (PoCL's kernel
// cache) serve once. Why contractions apart: a tuned and an untuned build of one training step
// differ mostly in contraction kernels (the ones a tuner tunes), so the groups of the other
// kernels stay the same programs; dealt by name alone, nearly every group held some changed
// kernel. A source without the markers, or a group whose program fails to build, uses the whole
// module's source as one program.
//
// Program binaries: each program is built from source once per device and its
// binary (clGetProgramInfo(CL_PROGRAM_BINARIES)) written to a cache folder, keyed by platform,
// device, device and driver versions and the kernel source; the next process that loads the same
// module creates the program from that binary (clCreateProgramWithBinary), so it compiles no
// OpenCL C. Folder: THOMAS_TUNE_OPENCL_CACHE ("off" disables the cache), else
// $THOMAS_TUNE_CACHE/opencl, else ~/.cache/thomas_tune/opencl. On a driver that keeps its own
// kernel cache (PoCL: DriverCachesKernels) no binaries are written or read unless
// THOMAS_TUNE_OPENCL_CACHE names a folder. A cache file is written to a
// temporary name and renamed (readers never see a partial file); one whose header, size or
// checksum is wrong, or that the driver rejects, is reported on stderr and the program is built
// from source and cached again. thomas_tune.opencl.stats counts builds, cache loads, rejections
// and kernel launches.
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <tvm/ffi/cast.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/accessor.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>


namespace thomas_tune {
namespace opencl {

using tvm::ffi::Any;
using tvm::ffi::PackedArgs;
using tvm::runtime::DeviceAPI;
using tvm::runtime::DeviceAttrKind;
using Device = DLDevice;

const char* ErrorName(cl_int e) {
  switch (e) {
    case CL_SUCCESS: return "CL_SUCCESS";
    case CL_DEVICE_NOT_FOUND: return "CL_DEVICE_NOT_FOUND";
    case CL_MEM_OBJECT_ALLOCATION_FAILURE: return "CL_MEM_OBJECT_ALLOCATION_FAILURE";
    case CL_OUT_OF_RESOURCES: return "CL_OUT_OF_RESOURCES";
    case CL_OUT_OF_HOST_MEMORY: return "CL_OUT_OF_HOST_MEMORY";
    case CL_BUILD_PROGRAM_FAILURE: return "CL_BUILD_PROGRAM_FAILURE";
    case CL_INVALID_VALUE: return "CL_INVALID_VALUE";
    case CL_INVALID_BUFFER_SIZE: return "CL_INVALID_BUFFER_SIZE";
    case CL_INVALID_KERNEL_ARGS: return "CL_INVALID_KERNEL_ARGS";
    case CL_INVALID_WORK_GROUP_SIZE: return "CL_INVALID_WORK_GROUP_SIZE";
    case CL_INVALID_WORK_ITEM_SIZE: return "CL_INVALID_WORK_ITEM_SIZE";
    case CL_INVALID_MEM_OBJECT: return "CL_INVALID_MEM_OBJECT";
    case CL_INVALID_KERNEL_NAME: return "CL_INVALID_KERNEL_NAME";
    default: return "CL error";
  }
}

#define TT_CL_CHECK(expr, what)                                                          \
  do {                                                                                   \
    cl_int _e = (expr);                                                                  \
    if (_e != CL_SUCCESS) {                                                              \
      TVM_FFI_THROW(RuntimeError) << "OpenCL: " << what << " failed: " << ErrorName(_e) \
                                  << " (" << _e << ")";                                  \
    }                                                                                    \
  } while (0)

struct Dev {
  cl_platform_id platform;
  cl_device_id id;
  std::string name, platform_name;
  cl_context context = nullptr;
  cl_command_queue queue = nullptr;
};

std::string DeviceString(cl_device_id d, cl_device_info key) {
  size_t n = 0;
  clGetDeviceInfo(d, key, 0, nullptr, &n);
  std::string s(n, '\0');
  clGetDeviceInfo(d, key, n, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::string PlatformString(cl_platform_id p, cl_platform_info key) {
  size_t n = 0;
  clGetPlatformInfo(p, key, 0, nullptr, &n);
  std::string s(n, '\0');
  clGetPlatformInfo(p, key, n, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

thread_local int current_device = 0;

// Kernel events recorded between a device timer's Start and Stop (this thread's launches).
struct Recording {
  bool on = false;
  std::vector<cl_event> events;
};
thread_local Recording recording;

// Counters for tests and benchmarks (thomas_tune.opencl.stats). device_bytes: bytes of the
// buffers allocated on the devices and not yet released (pooled workspaces included: they hold
// device memory); device_peak_bytes: the largest device_bytes since the last reset_peak;
// launch_arg_bytes: the sizes of the buffers given to each launched kernel, summed over
// launches (what the kernels may read and write: an upper bound of their traffic).
struct Stats {
  std::atomic<int64_t> source_builds{0}, binary_loads{0}, binary_rejected{0}, binary_writes{0},
      write_failures{0}, launches{0};
  std::atomic<int64_t> source_build_ns{0}, binary_load_ns{0};
  std::atomic<int64_t> device_bytes{0}, device_peak_bytes{0}, launch_arg_bytes{0};

  void Allocated(int64_t n) {
    int64_t now = device_bytes.fetch_add(n) + n;
    int64_t peak = device_peak_bytes.load();
    while (now > peak && !device_peak_bytes.compare_exchange_weak(peak, now)) {
    }
  }
};
Stats stats;

int64_t BufferBytes(cl_mem m) {
  size_t n = 0;
  if (m == nullptr || clGetMemObjectInfo(m, CL_MEM_SIZE, sizeof(n), &n, nullptr) != CL_SUCCESS)
    return 0;
  return static_cast<int64_t>(n);
}

// FNV-1a, 64 bit (Fowler, Noll, Vo; http://www.isthe.com/chongo/tech/comp/fnv/), with a seed
// folded into the offset basis so that two seeds give two independent 64-bit halves of a key.
uint64_t Fnv1a(const void* data, size_t n, uint64_t seed) {
  uint64_t h = 14695981039346656037ull ^ (seed * 0x9E3779B97F4A7C15ull);
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The cache folder, or "" when caching is off (or no home folder is known).
std::string BinaryCacheDir() {
  const char* explicit_dir = std::getenv("THOMAS_TUNE_OPENCL_CACHE");
  if (explicit_dir != nullptr && *explicit_dir != '\0') {
    std::string s(explicit_dir);
    if (s == "off" || s == "0" || s == "none") return "";
    return s;
  }
  const char* base = std::getenv("THOMAS_TUNE_CACHE");
  if (base != nullptr && *base != '\0') return std::string(base) + "/opencl";
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/thomas_tune/opencl";
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') return "";
  return std::string(home) + "/.cache/thomas_tune/opencl";
}

// True when the driver of ``platform_name`` keeps a kernel cache of its own that serves what
// a program binary would: PoCL (platform "Portable Computing Language") caches each program's
// bitcode and each kernel compiled for its launch's work-group size under ~/.cache/pocl unless
// POCL_KERNEL_CACHE=0. On PoCL, asking for CL_PROGRAM_BINARIES makes the driver compile every
// kernel of the program once more, for a work-group size unknown until launch, on top of the
// compile at its first launch (docs/opencl.md).
bool DriverCachesKernels(const std::string& platform_name) {
  if (platform_name.find("Portable Computing Language") == std::string::npos) return false;
  const char* pocl_cache = std::getenv("POCL_KERNEL_CACHE");
  return pocl_cache == nullptr || std::string(pocl_cache) != "0";
}

// The cache folder for programs of a device of ``platform_name``: BinaryCacheDir() when
// THOMAS_TUNE_OPENCL_CACHE names a folder, or when the driver keeps no kernel cache of its own
// (DriverCachesKernels); otherwise "" (no binaries read or written).
std::string BinaryCacheDirFor(const std::string& platform_name) {
  const char* explicit_dir = std::getenv("THOMAS_TUNE_OPENCL_CACHE");
  bool named = explicit_dir != nullptr && *explicit_dir != '\0';
  if (!named && DriverCachesKernels(platform_name)) return "";
  return BinaryCacheDir();
}

// Options passed to clBuildProgram: $THOMAS_TUNE_OPENCL_OPTIONS (e.g. "-cl-mad-enable", or
// NVIDIA's "-cl-nv-verbose", which puts each kernel's register and spill counts in the build
// log), "" when unset. Part of a cached binary's key.
const std::string& BuildOptions() {
  static const std::string options = [] {
    const char* o = std::getenv("THOMAS_TUNE_OPENCL_OPTIONS");
    return std::string(o == nullptr ? "" : o);
  }();
  return options;
}

// Warm-up share, $THOMAS_TUNE_OPENCL_WARM = "I/N" (0 <= I < N): this process only fills the
// driver's kernel cache for a later process. It launches only the kernels of the program
// groups G with G % N == I, each as a single work-group (the work-group size, which the
// compile depends on, as asked), and skips the others; outputs are not computed. N processes
// with I = 0..N-1 running one training step share the compiles of its kernels (PoCL compiles a
// kernel at its first launch, on one core), and the next process to run the step finds them
// all in the cache (thomas_tune.demo.build_device_programs). {-1, 0} when unset or malformed.
struct WarmShare {
  int index = -1, count = 0;
};

const WarmShare& Warm() {
  static const WarmShare share = [] {
    WarmShare w;
    const char* v = std::getenv("THOMAS_TUNE_OPENCL_WARM");
    int i = -1, n = 0;
    if (v != nullptr && std::sscanf(v, "%d/%d", &i, &n) == 2 && n > 0 && i >= 0 && i < n) {
      w.index = i;
      w.count = n;
    }
    return w;
  }();
  return share;
}

// $THOMAS_TUNE_OPENCL_BUILD_LOG, or nullptr when unset. AppendBuildLog appends the compiler's
// log of a program built from source to that file, after a line naming the program's kernels;
// the driver's log is otherwise read only when a build fails.
const char* BuildLogPath() {
  const char* path = std::getenv("THOMAS_TUNE_OPENCL_BUILD_LOG");
  return path == nullptr || *path == '\0' ? nullptr : path;
}

void AppendBuildLog(const char* path, cl_program prog, cl_device_id dev,
                    const std::string& kernels) {
  size_t n = 0;
  clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
  std::string log(n, '\0');
  if (n > 0) clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  std::ofstream f(path, std::ios::app);
  f << "== program of " << kernels << " (options \"" << BuildOptions() << "\")\n" << log << "\n";
}

constexpr char kBinaryMagic[8] = {'T', 'T', 'C', 'L', 'B', 'I', 'N', '1'};
constexpr size_t kBinaryHeader = 8 + 8 + 8;  // magic, binary size, checksum of the binary

// Reads a cache file: the binary, or "" with ``why`` set when the file is absent (why empty)
// or damaged (why says how).
std::string ReadBinaryFile(const std::string& path, std::string* why) {
  why->clear();
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (data.size() < kBinaryHeader || std::memcmp(data.data(), kBinaryMagic, 8) != 0) {
    *why = "not a thomas_tune program binary (bad header)";
    return "";
  }
  uint64_t size, sum;
  std::memcpy(&size, data.data() + 8, 8);
  std::memcpy(&sum, data.data() + 16, 8);
  if (size != data.size() - kBinaryHeader) {
    *why = "truncated or padded (size " + std::to_string(data.size() - kBinaryHeader) +
           " bytes, header says " + std::to_string(size) + ")";
    return "";
  }
  std::string bin = data.substr(kBinaryHeader);
  if (Fnv1a(bin.data(), bin.size(), 0) != sum) {
    *why = "checksum mismatch";
    return "";
  }
  return bin;
}

// Writes a cache file atomically (temporary name in the same folder, then rename); false on
// any failure (the cache is an optimisation: failures are counted, never raised).
bool WriteBinaryFile(const std::string& dir, const std::string& path, const std::string& bin) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return false;
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                    Hex(std::hash<std::thread::id>()(std::this_thread::get_id()));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return false;
    uint64_t size = bin.size(), sum = Fnv1a(bin.data(), bin.size(), 0);
    f.write(kBinaryMagic, 8);
    f.write(reinterpret_cast<const char*>(&size), 8);
    f.write(reinterpret_cast<const char*>(&sum), 8);
    f.write(bin.data(), static_cast<std::streamsize>(bin.size()));
    f.flush();
    if (!f) {
      f.close();
      std::remove(tmp.c_str());
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

int64_t NanosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              t0).count();
}

class Workspace final : public DeviceAPI {
 public:
  static Workspace* Global() {
    static Workspace* inst = new Workspace();  // never destroyed: outlives static modules
    return inst;
  }

  std::vector<Dev>& Devices() {
    std::call_once(init_, [this] { Discover(); });
    return devices_;
  }

  Dev& Get(int index) {
    auto& devs = Devices();
    if (devs.empty()) {
      TVM_FFI_THROW(RuntimeError)
          << "OpenCL: no device found" << filter_note_
          << ". Install an OpenCL driver (PoCL: apt-get install pocl-opencl-icd) or set "
             "THOMAS_TUNE_OPENCL_PLATFORM to a platform that has devices";
    }
    if (index < 0 || index >= static_cast<int>(devs.size())) {
      TVM_FFI_THROW(IndexError) << "OpenCL: device " << index << " does not exist; "
                                << devs.size() << " device(s): " << Listing();
    }
    Dev& d = devs[index];
    std::lock_guard<std::mutex> lock(mu_);
    if (d.context == nullptr) {
      cl_int err;
      d.context = clCreateContext(nullptr, 1, &d.id, nullptr, nullptr, &err);
      TT_CL_CHECK(err, "clCreateContext on " << d.name);
      d.queue = clCreateCommandQueue(d.context, d.id, CL_QUEUE_PROFILING_ENABLE, &err);
      TT_CL_CHECK(err, "clCreateCommandQueue on " << d.name);
    }
    return d;
  }

  std::string Listing() {
    std::ostringstream os;
    auto& devs = Devices();
    for (size_t i = 0; i < devs.size(); ++i) {
      os << (i ? "; " : "") << i << ": " << devs[i].name << " [" << devs[i].platform_name << "]";
    }
    return os.str();
  }

  // ---- DeviceAPI ----------------------------------------------------------------------------
  void SetDevice(Device dev) final {
    Get(dev.device_id);
    current_device = dev.device_id;
  }

  void GetAttr(Device dev, DeviceAttrKind kind, Any* rv) final {
    auto& devs = Devices();
    if (kind == tvm::runtime::kExist) {
      *rv = static_cast<int64_t>(dev.device_id >= 0 &&
                                 dev.device_id < static_cast<int>(devs.size()));
      return;
    }
    cl_device_id d = Get(dev.device_id).id;
    switch (kind) {
      case tvm::runtime::kMaxThreadsPerBlock: {
        size_t v;
        clGetDeviceInfo(d, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof(v), &v, nullptr);
        *rv = static_cast<int64_t>(v);
        break;
      }
      case tvm::runtime::kWarpSize:
        *rv = static_cast<int64_t>(1);  // OpenCL has no portable sub-group size: TVM's convention
        break;
      case tvm::runtime::kMaxSharedMemoryPerBlock: {
        cl_ulong v;
        clGetDeviceInfo(d, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(v), &v, nullptr);
        *rv = static_cast<int64_t>(v);
        break;
      }
      case tvm::runtime::kComputeVersion:
        *rv = tvm::ffi::String(DeviceString(d, CL_DEVICE_VERSION));
        break;
      case tvm::runtime::kDeviceName:
        *rv = tvm::ffi::String(DeviceString(d, CL_DEVICE_NAME));
        break;
      case tvm::runtime::kMaxClockRate: {
        cl_uint v;
        clGetDeviceInfo(d, CL_DEVICE_MAX_CLOCK_FREQUENCY, sizeof(v), &v, nullptr);
        *rv = static_cast<int64_t>(v) * 1000;  // kHz, as TVM's other device APIs
        break;
      }
      case tvm::runtime::kMultiProcessorCount: {
        cl_uint v;
        clGetDeviceInfo(d, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(v), &v, nullptr);
        *rv = static_cast<int64_t>(v);
        break;
      }
      case tvm::runtime::kMaxThreadDimensions: {
        size_t dims[3] = {1, 1, 1};
        clGetDeviceInfo(d, CL_DEVICE_MAX_WORK_ITEM_SIZES, sizeof(dims), dims, nullptr);
        std::ostringstream os;
        os << "[" << dims[0] << ", " << dims[1] << ", " << dims[2] << "]";
        *rv = tvm::ffi::String(os.str());
        break;
      }
      case tvm::runtime::kDriverVersion:
        *rv = tvm::ffi::String(DeviceString(d, CL_DRIVER_VERSION));
        break;
      case tvm::runtime::kTotalGlobalMemory: {
        cl_ulong v;
        clGetDeviceInfo(d, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof(v), &v, nullptr);
        *rv = static_cast<int64_t>(v);
        break;
      }
      default:
        break;  // unknown attributes stay None
    }
  }

  void* AllocDataSpace(Device dev, size_t nbytes, size_t alignment, DLDataType) final {
    Dev& d = Get(dev.device_id);
    cl_ulong max_alloc = 0;
    clGetDeviceInfo(d.id, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof(max_alloc), &max_alloc, nullptr);
    if (max_alloc != 0 && nbytes > max_alloc) {
      TVM_FFI_THROW(RuntimeError) << "OpenCL: allocating " << nbytes << " bytes on " << d.name
                                  << " [" << d.platform_name << "] exceeds its largest buffer ("
                                  << max_alloc << " bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE): out "
                                  << "of device memory; use a smaller batch or model";
    }
    cl_int err;
    cl_mem m = clCreateBuffer(d.context, CL_MEM_READ_WRITE, nbytes == 0 ? 1 : nbytes, nullptr,
                              &err);
    TT_CL_CHECK(err, "allocating " << nbytes << " bytes on " << d.name
                                   << " (device out of memory?)");
    stats.Allocated(static_cast<int64_t>(nbytes == 0 ? 1 : nbytes));
    return m;
  }

  void FreeDataSpace(Device dev, void* ptr) final {
    if (ptr == nullptr) return;
    stats.device_bytes -= BufferBytes(static_cast<cl_mem>(ptr));
    clReleaseMemObject(static_cast<cl_mem>(ptr));
  }

  // Workspaces (a kernel's intermediate buffers, e.g. the partial sums of a split reduction)
  // are kept for reuse: the host code of a kernel allocates and frees them at every call, and
  // a fresh clCreateBuffer per call costs more than many of the kernels themselves. A freed
  // buffer may be handed out again while kernels that used it are still queued: the device's
  // one in-order queue runs the next user after them.
  void* AllocWorkspace(Device dev, size_t nbytes, DLDataType type_hint) final {
    {
      std::lock_guard<std::mutex> lock(pool_mu_);
      auto& free = pool_free_[dev.device_id];
      auto it = free.lower_bound(nbytes);
      if (it != free.end() && it->first <= 2 * nbytes + 4096) {
        void* ptr = it->second;
        free.erase(it);
        return ptr;
      }
    }
    void* ptr = AllocDataSpace(dev, nbytes, tvm::runtime::kTempAllocaAlignment, type_hint);
    std::lock_guard<std::mutex> lock(pool_mu_);
    pool_size_[ptr] = nbytes;
    return ptr;
  }

  void FreeWorkspace(Device dev, void* ptr) final {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto it = pool_size_.find(ptr);
    if (it == pool_size_.end()) {  // not from AllocWorkspace: release it as data space
      FreeDataSpace(dev, ptr);
      return;
    }
    pool_free_[dev.device_id].emplace(it->second, ptr);
  }

  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset,
                      size_t size, Device dev_from, Device dev_to, DLDataType,
                      TVMStreamHandle) final {
    if (size == 0) return;
    bool from_cl = dev_from.device_type == kDLOpenCL;
    bool to_cl = dev_to.device_type == kDLOpenCL;
    if (from_cl && to_cl) {
      Dev& d = Get(dev_from.device_id);
      TT_CL_CHECK(clEnqueueCopyBuffer(d.queue, (cl_mem)from, (cl_mem)to, from_offset,
                                      to_offset, size, 0, nullptr, nullptr),
                  "device-to-device copy");
    } else if (from_cl) {
      Dev& d = Get(dev_from.device_id);
      TT_CL_CHECK(clEnqueueReadBuffer(d.queue, (cl_mem)from, CL_TRUE, from_offset, size,
                                      static_cast<char*>(to) + to_offset, 0, nullptr, nullptr),
                  "device-to-host copy");
    } else if (to_cl) {
      Dev& d = Get(dev_to.device_id);
      TT_CL_CHECK(clEnqueueWriteBuffer(d.queue, (cl_mem)to, CL_TRUE, to_offset, size,
                                       static_cast<const char*>(from) + from_offset, 0,
                                       nullptr, nullptr),
                  "host-to-device copy");
    } else {
      std::memcpy(static_cast<char*>(to) + to_offset,
                  static_cast<const char*>(from) + from_offset, size);
    }
  }

  void StreamSync(Device dev, TVMStreamHandle) final {
    TT_CL_CHECK(clFinish(Get(dev.device_id).queue), "clFinish");
  }

 private:
  void Discover() {
    cl_uint np = 0;
    cl_int err = clGetPlatformIDs(0, nullptr, &np);
    if (err != CL_SUCCESS || np == 0) {
      filter_note_ = " (no OpenCL platform: the ICD loader found none)";
      return;
    }
    std::vector<cl_platform_id> plats(np);
    clGetPlatformIDs(np, plats.data(), nullptr);
    const char* want = std::getenv("THOMAS_TUNE_OPENCL_PLATFORM");
    std::string filter = want ? want : "";
    if (!filter.empty()) filter_note_ = " on platforms matching '" + filter + "'";
    for (cl_uint i = 0; i < np; ++i) {
      std::string pname = PlatformString(plats[i], CL_PLATFORM_NAME);
      if (!filter.empty()) {
        bool is_index = filter.find_first_not_of("0123456789") == std::string::npos;
        if (is_index ? std::stoul(filter) != i : pname.find(filter) == std::string::npos) {
          continue;
        }
      }
      cl_uint nd = 0;
      if (clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 0, nullptr, &nd) != CL_SUCCESS) continue;
      std::vector<cl_device_id> ids(nd);
      clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, nd, ids.data(), nullptr);
      for (cl_device_id id : ids) {
        Dev d;
        d.platform = plats[i];
        d.id = id;
        d.name = DeviceString(id, CL_DEVICE_NAME);
        d.platform_name = pname;
        devices_.push_back(d);
      }
    }
  }

  std::once_flag init_;
  std::mutex mu_;
  std::vector<Dev> devices_;
  std::mutex pool_mu_;
  std::unordered_map<int, std::multimap<size_t, void*>> pool_free_;  // device -> size -> buffer
  std::unordered_map<void*, size_t> pool_size_;                       // every pooled buffer
  std::string filter_note_;
};

// ---- the "opencl" module ---------------------------------------------------------------------
struct FunctionInfo {
  std::string name;
  std::vector<DLDataType> arg_types;
  std::vector<std::string> launch_param_tags;
  std::vector<int32_t> arg_extra_tags;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  uint64_t U64() {
    uint64_t v;
    Need(8);
    std::memcpy(&v, s_.data() + pos_, 8);
    pos_ += 8;
    return v;
  }
  std::string Str() {
    uint64_t n = U64();
    Need(n);
    std::string out = s_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  template <typename T>
  T Pod() {
    T v;
    Need(sizeof(T));
    std::memcpy(&v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

 private:
  void Need(uint64_t n) {
    if (pos_ + n > s_.size()) {
      TVM_FFI_THROW(ValueError) << "OpenCL module: serialized blob is truncated (wanted " << n
                                << " bytes at offset " << pos_ << " of " << s_.size() << ")";
    }
  }
  const std::string& s_;
  size_t pos_ = 0;
};

class OpenCLModuleObj;

// One kernel: its program is built once per device; kernel objects are cached per device and
// thread (a cl_kernel holds its arguments, so threads must not share one).
class KernelLauncher {
 public:
  // Launch tags name the extents the host code passes after the kernel arguments, in order:
  // "blockIdx.{x,y,z}" (work-groups per dimension) and "threadIdx.{x,y,z}" (work-group size).
  KernelLauncher(OpenCLModuleObj* m, FunctionInfo info)
      : m_(m), info_(std::move(info)), id_(next_id_.fetch_add(1) + 1) {
    for (const std::string& tag : info_.launch_param_tags) {
      int rank = -1;
      if (tag.rfind("blockIdx.", 0) == 0) rank = 0;
      if (tag.rfind("threadIdx.", 0) == 0) rank = 1;
      if (rank < 0 || tag.size() != (rank == 0 ? 10u : 11u) || tag.back() < 'x' ||
          tag.back() > 'z') {
        TVM_FFI_THROW(ValueError) << "OpenCL kernel " << info_.name << ": launch tag '" << tag
                                  << "' is not supported (blockIdx.* / threadIdx.* only)";
      }
      int dim = tag.back() - 'x';
      slots_.push_back(rank * 3 + dim);
      work_dim_ = std::max(work_dim_, dim + 1);
    }
  }
  void operator()(PackedArgs args, Any* rv) const;

 private:
  // The kernel object of this launcher for (calling thread, device): a per-thread cache of a
  // few entries, keyed by the launcher's unique id, in front of the module's map (whose key is
  // a string built per call, under a mutex). A training step launches ~1,700 kernels.
  cl_kernel CachedKernel(int dev_id) const;

  OpenCLModuleObj* m_;
  FunctionInfo info_;
  std::vector<int> slots_;
  int work_dim_ = 1;
  uint64_t id_;
  static std::atomic<uint64_t> next_id_;
};

std::atomic<uint64_t> KernelLauncher::next_id_{0};

constexpr uint64_t kProgramGroups = 32;
// Of the kProgramGroups, the groups of contraction kernels (see IsContraction).
constexpr uint64_t kContractionGroups = 8;

// True for the kernels of contractions: convolutions (conv2d, its transposes and Winograd
// forms, the depthwise gradients) and matrix products (matmul, dense), by the operator names
// that TVM's kernel names carry ("fused_conv2d3_add44_..._kernel"). A tuner spends its trials on
// them, the costliest kernels of a step; the elementwise, reduction and optimizer kernels
// around them mostly keep their default schedules in a tuned build.
bool IsContraction(const std::string& name) {
  for (const char* op : {"conv2d", "depthwise", "matmul", "dense"}) {
    if (name.find(op) != std::string::npos) return true;
  }
  return false;
}

// The group of kernel ``name`` (see "Programs" at the top): contraction kernels in groups
// 0..kContractionGroups-1, the others in the rest, each by a hash of the name.
uint64_t GroupOf(const std::string& name) {
  uint64_t h = Fnv1a(name.data(), name.size(), 3);
  if (IsContraction(name)) return h % kContractionGroups;
  return kContractionGroups + h % (kProgramGroups - kContractionGroups);
}

// The program sources of a module's OpenCL C by group (see "Programs" at the top): group ->
// header + each member's "// Function: NAME" line and definition, in name order. Empty when
// the source carries no "// Function: " markers or a section's definition cannot be found.
std::unordered_map<uint64_t, std::string> SplitKernels(const std::string& source) {
  static const std::string kMark = "// Function: ";
  std::vector<size_t> marks;
  for (size_t p = source.find(kMark); p != std::string::npos; p = source.find(kMark, p + 1)) {
    if (p == 0 || source[p - 1] == '\n') marks.push_back(p);
  }
  std::unordered_map<uint64_t, std::string> out;
  if (marks.empty()) return out;
  std::string header = source.substr(0, marks[0]);
  std::map<std::string, std::string> defs;  // name -> definition text, in name order
  for (size_t i = 0; i < marks.size(); ++i) {
    size_t end = i + 1 < marks.size() ? marks[i + 1] : source.size();
    size_t eol = source.find('\n', marks[i]);
    if (eol == std::string::npos || eol >= end) return {};
    std::string name = source.substr(marks[i] + kMark.size(), eol - marks[i] - kMark.size());
    while (!name.empty() && (name.back() == '\r' || name.back() == ' ')) name.pop_back();
    // lines up to the definition: the first "__kernel" line that is not a prototype (";")
    size_t line = eol + 1, def = std::string::npos;
    while (line < end) {
      size_t next = source.find('\n', line);
      if (next == std::string::npos || next > end) next = end;
      std::string text = source.substr(line, next - line);
      while (!text.empty() && (text.back() == '\r' || text.back() == ' ')) text.pop_back();
      bool is_kernel = text.rfind("__kernel", 0) == 0;
      if (is_kernel && !text.empty() && text.back() != ';') {
        def = line;
        break;
      }
      if (!is_kernel && i == 0) header += text + "\n";  // pragmas, helpers: shared by all
      if (!is_kernel && i > 0 && !text.empty()) return {};  // text of unknown scope: no split
      line = next + 1;
    }
    if (def == std::string::npos || source.find(" " + name + "(", def) > source.find('\n', def) ||
        defs.count(name)) {
      return {};
    }
    defs[name] = source.substr(def, end - def);
  }
  for (auto& [name, body] : defs) {
    std::string& group = out[GroupOf(name)];
    if (group.empty()) group = header;
    group += kMark + name + "\n" + body;
  }
  return out;
}

// The OpenCL modules alive in this process. BuildPrograms tells them from other modules by
// this set, not by dynamic_cast: the TVM library's module classes may carry no type info, and a
// dynamic_cast on one of them crashes.
std::mutex live_modules_mutex;
std::unordered_set<const tvm::ffi::ModuleObj*> live_modules;

class OpenCLModuleObj : public tvm::ffi::ModuleObj {
 public:
  OpenCLModuleObj(std::string source, std::unordered_map<std::string, FunctionInfo> fmap,
                  std::string blob)
      : source_(std::move(source)), fmap_(std::move(fmap)), blob_(std::move(blob)),
        kernel_sources_(SplitKernels(source_)) {
    std::lock_guard<std::mutex> lock(live_modules_mutex);
    live_modules.insert(this);
  }

  ~OpenCLModuleObj() {
    {
      std::lock_guard<std::mutex> lock(live_modules_mutex);
      live_modules.erase(this);
    }
    for (auto& kv : kernels_) clReleaseKernel(kv.second);
    for (auto& kv : programs_) clReleaseProgram(kv.second);  // each held under one key
  }

  const char* kind() const final { return "opencl"; }
  int GetPropertyMask() const final {
    return tvm::ffi::Module::kBinarySerializable | tvm::ffi::Module::kRunnable;
  }

  tvm::ffi::Bytes SaveToBytes() const final { return tvm::ffi::Bytes(blob_); }

  tvm::ffi::String InspectSource(const tvm::ffi::String&) const final { return source_; }

  tvm::ffi::Optional<tvm::ffi::Function> GetFunction(const tvm::ffi::String& name) final {
    auto it = fmap_.find(std::string(name));
    if (it == fmap_.end()) return std::nullopt;
    auto launcher = std::make_shared<KernelLauncher>(this, it->second);
    // keep this module alive as long as the function lives
    tvm::ffi::ObjectPtr<tvm::ffi::Object> self = tvm::ffi::GetObjectPtr<tvm::ffi::Object>(this);
    return tvm::ffi::Function::FromPacked(
        [launcher, self](PackedArgs args, Any* rv) { (*launcher)(args, rv); });
  }

  // Builds (or loads from the cache) the programs of all this module's kernels for
  // ``device_id`` now, not at their first launch: a tuner's device server compiles a candidate
  // before it takes the device lock.
  void BuildProgram(int device_id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : fmap_) Program(device_id, kv.second.name);
    if (fmap_.empty()) Whole(device_id);  // a source with no function table still compiles
  }

  cl_kernel Kernel(int device_id, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream k;
    k << device_id << '/' << std::hash<std::thread::id>()(std::this_thread::get_id()) << '/'
      << name;
    auto it = kernels_.find(k.str());
    if (it != kernels_.end()) return it->second;
    cl_program prog = Program(device_id, name);
    cl_int err;
    cl_kernel kern = clCreateKernel(prog, name.c_str(), &err);
    TT_CL_CHECK(err, "clCreateKernel(" << name << ")");
    kernels_[k.str()] = kern;
    return kern;
  }

 private:
  // The program that holds kernel ``name`` on ``device_id``: its group's (see "Programs" at
  // the top), or the whole module's when the source was not split or the group's program
  // failed to build.
  cl_program Program(int device_id, const std::string& name) {
    uint64_t group = GroupOf(name);
    std::string key = std::to_string(device_id) + '/' + std::to_string(group);
    auto it = programs_.find(key);
    if (it != programs_.end()) return it->second;
    auto src = kernel_sources_.find(group);
    cl_program prog = nullptr;
    if (src != kernel_sources_.end() && !failed_.count(key) &&
        src->second.find("// Function: " + name + "\n") != std::string::npos) {
      try {
        prog = ProgramOf(device_id, src->second, KernelNames(group));
      } catch (const std::exception& e) {
        failed_.insert(key);
        std::cerr << "thomas_tune: the OpenCL program of kernel " << name << "'s group failed "
                  << "to build; building the module's whole source instead (" << e.what()
                  << ")" << std::endl;
      }
    }
    if (prog == nullptr) return Whole(device_id);  // not kept under the group's key
    programs_[key] = prog;
    return prog;
  }

  // The program of the module's whole source on ``device_id``.
  cl_program Whole(int device_id) {
    std::string key = std::to_string(device_id) + "/*";
    auto it = programs_.find(key);
    if (it != programs_.end()) return it->second;
    cl_program prog = ProgramOf(device_id, source_, KernelNames());
    programs_[key] = prog;
    return prog;
  }

  // The names of this module's kernels (of group ``group`` only, unless it is negative), in
  // name order, for the build log.
  std::string KernelNames(int64_t group = -1) const {
    std::vector<std::string> all;
    for (const auto& kv : fmap_) {
      if (group < 0 || GroupOf(kv.second.name) == static_cast<uint64_t>(group)) {
        all.push_back(kv.second.name);
      }
    }
    std::sort(all.begin(), all.end());
    std::string names;
    for (const std::string& n : all) names += (names.empty() ? "" : ", ") + n;
    return names;
  }

  // Builds ``source`` (or loads it from the binary cache) for ``device_id``; ``names`` are the
  // kernels it holds, for the build log.
  cl_program ProgramOf(int device_id, const std::string& source, const std::string& names) {
    Dev& d = Workspace::Global()->Get(device_id);
    std::string dir = BinaryCacheDirFor(d.platform_name), path;
    if (!dir.empty()) {
      // key: everything that makes a binary valid for this program on this device
      std::string key = "thomas_tune.clbin/1";
      for (const std::string& part :
           {PlatformString(d.platform, CL_PLATFORM_NAME),
            PlatformString(d.platform, CL_PLATFORM_VERSION), d.name,
            DeviceString(d.id, CL_DEVICE_VERSION), DeviceString(d.id, CL_DRIVER_VERSION),
            BuildOptions(), source}) {
        key += '\0';
        key += part;
      }
      path = dir + "/" + Hex(Fnv1a(key.data(), key.size(), 1)) +
             Hex(Fnv1a(key.data(), key.size(), 2)) + ".clbin";
      cl_program prog = FromBinary(d, path);
      if (prog != nullptr) return prog;
    }
    auto t0 = std::chrono::steady_clock::now();
    const char* src = source.c_str();
    size_t len = source.size();
    cl_int err;
    cl_program prog = clCreateProgramWithSource(d.context, 1, &src, &len, &err);
    TT_CL_CHECK(err, "clCreateProgramWithSource");
    err = clBuildProgram(prog, 1, &d.id, BuildOptions().c_str(), nullptr, nullptr);
    if (err != CL_SUCCESS) {
      size_t n = 0;
      clGetProgramBuildInfo(prog, d.id, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
      std::string log(n, '\0');
      clGetProgramBuildInfo(prog, d.id, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
      while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
      if (log.empty()) log = "(the compiler left no log)";
      clReleaseProgram(prog);
      TVM_FFI_THROW(RuntimeError) << "OpenCL: building the kernels failed on " << d.name << " ["
                                  << d.platform_name << "]: " << ErrorName(err)
                                  << "\nbuild log:\n" << log;
    }
    stats.source_builds++;
    stats.source_build_ns += NanosSince(t0);
    if (const char* log_path = BuildLogPath()) AppendBuildLog(log_path, prog, d.id, names);
    if (!path.empty()) ToBinary(d, prog, dir, path);
    return prog;
  }

  // The program from the cache file at ``path``, or nullptr (absent, damaged, or rejected by
  // the driver: then the caller builds from source and rewrites the file).
  cl_program FromBinary(Dev& d, const std::string& path) {
    auto t0 = std::chrono::steady_clock::now();
    std::string why;
    std::string bin = ReadBinaryFile(path, &why);
    if (bin.empty()) {
      if (!why.empty()) Reject(path, why);
      return nullptr;
    }
    const unsigned char* ptr = reinterpret_cast<const unsigned char*>(bin.data());
    size_t len = bin.size();
    cl_int status = CL_SUCCESS, err = CL_SUCCESS;
    cl_program prog = clCreateProgramWithBinary(d.context, 1, &d.id, &len, &ptr, &status, &err);
    if (err != CL_SUCCESS || status != CL_SUCCESS || prog == nullptr) {
      if (prog != nullptr) clReleaseProgram(prog);
      Reject(path, std::string("the driver refused the binary: ") +
                       ErrorName(err != CL_SUCCESS ? err : status));
      return nullptr;
    }
    err = clBuildProgram(prog, 1, &d.id, BuildOptions().c_str(), nullptr, nullptr);
    if (err != CL_SUCCESS) {
      clReleaseProgram(prog);
      Reject(path, std::string("building from the binary failed: ") + ErrorName(err));
      return nullptr;
    }
    stats.binary_loads++;
    stats.binary_load_ns += NanosSince(t0);
    return prog;
  }

  void Reject(const std::string& path, const std::string& why) {
    stats.binary_rejected++;
    std::cerr << "thomas_tune: OpenCL program cache file " << path << " not used (" << why
              << "); building from source" << std::endl;
  }

  // Writes the built program's binary to the cache (best effort).
  void ToBinary(Dev& d, cl_program prog, const std::string& dir, const std::string& path) {
    size_t size = 0;
    if (clGetProgramInfo(prog, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr) !=
            CL_SUCCESS ||
        size == 0) {
      stats.write_failures++;
      return;
    }
    std::string bin(size, '\0');
    unsigned char* ptr = reinterpret_cast<unsigned char*>(bin.data());
    if (clGetProgramInfo(prog, CL_PROGRAM_BINARIES, sizeof(ptr), &ptr, nullptr) != CL_SUCCESS) {
      stats.write_failures++;
      return;
    }
    if (WriteBinaryFile(dir, path, bin)) {
      stats.binary_writes++;
    } else {
      stats.write_failures++;
    }
  }

  std::string source_;
  std::unordered_map<std::string, FunctionInfo> fmap_;
  std::string blob_;
  std::unordered_map<uint64_t, std::string> kernel_sources_;  // group -> program source
  std::mutex mu_;
  std::unordered_map<std::string, cl_program> programs_;  // "device/group" or "device/*"
  std::unordered_set<std::string> failed_;                 // groups whose build failed
  std::unordered_map<std::string, cl_kernel> kernels_;
};

void KernelLauncher::operator()(PackedArgs args, Any* rv) const {
  const size_t n = info_.arg_types.size();
  if (static_cast<size_t>(args.size()) != n + slots_.size()) {
    TVM_FFI_THROW(ValueError) << "OpenCL kernel " << info_.name << ": expected " << n
                              << " arguments and " << slots_.size() << " launch extents, got "
                              << args.size() << " values";
  }
  const WarmShare& warm = Warm();
  if (warm.count > 0 && GroupOf(info_.name) % warm.count != static_cast<uint64_t>(warm.index)) {
    return;  // another warm-up process compiles this kernel
  }
  const TVMFFIAny* raw = reinterpret_cast<const TVMFFIAny*>(args.data());
  int dev_id = current_device;
  Dev& d = Workspace::Global()->Get(dev_id);
  cl_kernel k = CachedKernel(dev_id);
  for (size_t i = 0; i < n; ++i) {
    const DLDataType& t = info_.arg_types[i];
    cl_int err;
    if (t.code == kDLOpaqueHandle) {
      void* p = raw[i].v_ptr;
      if (raw[i].type_index == kTVMFFIDLTensorPtr) p = static_cast<DLTensor*>(p)->data;
      if (raw[i].type_index == kTVMFFITensor) p = TVMFFITensorGetDLTensorPtr(raw[i].v_obj)->data;
      cl_mem m = static_cast<cl_mem>(p);
      err = clSetKernelArg(k, i, sizeof(cl_mem), &m);
      stats.launch_arg_bytes += BufferBytes(m);
    } else if (t.code == kDLFloat && t.bits == 32) {
      float v = static_cast<float>(raw[i].v_float64);
      err = clSetKernelArg(k, i, sizeof(v), &v);
    } else if (t.code == kDLFloat && t.bits == 64) {
      double v = raw[i].v_float64;
      err = clSetKernelArg(k, i, sizeof(v), &v);
    } else if ((t.code == kDLInt || t.code == kDLUInt) && t.bits == 64) {
      int64_t v = raw[i].v_int64;
      err = clSetKernelArg(k, i, sizeof(v), &v);
    } else if (t.code == kDLInt || t.code == kDLUInt) {
      int32_t v = static_cast<int32_t>(raw[i].v_int64);
      err = clSetKernelArg(k, i, sizeof(v), &v);
    } else {
      TVM_FFI_THROW(ValueError) << "OpenCL kernel " << info_.name << ": argument " << i
                                << " has an unsupported type code " << int(t.code);
    }
    TT_CL_CHECK(err, "setting argument " << i << " of kernel " << info_.name);
  }
  size_t ext[6] = {1, 1, 1, 1, 1, 1};
  for (size_t j = 0; j < slots_.size(); ++j) {
    int64_t v = raw[n + j].v_int64;
    ext[slots_[j]] = v > 0 ? static_cast<size_t>(v) : 1;
  }
  size_t global[3], local[3];
  for (int i = 0; i < work_dim_; ++i) {
    local[i] = ext[3 + i];
    global[i] = warm.count > 0 ? local[i] : ext[i] * ext[3 + i];
  }
  cl_event ev = nullptr;
  cl_int launched = clEnqueueNDRangeKernel(d.queue, k, work_dim_, nullptr, global, local, 0,
                                           nullptr, recording.on ? &ev : nullptr);
  if (launched != CL_SUCCESS) {
    // Name what the work-group asked for against what this kernel may use on this device
    // (registers and local memory limit a kernel's work-group below the device maximum).
    size_t wg_max = 0;
    cl_ulong local_mem = 0, private_mem = 0;
    clGetKernelWorkGroupInfo(k, d.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(wg_max), &wg_max,
                             nullptr);
    clGetKernelWorkGroupInfo(k, d.id, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(local_mem), &local_mem,
                             nullptr);
    clGetKernelWorkGroupInfo(k, d.id, CL_KERNEL_PRIVATE_MEM_SIZE, sizeof(private_mem),
                             &private_mem, nullptr);
    size_t group = 1;
    std::ostringstream shape;
    for (int i = 0; i < work_dim_; ++i) {
      group *= local[i];
      shape << (i ? "x" : "") << local[i];
    }
    TT_CL_CHECK(launched, "launching kernel " << info_.name << " on " << d.name
                << " (work-group " << shape.str() << " = " << group
                << " work-items; this kernel allows at most " << wg_max
                << "; local memory " << local_mem << " bytes, private memory " << private_mem
                << " bytes per work-item)");
  }
  stats.launches++;
  if (ev != nullptr) recording.events.push_back(ev);
}

cl_kernel KernelLauncher::CachedKernel(int dev_id) const {
  struct Entry {
    uint64_t id = 0;
    int dev = -1;
    cl_kernel kernel = nullptr;
  };
  constexpr size_t kSlots = 4096;
  thread_local std::vector<Entry> cache(kSlots);
  Entry& e = cache[(id_ * 0x9E3779B97F4A7C15ull >> 52) % kSlots];
  if (e.id == id_ && e.dev == dev_id) return e.kernel;
  cl_kernel k = m_->Kernel(dev_id, info_.name);
  e.id = id_;
  e.dev = dev_id;
  e.kernel = k;
  return k;
}

// Builds the OpenCL programs of ``mod`` and of every module it imports for ``device_id``;
// returns how many OpenCL modules it found.
int64_t BuildPrograms(const tvm::ffi::Module& mod, int device_id) {
  int64_t n = 0;
  auto* obj = const_cast<tvm::ffi::ModuleObj*>(mod.operator->());
  bool ours;
  {
    std::lock_guard<std::mutex> lock(live_modules_mutex);
    ours = live_modules.count(obj) > 0;
  }
  if (ours) {  // the caller's reference keeps it alive
    static_cast<OpenCLModuleObj*>(obj)->BuildProgram(device_id);
    ++n;
  }
  for (const tvm::ffi::Any& m : mod->imports()) {
    n += BuildPrograms(m.cast<tvm::ffi::Module>(), device_id);
  }
  return n;
}

tvm::ffi::Module LoadFromBytes(const tvm::ffi::Bytes& bytes) {
  std::string blob(bytes.data(), bytes.size());
  Reader r(blob);
  std::string fmt = r.Str();
  if (fmt != "cl") {
    TVM_FFI_THROW(ValueError) << "OpenCL module: format '" << fmt
                              << "' is not supported (only OpenCL C source, 'cl')";
  }
  std::unordered_map<std::string, FunctionInfo> fmap;
  uint64_t n = r.U64();
  for (uint64_t i = 0; i < n; ++i) {
    std::string key = r.Str();
    FunctionInfo info;
    info.name = r.Str();
    uint64_t na = r.U64();
    for (uint64_t j = 0; j < na; ++j) {
      DLDataType t;
      t.code = r.Pod<uint8_t>();
      t.bits = r.Pod<uint8_t>();
      t.lanes = r.Pod<uint16_t>();
      info.arg_types.push_back(t);
    }
    uint64_t nt = r.U64();
    for (uint64_t j = 0; j < nt; ++j) info.launch_param_tags.push_back(r.Str());
    uint64_t ne = r.U64();
    for (uint64_t j = 0; j < ne; ++j) info.arg_extra_tags.push_back(r.Pod<int32_t>());
    fmap[key] = std::move(info);
  }
  std::string source = r.Str();
  return tvm::ffi::Module(
      tvm::ffi::make_object<OpenCLModuleObj>(std::move(source), std::move(fmap), blob));
}

// The device timer of time_evaluator ("runtime.timer.opencl", the name timer.cc looks up): the sum of the device-side
// execution times (CL_PROFILING_COMMAND_START..END, nanoseconds) of the kernels launched between
// Start and Stop. The class mirrors tvm::runtime::TimerNode (tvm/runtime/timer.h: same type key,
// same virtual methods in the same order); that header cannot be included, as it pulls in
// tvm/support headers the wheel does not ship.
// Start recording this thread's launches (an event each), dropping what an earlier recording
// left.
void StartRecording() {
  for (cl_event e : recording.events) clReleaseEvent(e);
  recording.events.clear();
  recording.on = true;
}

// The device's timing of recorded kernels, once they ran (nanoseconds, from their profiling
// events): how many, the sum of their execution times, and the first start and last end.
struct KernelTimes {
  size_t kernels = 0;
  int64_t busy_ns = 0;
  cl_ulong first_start = 0, last_end = 0;
};

// Waits for ``events``, reads their times, releases them and empties the vector.
KernelTimes CollectKernelTimes(std::vector<cl_event>* events) {
  KernelTimes out;
  if (!events->empty()) {
    TT_CL_CHECK(clWaitForEvents(events->size(), events->data()), "waiting for kernels");
  }
  for (cl_event e : *events) {
    cl_ulong t0 = 0, t1 = 0;
    clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_START, sizeof(t0), &t0, nullptr);
    clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_END, sizeof(t1), &t1, nullptr);
    if (out.kernels == 0 || t0 < out.first_start) out.first_start = t0;
    if (out.kernels == 0 || t1 > out.last_end) out.last_end = t1;
    out.busy_ns += static_cast<int64_t>(t1 - t0);
    ++out.kernels;
    clReleaseEvent(e);
  }
  events->clear();
  return out;
}

class TimerNodeABI : public tvm::ffi::Object {
 public:
  virtual void Start() = 0;
  virtual void Stop() = 0;
  virtual int64_t SyncAndGetElapsedNanos() = 0;
  virtual ~TimerNodeABI() {}
  static constexpr const bool _type_mutable = true;
  TVM_FFI_DECLARE_OBJECT_INFO("runtime.TimerNode", TimerNodeABI, tvm::ffi::Object);
};

class KernelTimerNode : public TimerNodeABI {
 public:
  void Start() final { StartRecording(); }
  void Stop() final {
    recording.on = false;
    events_.swap(recording.events);
  }
  int64_t SyncAndGetElapsedNanos() final { return CollectKernelTimes(&events_).busy_ns; }
  ~KernelTimerNode() {
    for (cl_event e : events_) clReleaseEvent(e);
  }
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("thomas_tune.OpenCLKernelTimer", KernelTimerNode,
                                    TimerNodeABI);

 private:
  std::vector<cl_event> events_;
};

}  // namespace opencl
}  // namespace thomas_tune

// ---- BatchNorm's statistics: their combiner, registered with TVM's schedule primitives ------
//
// models/batchnorm.py's bn_stats is one reduction whose combiner is Chan, Golub & LeVeque's
// pairwise update of (m2, mean, n). TVM's rfactor and cross-thread reduction apply only to a
// reduction whose combiner its registry knows (s_tir.schedule.RegisterReducer). The two
// callbacks are written here, in C++: MetaSchedule's JSONDatabase replays the records of a log
// on several threads while the calling Python thread holds the interpreter lock, and a Python
// callback reached from one of those threads waited for that lock forever. The expression tree
// is the one models/batchnorm.py's _pairwise builds, node for node, through the same operator
// functions (the registry matches it structurally, and the tuning logs key their records by
// the kernels it makes).
namespace thomas_tune {
namespace reducers {

using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::ObjectRef;

// TVM's operator functions, looked up once (a static local: initialised once even when the
// registry calls the combiner from several threads at a time, as JSONDatabase does)
struct Ops {
  Function add = Function::GetGlobalRequired("prim._OpAdd");
  Function sub = Function::GetGlobalRequired("prim._OpSub");
  Function mul = Function::GetGlobalRequired("prim._OpMul");
  Function div = Function::GetGlobalRequired("prim._OpDiv");
  Function max = Function::GetGlobalRequired("prim._OpMax");
};

const Ops& GetOps() {
  static const Ops ops;
  return ops;
}

// 1.0 in the data type of the expression e
Any One(const Any& e) {
  static tvm::ffi::reflection::FieldGetter expr_type("ir.Expr", "ty");
  static tvm::ffi::reflection::FieldGetter prim_dtype("ir.PrimType", "dtype");
  static Function float_imm = Function::GetGlobalRequired("ir.FloatImm");
  Any dtype = prim_dtype(expr_type(e.cast<ObjectRef>()).cast<ObjectRef>());
  return float_imm(dtype, 1.0, Any());
}

Array<Any> Pairwise(Array<Any> x, Array<Any> y) {
  const Ops& op = GetOps();
  Any none;
  Any n = op.add(x[2], y[2], none);
  Any frac = op.div(y[2], op.max(n, One(n), none), none);
  Any d = op.sub(y[1], x[1], none);
  Any m2 = op.add(op.add(x[0], y[0], none),
                  op.mul(op.mul(op.mul(d, d, none), x[2], none), frac, none), none);
  Any mean = op.add(x[1], op.mul(d, frac, none), none);
  return Array<Any>{m2, mean, n};
}

// the identity the registry compares with a block's initial values: those values themselves
// (zeros in bn_stats); the combiner's tree decides the match
Array<Any> SameValues(Array<Any> values) { return values; }

void RegisterPairwise() {
  static std::once_flag once;
  std::call_once(once, []() {
    Function::GetGlobalRequired("s_tir.schedule.RegisterReducer")(
        3, Function::FromTyped(Pairwise), Function::FromTyped(SameValues));
  });
}

}  // namespace reducers
}  // namespace thomas_tune

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using thomas_tune::opencl::Workspace;
  refl::GlobalDef()
      .def_packed("device_api.opencl",
                  [](tvm::ffi::PackedArgs, tvm::ffi::Any* rv) {
                    *rv = static_cast<void*>(Workspace::Global());
                  })
      .def("ffi.Module.load_from_bytes.opencl", thomas_tune::opencl::LoadFromBytes)
      .def("runtime.timer.opencl",
           [](DLDevice) {
             return tvm::ffi::ObjectRef(
                 tvm::ffi::make_object<thomas_tune::opencl::KernelTimerNode>());
           })
      .def("thomas_tune.opencl.devices",
           []() { return tvm::ffi::String(Workspace::Global()->Listing()); })
      .def("thomas_tune.opencl.stats",
           []() {
             using thomas_tune::opencl::stats;
             std::ostringstream os;
             os << "{\"source_builds\": " << stats.source_builds
                << ", \"binary_loads\": " << stats.binary_loads
                << ", \"binary_rejected\": " << stats.binary_rejected
                << ", \"binary_writes\": " << stats.binary_writes
                << ", \"write_failures\": " << stats.write_failures
                << ", \"launches\": " << stats.launches
                << ", \"device_bytes\": " << stats.device_bytes
                << ", \"device_peak_bytes\": " << stats.device_peak_bytes
                << ", \"launch_arg_bytes\": " << stats.launch_arg_bytes
                << ", \"source_build_s\": " << stats.source_build_ns * 1e-9
                << ", \"binary_load_s\": " << stats.binary_load_ns * 1e-9 << "}";
             return tvm::ffi::String(os.str());
           })
      .def("thomas_tune.opencl.record_start", thomas_tune::opencl::StartRecording)
      .def("thomas_tune.opencl.record_stop",
           []() {
             // the kernels this thread launched since record_start: their count, the sum of
             // their execution times and the span from the first one's start to the last
             // one's end (gaps between kernels included), nanoseconds
             using thomas_tune::opencl::recording;
             recording.on = false;
             std::vector<cl_event> events;
             events.swap(recording.events);
             auto t = thomas_tune::opencl::CollectKernelTimes(&events);
             std::ostringstream os;
             os << "{\"kernels\": " << t.kernels << ", \"busy_ns\": " << t.busy_ns
                << ", \"span_ns\": " << static_cast<int64_t>(t.last_end - t.first_start)
                << "}";
             return tvm::ffi::String(os.str());
           })
      .def("thomas_tune.opencl.reset_peak",
           []() {
             using thomas_tune::opencl::stats;
             stats.device_peak_bytes = stats.device_bytes.load();
           })
      .def("thomas_tune.opencl.build_programs", thomas_tune::opencl::BuildPrograms)
      .def("thomas_tune.opencl.cache_dir",
           []() { return tvm::ffi::String(thomas_tune::opencl::BinaryCacheDir()); })
      .def("thomas_tune.register_pairwise_reducer", thomas_tune::reducers::RegisterPairwise)
      .def("thomas_tune.opencl.num_devices",
           []() { return static_cast<int64_t>(Workspace::Global()->Devices().size()); });
}
