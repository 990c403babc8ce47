// The host side of an attention call in C++: the torch ops flashtrain::flash_attn_fwd / flash_attn_bwd (CUDA
// kernels and the forward's autograd node), executing launch plans that Python builds (flashtrain/kernels/ops.py).
//
// Why C++: a Python autograd.Function and Python launch code cost ~3x FlashAttention-2's host time per call on a
// tiny attention (benchmarks/host_overhead.py); here a call is a key computed from its tensors, a hash lookup,
// allocations through at::empty (the caching allocator), the addresses written into a copy of the plan's parameter
// bytes, and cuLaunchKernel on the current torch stream. The backward never enters Python.
//
// This file makes no dispatch decision. A plan (ops.py _Plan, flattened by _Plan.flat) says everything about a call
// except its tensors' addresses:
//   outputs      shape, dtype and fill (none, 0, -inf) of each tensor it allocates (the op returns the first ones, the
//                others are workspaces); a call without work (ops.py no_work) has a plan of filled outputs only;
//   launches     per kernel launch: the CUfunction, grid, block, dynamic shared memory, the parameter struct's bytes
//                with every address 0, where each address goes (byte offset <- input i or output j, plus a byte
//                offset), the TMA tensor maps to encode (byte offset <- input i, or output j written as -1 - j,
//                with cuTensorMapEncodeTiled's arguments), and where the persistent kernels' tile counter goes.
// On a key it has not seen, the executor calls the Python plan builder once through the ops flashtrain::_fwd_plan /
// _bwd_plan (defined here, implemented in ops.py) and keeps the result.
//
// The tensor arguments, in the order plans index them ("input i"):
//   forward   q, k, v, cu_seqlens_q, cu_seqlens_k, rng_state, bs_rows, bs_cols, alibi_slopes
//   backward  dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, bs_cols, alibi_slopes, mm_states,
//             mm_error, mm0..mm3, dlse (in lse's layout)
// A None argument has address 0.
//
// The CUDA driver is reached through dlopen("libcuda.so.1") with the few prototypes it uses declared below, and the
// current stream through c10's device-generic interface: the library links against libc10 and libtorch_cpu only, and
// builds without the CUDA toolkit's headers or torch's CUDA libraries. Registered for CPU tensors too, where it only
// runs in record mode (flashtrain::_record_launches: launches are recorded instead of issued; tests compare them
// with the Python executor's, byte for byte).

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace flashtrain_host {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// ------------------------------------------------------------------------------------------------ the CUDA driver
using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using CUdevice = int;

// cuLaunchKernelEx's configuration (cuda.h CUlaunchConfig, CUlaunchAttribute: a 4-byte id, padding, a 64-byte value)
struct LaunchAttribute {
    int id;
    char pad[4];
    union {
        int value;
        char bytes[64];
        void* align;
    };
};
static_assert(sizeof(LaunchAttribute) == 72, "cuda.h CUlaunchAttribute");
constexpr int kAttributeProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
struct LaunchConfig {
    unsigned grid[3], block[3], smem_bytes;
    CUstream stream;
    LaunchAttribute* attributes;
    unsigned attribute_count;
};

struct Driver {
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void**, void**) = nullptr;
    CUresult (*launch_kernel_ex)(const LaunchConfig*, CUfunction, void**, void**) = nullptr;
    CUresult (*ctx_get_current)(CUcontext*) = nullptr;
    CUresult (*ctx_set_current)(CUcontext) = nullptr;
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
    CUresult (*tensor_map_encode_tiled)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*,
                                        const uint32_t*, const uint32_t*, int, int, int, int) = nullptr;
    CUresult (*get_error_string)(CUresult, const char**) = nullptr;
};

template <typename F>
void resolve(void* lib, const char* name, F& fn) {
    fn = reinterpret_cast<F>(dlsym(lib, name));
    TORCH_CHECK(fn != nullptr, "flashtrain host layer: libcuda.so.1 has no ", name);
}

const Driver& driver() {
    static const Driver loaded = [] {
        Driver d;
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // torch has loaded it
        if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
        TORCH_CHECK(lib != nullptr, "flashtrain host layer: cannot load the CUDA driver libcuda.so.1: ", dlerror());
        resolve(lib, "cuLaunchKernel", d.launch_kernel);
        resolve(lib, "cuLaunchKernelEx", d.launch_kernel_ex);
        resolve(lib, "cuCtxGetCurrent", d.ctx_get_current);
        resolve(lib, "cuCtxSetCurrent", d.ctx_set_current);
        resolve(lib, "cuDeviceGet", d.device_get);
        resolve(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain);
        resolve(lib, "cuTensorMapEncodeTiled", d.tensor_map_encode_tiled);
        resolve(lib, "cuGetErrorString", d.get_error_string);
        return d;
    }();
    return loaded;
}

std::string error_text(CUresult result) {
    const char* text = nullptr;
    driver().get_error_string(result, &text);
    return std::string(text ? text : "unknown error") + " (CUresult " + std::to_string(result) + ")";
}

void check(CUresult result, const char* what) {
    TORCH_CHECK(result == 0, what, " failed: ", error_text(result));
}

// ------------------------------------------------------------------------------------------------ plans
enum Source : int64_t { kInput = 0, kOutput = 1 };

// How an output is allocated (= ops.py _FILL_*): uninitialised, or filled (a fill kernel on the current stream).
enum Fill : int64_t { kFillNone = 0, kFillZero = 1, kFillNegInf = 2 };

struct OutputSpec {
    c10::ScalarType dtype;
    Fill fill;
    std::vector<int64_t> shape;
};

struct Address {
    int64_t offset, source, index, add;  // params[offset] = address of (source, index) + add, or 0 for None
};

struct TensorMap {
    int64_t offset, input;                // params[offset .. offset + 128) = the map of input `input` (>= 0) or of
                                          // output -1 - input
    std::array<int64_t, 13> encode;       // dtype, dims[4], strides[3], box cols, box rows, swizzle, l2, oob fill
};

struct Launch {
    CUfunction function;
    std::array<unsigned, 3> grid;
    unsigned threads, smem_bytes;
    std::vector<uint8_t> params;          // every address 0
    std::vector<Address> addresses;
    std::vector<TensorMap> tensor_maps;
    int64_t tile_counter_offset;          // -1: none
    int64_t tile_counters;                // device address of the kernel's per-stream counters
    int64_t max_streams;
    bool pdl;                             // launched with programmatic stream serialization (ops.py _Launch.pdl)
};

struct Plan {
    std::vector<OutputSpec> outputs;
    std::vector<Launch> launches;
};

constexpr int64_t kPlanFormat = 3;  // = ops.py _PLAN_FORMAT
constexpr size_t kMaxParamBytes = 4096;
constexpr size_t kTensorMapBytes = 128;

// Reads ops.py _Plan.flat(): a flat list of int64.
struct Reader {
    const std::vector<int64_t>& words;
    size_t at = 0;
    int64_t next() {
        TORCH_CHECK(at < words.size(), "flashtrain host layer: truncated launch plan");
        return words[at++];
    }
};

std::shared_ptr<const Plan> parse_plan(const std::vector<int64_t>& words) {
    Reader in{words};
    TORCH_CHECK(in.next() == kPlanFormat, "flashtrain host layer: the launch plan's format is not this library's");
    auto plan = std::make_shared<Plan>();
    for (int64_t n = in.next(); n > 0; --n) {
        OutputSpec output;
        output.dtype = static_cast<c10::ScalarType>(in.next());
        const int64_t fill = in.next();
        TORCH_CHECK(fill >= kFillNone && fill <= kFillNegInf, "flashtrain host layer: output fill ", fill);
        output.fill = static_cast<Fill>(fill);
        for (int64_t dims = in.next(); dims > 0; --dims) output.shape.push_back(in.next());
        plan->outputs.push_back(std::move(output));
    }
    for (int64_t n = in.next(); n > 0; --n) {
        Launch launch;
        launch.function = reinterpret_cast<CUfunction>(in.next());
        for (auto& extent : launch.grid) extent = static_cast<unsigned>(in.next());
        launch.threads = static_cast<unsigned>(in.next());
        launch.smem_bytes = static_cast<unsigned>(in.next());
        const int64_t bytes = in.next();
        TORCH_CHECK(bytes >= 0 && static_cast<size_t>(bytes) <= kMaxParamBytes,
                    "flashtrain host layer: parameter struct of ", bytes, " bytes");
        launch.params.resize(static_cast<size_t>((bytes + 7) / 8 * 8));
        for (size_t word = 0; word < launch.params.size(); word += 8) {
            const int64_t value = in.next();
            std::memcpy(launch.params.data() + word, &value, 8);
        }
        launch.params.resize(static_cast<size_t>(bytes));
        for (int64_t m = in.next(); m > 0; --m) {
            Address address{in.next(), in.next(), in.next(), in.next()};
            TORCH_CHECK(address.offset >= 0 && address.offset + 8 <= bytes, "flashtrain host layer: address offset");
            launch.addresses.push_back(address);
        }
        for (int64_t m = in.next(); m > 0; --m) {
            TensorMap map;
            map.offset = in.next();
            map.input = in.next();
            for (auto& value : map.encode) value = in.next();
            TORCH_CHECK(map.offset >= 0 && map.offset + static_cast<int64_t>(kTensorMapBytes) <= bytes,
                        "flashtrain host layer: tensor map offset");
            launch.tensor_maps.push_back(map);
        }
        launch.tile_counter_offset = in.next();
        launch.tile_counters = in.next();
        launch.max_streams = in.next();
        launch.pdl = in.next() != 0;
        plan->launches.push_back(std::move(launch));
    }
    TORCH_CHECK(in.at == words.size(), "flashtrain host layer: trailing words in the launch plan");
    return plan;
}

// A call's key: everything its plan depends on besides addresses (every tensor argument's dtype, sizes and strides,
// the device, the scalar options, FLASHTRAIN_SM90). Plans are kept per key, at most kMaxPlans of them.
using Key = std::vector<int64_t>;

struct KeyHash {
    size_t operator()(const Key& key) const noexcept {
        uint64_t hash = 1469598103934665603ull;
        for (int64_t value : key) hash = (hash ^ static_cast<uint64_t>(value)) * 1099511628211ull;
        return static_cast<size_t>(hash);
    }
};

constexpr size_t kMaxPlans = 1024;   // per direction, as ops.py's Python executor
constexpr size_t kMaxTensorMaps = 512;

using MapKey = std::array<int64_t, 14>;  // address, then the encoder's arguments

struct MapKeyHash {
    size_t operator()(const MapKey& key) const noexcept {
        uint64_t hash = 1469598103934665603ull;
        for (int64_t value : key) hash = (hash ^ static_cast<uint64_t>(value)) * 1099511628211ull;
        return static_cast<size_t>(hash);
    }
};

std::mutex state_mutex;  // the maps below; never held while calling Python or launching
std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> plans[2];
std::unordered_map<MapKey, std::array<uint8_t, kTensorMapBytes>, MapKeyHash> tensor_maps;  // cached encodings
std::unordered_map<int64_t, CUcontext> contexts;                   // device -> primary context
std::unordered_map<uint64_t, int64_t> stream_slots;                // (device, stream) -> tile counter slot
std::unordered_map<int64_t, int64_t> slots_per_device;

// Record mode (tests): launches are appended here instead of issued.
bool recording = false;
std::vector<Tensor> recorded;

void push_tensor(Key& key, const Tensor& x) {
    if (!x.defined()) {
        key.push_back(-1);
        return;
    }
    key.push_back(static_cast<int64_t>(x.scalar_type()));
    key.push_back(x.dim());
    for (int64_t size : x.sizes()) key.push_back(size);
    for (int64_t stride : x.strides()) key.push_back(stride);
}

OptTensor optional_of(const Tensor& x) {
    return x.defined() ? OptTensor(x) : OptTensor();
}

int64_t bits(double value) {
    int64_t out;
    std::memcpy(&out, &value, sizeof out);
    return out;
}

bool sm90_disabled() {
    const char* value = std::getenv("FLASHTRAIN_SM90");  // = build.sm90_enabled(), read per call as there
    return value != nullptr && std::strcmp(value, "0") == 0;
}

Key call_key(const std::vector<Tensor>& inputs, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
             double softmax_scale, bool causal, bool deterministic, int64_t window_left, int64_t window_right,
             double softcap, c10::string_view mask_mod) {
    Key key;
    key.reserve(96);
    for (const Tensor& x : inputs) push_tensor(key, x);
    key.insert(key.end(), {inputs[0].is_cuda() ? inputs[0].get_device() : -1, max_seqlen_q, max_seqlen_k,
                           bits(dropout_p), bits(softmax_scale), causal, deterministic, sm90_disabled(), window_left,
                           window_right, bits(softcap),
                           static_cast<int64_t>(std::hash<std::string_view>{}(
                               std::string_view(mask_mod.data(), mask_mod.size())))});
    if (!mask_mod.empty()) key.push_back(static_cast<int64_t>(mask_mod.size()));
    return key;
}

// x itself when the kernels' 16-byte loads of its rows are aligned (address and every stride) and nothing is
// broadcast (stride 0, which tensor maps cannot express), else a contiguous copy: ops.py _aligned, the same rule.
Tensor aligned(const Tensor& x) {
    bool ok = x.stride(-1) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
    for (int64_t d = 0; ok && d + 1 < x.dim(); ++d)
        ok = x.stride(d) % 8 == 0 && (x.stride(d) > 0 || x.size(d) == 1);
    return ok ? x : x.clone(at::MemoryFormat::Contiguous);
}

Tensor contiguous_or_undefined(const OptTensor& x) {
    return x.has_value() && x->defined() ? x->contiguous() : Tensor();
}

Tensor undefined_if_none(const OptTensor& x) {
    return x.has_value() ? *x : Tensor();
}

void ensure_context(int64_t device) {
    const Driver& d = driver();
    CUcontext context = nullptr;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        auto found = contexts.find(device);
        if (found != contexts.end()) context = found->second;
    }
    if (context == nullptr) {
        CUdevice handle = 0;
        check(d.device_get(&handle, static_cast<int>(device)), "cuDeviceGet");
        check(d.primary_ctx_retain(&context, handle), "cuDevicePrimaryCtxRetain");
        std::lock_guard<std::mutex> lock(state_mutex);
        contexts.emplace(device, context);
    }
    // autograd runs the backward on its own threads, where no context may be current yet
    CUcontext current = nullptr;
    if (d.ctx_get_current(&current) != 0 || current != context) check(d.ctx_set_current(context), "cuCtxSetCurrent");
}

int64_t tile_counter(const Launch& launch, int64_t device, CUstream stream) {
    const uint64_t key = (static_cast<uint64_t>(device + 1) << 56) ^ reinterpret_cast<uint64_t>(stream);
    int64_t slot;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        auto found = stream_slots.find(key);
        slot = found != stream_slots.end() ? found->second
                                           : stream_slots.emplace(key, slots_per_device[device]++).first->second;
    }
    TORCH_CHECK(slot < launch.max_streams, "the persistent Hopper kernels ran on more than build.MAX_STREAMS = ",
                launch.max_streams, " CUDA streams of cuda:", device, " in this process (one tile counter each)");
    return launch.tile_counters + 4 * slot;
}

void write_tensor_map(uint8_t* slot, const TensorMap& map, const Tensor& x) {
    // an empty tensor (a null address, a dimension of size 0) has no valid tensor map, and plans map none (calls
    // without work, ops.py no_work, launch nothing): refused here, not handed to the driver
    TORCH_CHECK(x.data_ptr() != nullptr && map.encode[1] > 0 && map.encode[2] > 0 && map.encode[3] > 0 &&
                    map.encode[4] > 0,
                "flashtrain host layer: a TMA tensor map over an empty tensor (dims ", map.encode[1], ", ",
                map.encode[2], ", ", map.encode[3], ", ", map.encode[4], ")");
    MapKey key;
    key[0] = reinterpret_cast<int64_t>(x.data_ptr());
    std::copy(map.encode.begin(), map.encode.end(), key.begin() + 1);
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        auto found = tensor_maps.find(key);
        if (found != tensor_maps.end()) {
            std::memcpy(slot, found->second.data(), kTensorMapBytes);
            return;
        }
    }
    alignas(64) std::array<uint8_t, kTensorMapBytes> encoded{};
    const auto& e = map.encode;
    if (recording) {  // tests: the address and the encoder's arguments, as ops.py's test encoder writes them
        std::memcpy(encoded.data(), key.data(), sizeof key);
    } else {
        const uint64_t dims[4] = {uint64_t(e[1]), uint64_t(e[2]), uint64_t(e[3]), uint64_t(e[4])};
        const uint64_t strides[3] = {uint64_t(e[5]), uint64_t(e[6]), uint64_t(e[7])};
        const uint32_t box[4] = {uint32_t(e[8]), uint32_t(e[9]), 1, 1};
        const uint32_t element_strides[4] = {1, 1, 1, 1};
        const CUresult result = driver().tensor_map_encode_tiled(
            encoded.data(), int(e[0]), 4, x.data_ptr(), dims, strides, box, element_strides, /*interleave*/ 0,
            int(e[10]), int(e[11]), int(e[12]));
        TORCH_CHECK(result == 0, "cuTensorMapEncodeTiled failed: ", error_text(result), " for a tensor map of dims (",
                    dims[0], ", ", dims[1], ", ", dims[2], ", ", dims[3], "), byte strides (", strides[0], ", ",
                    strides[1], ", ", strides[2], "), box rows ", box[1]);
    }
    std::memcpy(slot, encoded.data(), kTensorMapBytes);
    std::lock_guard<std::mutex> lock(state_mutex);
    if (tensor_maps.size() >= kMaxTensorMaps) tensor_maps.clear();
    tensor_maps.emplace(key, encoded);
}

// Record mode: int64 words (function, grid x, y, z, threads, shared memory, programmatic launch, n, then (address,
// bytes) of the n tensors: the inputs, then the outputs), then the parameter bytes. ops.py's test kernels record the
// same.
void record(const Launch& launch, const uint8_t* params, const std::vector<Tensor>& inputs,
            const std::vector<Tensor>& outputs) {
    std::vector<int64_t> header = {reinterpret_cast<int64_t>(launch.function), launch.grid[0], launch.grid[1],
                                   launch.grid[2], launch.threads, launch.smem_bytes, launch.pdl ? 1 : 0,
                                   static_cast<int64_t>(inputs.size() + outputs.size())};
    for (const auto* list : {&inputs, &outputs}) {
        for (const Tensor& x : *list) {
            header.push_back(x.defined() ? reinterpret_cast<int64_t>(x.data_ptr()) : 0);
            header.push_back(x.defined() ? x.numel() * x.element_size() : 0);
        }
    }
    const size_t header_bytes = header.size() * sizeof(int64_t);
    Tensor entry = at::empty({static_cast<int64_t>(header_bytes + launch.params.size())}, at::kByte);
    std::memcpy(entry.data_ptr(), header.data(), header_bytes);
    std::memcpy(static_cast<uint8_t*>(entry.data_ptr()) + header_bytes, params, launch.params.size());
    std::lock_guard<std::mutex> lock(state_mutex);
    recorded.push_back(entry);
}

// Allocates the plan's outputs and issues its launches; returns the outputs (workspaces included).
std::vector<Tensor> execute(const Plan& plan, const std::vector<Tensor>& inputs) {
    const Tensor& first = inputs[0];
    const at::TensorOptions options = first.options();
    std::vector<Tensor> outputs;
    outputs.reserve(plan.outputs.size());
    for (const OutputSpec& spec : plan.outputs) {
        const at::TensorOptions typed = options.dtype(spec.dtype);
        outputs.push_back(spec.fill == kFillZero     ? at::zeros(spec.shape, typed)
                          : spec.fill == kFillNegInf ? at::full(spec.shape, -std::numeric_limits<double>::infinity(),
                                                                typed)
                                                     : at::empty(spec.shape, typed));
    }
    const int64_t device = first.is_cuda() ? first.get_device() : -1;
    CUstream stream = nullptr;
    if (first.is_cuda()) {
        ensure_context(device);
        stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                     ->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)))
                     .native_handle();
    }
    for (const Launch& launch : plan.launches) {
        if (launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0) continue;  // nothing to do
        alignas(64) uint8_t params[kMaxParamBytes];
        std::memcpy(params, launch.params.data(), launch.params.size());
        for (const Address& address : launch.addresses) {
            const Tensor& x = address.source == kInput ? inputs.at(address.index) : outputs.at(address.index);
            const uint64_t base = x.defined() ? reinterpret_cast<uint64_t>(x.data_ptr()) : 0;
            const uint64_t value = base != 0 ? base + static_cast<uint64_t>(address.add) : 0;
            std::memcpy(params + address.offset, &value, 8);
        }
        for (const TensorMap& map : launch.tensor_maps)
            write_tensor_map(params + map.offset, map,
                             map.input >= 0 ? inputs.at(map.input) : outputs.at(-1 - map.input));
        if (launch.tile_counter_offset >= 0) {
            const int64_t counter = tile_counter(launch, device, stream);
            std::memcpy(params + launch.tile_counter_offset, &counter, 8);
        }
        if (recording) {
            record(launch, params, inputs, outputs);
            continue;
        }
        void* args[1] = {params};
        if (launch.pdl) {
            LaunchAttribute attribute{};
            attribute.id = kAttributeProgrammaticStreamSerialization;
            attribute.value = 1;
            const LaunchConfig config{{launch.grid[0], launch.grid[1], launch.grid[2]}, {launch.threads, 1, 1},
                                      launch.smem_bytes, stream, &attribute, 1};
            check(driver().launch_kernel_ex(&config, launch.function, args, nullptr), "cuLaunchKernelEx");
            continue;
        }
        const CUresult result =
            driver().launch_kernel(launch.function, launch.grid[0], launch.grid[1], launch.grid[2], launch.threads, 1,
                                   1, launch.smem_bytes, stream, args, nullptr);
        check(result, "cuLaunchKernel");
    }
    return outputs;
}

std::shared_ptr<const Plan> find_plan(int direction, const Key& key) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto found = plans[direction].find(key);
    return found == plans[direction].end() ? nullptr : found->second;
}

std::shared_ptr<const Plan> remember(int direction, const Key& key, std::shared_ptr<const Plan> plan) {
    std::lock_guard<std::mutex> lock(state_mutex);
    if (plans[direction].size() >= kMaxPlans) plans[direction].clear();
    plans[direction][key] = plan;
    return plan;
}

// Calls the Python plan builder (an op implemented in ops.py) without TorchDispatchModes seeing it.
template <typename... Args>
std::vector<int64_t> call_builder(const char* name, Args... args) {  // Args given explicitly
    c10::impl::ExcludeDispatchKeyGuard no_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
    return op.typed<std::vector<int64_t>(Args...)>().call(args...);
}

// ------------------------------------------------------------------------------------------------ the ops' kernels
void check_device(const Tensor& q) {
    TORCH_CHECK(q.is_cuda() || recording, "flashtrain::flash_attn_fwd / flash_attn_bwd run on CUDA tensors, got ",
                q.device());
}

std::tuple<Tensor, Tensor> fwd_kernel(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                      const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                      c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double dropout_p,
                                      double softmax_scale, bool causal, const OptTensor& rng_state,
                                      bool deterministic, const OptTensor& bs_rows, const OptTensor& bs_cols,
                                      int64_t window_left, int64_t window_right, double softcap,
                                      const OptTensor& alibi_slopes, const OptTensor& mm_states,
                                      const OptTensor& mm_error, const OptTensor& mm0, const OptTensor& mm1,
                                      const OptTensor& mm2, const OptTensor& mm3, c10::string_view mask_mod) {
    check_device(q_in);
    const std::vector<Tensor> inputs = {aligned(q_in), aligned(k_in), aligned(v_in),
                                        contiguous_or_undefined(cu_seqlens_q), contiguous_or_undefined(cu_seqlens_k),
                                        undefined_if_none(rng_state), undefined_if_none(bs_rows),
                                        undefined_if_none(bs_cols), undefined_if_none(alibi_slopes),
                                        undefined_if_none(mm_states), undefined_if_none(mm_error),
                                        undefined_if_none(mm0), undefined_if_none(mm1), undefined_if_none(mm2),
                                        undefined_if_none(mm3)};
    const int64_t max_q = max_seqlen_q.expect_int(), max_k = max_seqlen_k.expect_int();
    const Key key = call_key(inputs, max_q, max_k, dropout_p, softmax_scale, causal, deterministic, window_left,
                             window_right, softcap, mask_mod);
    auto plan = find_plan(0, key);
    if (plan == nullptr) {
        plan = remember(0, key, parse_plan(call_builder<const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                                        const OptTensor&, int64_t, int64_t, double, double, bool,
                                                        const OptTensor&, bool, const OptTensor&, const OptTensor&,
                                                        int64_t, int64_t, double, const OptTensor&, const OptTensor&,
                                                        const OptTensor&, const OptTensor&, const OptTensor&,
                                                        const OptTensor&, const OptTensor&, c10::string_view>(
            "flashtrain::_fwd_plan", inputs[0], inputs[1], inputs[2], optional_of(inputs[3]),
            optional_of(inputs[4]), max_q, max_k, dropout_p, softmax_scale, causal, optional_of(inputs[5]), deterministic, optional_of(inputs[6]),
            optional_of(inputs[7]), window_left, window_right, softcap, optional_of(inputs[8]), optional_of(inputs[9]),
            optional_of(inputs[10]), optional_of(inputs[11]), optional_of(inputs[12]), optional_of(inputs[13]),
            optional_of(inputs[14]), mask_mod)));
    }
    auto outputs = execute(*plan, inputs);
    return {outputs[0], outputs[1]};
}

std::tuple<Tensor, Tensor, Tensor> bwd_kernel(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& out, const Tensor& lse, const OptTensor& cu_seqlens_q,
                                              const OptTensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                                              c10::SymInt max_seqlen_k, double dropout_p, double softmax_scale,
                                              bool causal, const OptTensor& rng_state, bool deterministic,
                                              const OptTensor& bs_cols, int64_t window_left, int64_t window_right,
                                              double softcap, const OptTensor& alibi_slopes,
                                              const OptTensor& mm_states, const OptTensor& mm_error,
                                              const OptTensor& mm0, const OptTensor& mm1, const OptTensor& mm2,
                                              const OptTensor& mm3, c10::string_view mask_mod,
                                              const OptTensor& dlse) {
    check_device(q);
    // dlse (the gradient reaching lse) in lse's own layout: the plan reads it with lse's strides
    Tensor dlse_like_lse;
    if (dlse.has_value() && dlse->defined()) {
        TORCH_CHECK(dlse->sizes() == lse.sizes(), "flash_attn_bwd: dlse has shape ", dlse->sizes(), ", lse ",
                    lse.sizes());
        dlse_like_lse = dlse->strides() == lse.strides() && dlse->scalar_type() == at::kFloat
                            ? *dlse
                            : at::empty_like(lse).copy_(*dlse);
    }
    const std::vector<Tensor> inputs = {aligned(dout), aligned(q), aligned(k), aligned(v), aligned(out), lse,
                                        contiguous_or_undefined(cu_seqlens_q), contiguous_or_undefined(cu_seqlens_k),
                                        undefined_if_none(rng_state), undefined_if_none(bs_cols),
                                        undefined_if_none(alibi_slopes), undefined_if_none(mm_states),
                                        undefined_if_none(mm_error), undefined_if_none(mm0), undefined_if_none(mm1),
                                        undefined_if_none(mm2), undefined_if_none(mm3), dlse_like_lse};
    const int64_t max_q = max_seqlen_q.expect_int(), max_k = max_seqlen_k.expect_int();
    const Key key = call_key(inputs, max_q, max_k, dropout_p, softmax_scale, causal, deterministic, window_left,
                             window_right, softcap, mask_mod);
    auto plan = find_plan(1, key);
    if (plan == nullptr) {
        plan = remember(1, key, parse_plan(call_builder<const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                        const Tensor&, const Tensor&, const OptTensor&,
                                                        const OptTensor&, int64_t, int64_t, double, double, bool,
                                                        const OptTensor&, bool, const OptTensor&, int64_t, int64_t,
                                                        double, const OptTensor&, const OptTensor&, const OptTensor&,
                                                        const OptTensor&, const OptTensor&, const OptTensor&,
                                                        const OptTensor&, c10::string_view>(
            "flashtrain::_bwd_plan", inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
            optional_of(inputs[6]), optional_of(inputs[7]), max_q, max_k, dropout_p, softmax_scale, causal,
            optional_of(inputs[8]), deterministic, optional_of(inputs[9]), window_left, window_right, softcap,
            optional_of(inputs[10]), optional_of(inputs[11]), optional_of(inputs[12]), optional_of(inputs[13]),
            optional_of(inputs[14]), optional_of(inputs[15]), optional_of(inputs[16]), mask_mod)));
    }
    auto outputs = execute(*plan, inputs);
    return {outputs[0], outputs[1], outputs[2]};
}

// ------------------------------------------------------------------------------------------------ autograd
// The forward's arguments other than q, k, v (no gradient flows to them).
struct Options {
    OptTensor cu_seqlens_q, cu_seqlens_k, rng_state, bs_rows, bs_cols, alibi_slopes;
    c10::SymInt max_seqlen_q, max_seqlen_k;
    double dropout_p, softmax_scale;
    bool causal, deterministic;
    int64_t window_left, window_right;
    double softcap;
    OptTensor mm_states, mm_error, mm0, mm1, mm2, mm3;  // a mask expression's states, error word and tensors
    std::string mask_mod;                                // "name,name,...;expression" ("" none)
};

c10::TypedOperatorHandle<decltype(fwd_kernel)>& fwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashtrain::flash_attn_fwd", "")
                         .typed<decltype(fwd_kernel)>();
    return op;
}

c10::TypedOperatorHandle<decltype(bwd_kernel)>& bwd_op() {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashtrain::flash_attn_bwd", "")
                         .typed<decltype(bwd_kernel)>();
    return op;
}

struct FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                  const Tensor& k, const Tensor& v, const Options& o) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [out, lse] = fwd_op().call(q, k, v, o.cu_seqlens_q, o.cu_seqlens_k, o.max_seqlen_q, o.max_seqlen_k,
                                        o.dropout_p, o.softmax_scale, o.causal, o.rng_state, o.deterministic,
                                        o.bs_rows, o.bs_cols, o.window_left, o.window_right, o.softcap,
                                        o.alibi_slopes, o.mm_states, o.mm_error, o.mm0, o.mm1, o.mm2, o.mm3,
                                        o.mask_mod);
        ctx->save_for_backward({q, k, v, out, lse, undefined_if_none(o.cu_seqlens_q),
                                undefined_if_none(o.cu_seqlens_k), undefined_if_none(o.rng_state),
                                undefined_if_none(o.bs_cols), undefined_if_none(o.alibi_slopes),
                                undefined_if_none(o.mm_states), undefined_if_none(o.mm_error), undefined_if_none(o.mm0),
                                undefined_if_none(o.mm1), undefined_if_none(o.mm2), undefined_if_none(o.mm3)});
        ctx->saved_data["mask_mod"] = o.mask_mod;
        ctx->saved_data["max_seqlen_q"] = o.max_seqlen_q;
        ctx->saved_data["max_seqlen_k"] = o.max_seqlen_k;
        ctx->saved_data["dropout_p"] = o.dropout_p;
        ctx->saved_data["softmax_scale"] = o.softmax_scale;
        ctx->saved_data["causal"] = o.causal;
        ctx->saved_data["deterministic"] = o.deterministic;
        ctx->saved_data["window_left"] = o.window_left;
        ctx->saved_data["window_right"] = o.window_right;
        ctx->saved_data["softcap"] = o.softcap;
        // lse is differentiable: its gradient folds into the backward's D (flash_aux.cuh, preprocess)
        ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined (no zero tensor per call)
        return {out, lse};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
        Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);  // only lse was used
        const OptTensor dlse = grads[1].defined() ? OptTensor(grads[1]) : OptTensor();
        auto& data = ctx->saved_data;
        at::AutoDispatchBelowADInplaceOrView below_autograd;  // no double backward: straight to the kernel
        auto [dq, dk, dv] = bwd_op().call(
            dout, q, k, v, out, lse, optional_of(saved[5]), optional_of(saved[6]), data["max_seqlen_q"].toSymInt(),
            data["max_seqlen_k"].toSymInt(), data["dropout_p"].toDouble(), data["softmax_scale"].toDouble(),
            data["causal"].toBool(), optional_of(saved[7]), data["deterministic"].toBool(), optional_of(saved[8]),
            data["window_left"].toInt(), data["window_right"].toInt(), data["softcap"].toDouble(),
            optional_of(saved[9]), optional_of(saved[10]), optional_of(saved[11]), optional_of(saved[12]),
            optional_of(saved[13]), optional_of(saved[14]), optional_of(saved[15]),
            data["mask_mod"].toStringRef(), dlse);
        return {dq, dk, dv, Tensor()};
    }
};

std::tuple<Tensor, Tensor> fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                                        c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double dropout_p,
                                        double softmax_scale, bool causal, const OptTensor& rng_state,
                                        bool deterministic, const OptTensor& bs_rows, const OptTensor& bs_cols,
                                        int64_t window_left, int64_t window_right, double softcap,
                                        const OptTensor& alibi_slopes, const OptTensor& mm_states,
                                        const OptTensor& mm_error, const OptTensor& mm0, const OptTensor& mm1,
                                        const OptTensor& mm2, const OptTensor& mm3, c10::string_view mask_mod) {
    if (!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;  // nothing to record (e.g. under torch.no_grad)
        return fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k),
                             dropout_p, softmax_scale, causal, rng_state, deterministic, bs_rows, bs_cols, window_left,
                             window_right, softcap, alibi_slopes, mm_states, mm_error, mm0, mm1, mm2, mm3, mask_mod);
    }
    Options options{cu_seqlens_q, cu_seqlens_k, rng_state, bs_rows, bs_cols, alibi_slopes, std::move(max_seqlen_q),
                    std::move(max_seqlen_k), dropout_p, softmax_scale, causal, deterministic, window_left,
                    window_right, softcap, mm_states, mm_error, mm0, mm1, mm2, mm3,
                    std::string(mask_mod.data(), mask_mod.size())};
    auto outputs = FlashAttnFunction::apply(q, k, v, options);
    return {outputs[0], outputs[1]};
}

// ------------------------------------------------------------------------------------------------ test hooks
void record_launches(bool on) {
    std::lock_guard<std::mutex> lock(state_mutex);
    recording = on;
    recorded.clear();
}

std::vector<Tensor> recorded_launches() {
    std::lock_guard<std::mutex> lock(state_mutex);
    std::vector<Tensor> out;
    out.swap(recorded);
    return out;
}

// Forgets every plan and tensor map (ops.py calls it when an input of plan building changes under a running
// process: launch's shared-memory limit of a device, which tests lower).
void clear_plans() {
    std::lock_guard<std::mutex> lock(state_mutex);
    plans[0].clear();
    plans[1].clear();
    tensor_maps.clear();
}

}  // namespace flashtrain_host

TORCH_LIBRARY(flashtrain, m) {
    m.def("flash_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
          "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
          "Tensor? rng_state, bool deterministic, Tensor? bs_rows=None, Tensor? bs_cols=None, int window_left=-1, "
          "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? mm_states=None, Tensor? mm_error=None, Tensor? mm0=None, Tensor? mm1=None, Tensor? mm2=None, Tensor? mm3=None, str mask_mod=\"\") -> (Tensor, Tensor)");
    m.def("flash_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
          "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
          "bool causal, Tensor? rng_state, bool deterministic, Tensor? bs_cols=None, int window_left=-1, "
          "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? mm_states=None, Tensor? mm_error=None, Tensor? mm0=None, Tensor? mm1=None, Tensor? mm2=None, Tensor? mm3=None, str mask_mod=\"\", Tensor? dlse=None) -> (Tensor, Tensor, Tensor)");
    // the plan builders (implemented in Python, ops.py): the flat launch plan of a call
    m.def("_fwd_plan(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
          "int max_seqlen_k, float dropout_p, float softmax_scale, bool causal, Tensor? rng_state, "
          "bool deterministic, Tensor? bs_rows, Tensor? bs_cols, int window_left, int window_right, "
          "float softcap, Tensor? alibi_slopes, Tensor? mm_states, Tensor? mm_error, Tensor? mm0, Tensor? mm1, Tensor? mm2, Tensor? mm3, str mask_mod) -> int[]");
    m.def("_bwd_plan(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
          "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p, float softmax_scale, "
          "bool causal, Tensor? rng_state, bool deterministic, Tensor? bs_cols, int window_left, "
          "int window_right, float softcap, Tensor? alibi_slopes, Tensor? mm_states, Tensor? mm_error, Tensor? mm0, Tensor? mm1, Tensor? mm2, Tensor? mm3, str mask_mod) -> int[]");
    m.def("_record_launches(bool on) -> ()", &flashtrain_host::record_launches);
    m.def("_recorded_launches() -> Tensor[]", &flashtrain_host::recorded_launches);
    m.def("_clear_plans() -> ()", &flashtrain_host::clear_plans);
}

TORCH_LIBRARY_IMPL(flashtrain, CUDA, m) {
    m.impl("flash_attn_fwd", &flashtrain_host::fwd_kernel);
    m.impl("flash_attn_bwd", &flashtrain_host::bwd_kernel);
}

TORCH_LIBRARY_IMPL(flashtrain, CPU, m) {  // record mode only (execute raises otherwise)
    m.impl("flash_attn_fwd", &flashtrain_host::fwd_kernel);
    m.impl("flash_attn_bwd", &flashtrain_host::bwd_kernel);
}

TORCH_LIBRARY_IMPL(flashtrain, Autograd, m) {
    m.impl("flash_attn_fwd", &flashtrain_host::fwd_autograd);
}
