// ProTrain's CPU Adam: DeepSpeed's SIMD Adam kernel (cpu_adam_impl.cpp, compiled beside this
// file with DeepSpeed's own flags) behind a binding that
//
//  - releases the Python GIL for the whole update, so the training thread keeps running its
//    hooks while an offloaded chunk is updated (DeepSpeed's binding holds it throughout);
//  - keeps no mutable state shared between concurrent calls: the step counter and beta^t live
//    in one state per optimizer id, advanced under a mutex exactly as DeepSpeed advances them,
//    and each call computes with its own snapshot (DeepSpeed's binding writes lr / eps / bias
//    corrections into the shared object, so two threads stepping one id would race);
//  - fuses, tile by tile while the data is in cache, what the chunk path does around an update:
//    scaling the gradients (clipping coefficient, inverse loss scale) and widening 16-bit ones
//    into a scratch tile (the gradient region itself is never written: a speculative update
//    can be redone from it); a backup of the fp32 master, exp_avg and exp_avg_sq taken just
//    before the update (exact rollback of a speculative step); and writing the updated
//    parameters in the training dtype into the pinned upload region.
//
// Work split: one OpenMP parallel region per update; each thread takes one contiguous share of
// the segment, as the static schedule of DeepSpeed's `omp parallel for` in Step_AVX does over
// the whole tensor, and runs DeepSpeed's Step_8 on it serially (parallel=false) -- in one call
// when there is nothing to fuse (fp32 gradients, scale 1, no backup, no copy), tile by tile
// (kTile) otherwise. Step_8 is reached on raw pointers through DeepSpeed's step_invoker<P, S>
// (the function its invoke() dispatches to). The earlier binding wrapped every 64K tile,
// plain updates included, in four torch::from_blob tensors and called invoke() (dtype map,
// std::function, shared_ptr copies): ~2.3 us a tile on one core, 150 tiles a thread for 20 M
// elements, ~0.35 ms against a 12-27 ms update (1-3%). What differs from DeepSpeed's op beyond
// that is where the linker puts the (identical) loop: on the 2-core EPYC VM of bench/results
// that alone moved its speed by up to ~6%, between builds differing only by a padding function
// and between runs.
//
// Results are bit-identical to DeepSpeedCPUAdam on the same inputs: every element goes through
// DeepSpeed's code path with the same constants, thread shares and tiles start at multiples of
// the widest SIMD span (so each element takes the same vector or scalar path as in one call over
// the segment), and the scaling / conversions are single IEEE operations as torch does them.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu_adam.h"

// Defined in DeepSpeed's cpu_adam_impl.cpp (instantiated there for each dtype pair its invoke()
// dispatches to): Adam_Optimizer::Step_8 on raw pointers, the SIMD blocks then the scalar tail.
// A changed signature fails loudly, as an undefined symbol when the module loads.
template <typename ds_params_precision_t, typename ds_state_precision_t>
void step_invoker(std::shared_ptr<Adam_Optimizer> opt,
                  void* _params,
                  void* grads,
                  void* _exp_avg,
                  void* _exp_avg_sq,
                  size_t _param_size,
                  bool parallel);

namespace {

// Thread shares and tiles start at multiples of this many elements: 16 lanes x span 8 (the
// widest Step_AVX block, AVX512; AVX2's 8 x 8 and NEON's divide it).
constexpr int64_t kAlign = 16 * 8;

// Elements per tile of a fused update (a multiple of kAlign): a tile's master, m, v, gradient
// and scratch (5 x 256 KiB) stay in cache between the fused passes. On the 2-core VM of
// bench/results (512 KiB L2 a core) 16K-128K tiles came within 5% of each other; 64K was the
// best for the bf16 pass (widen + update + upload copy), where tiling matters most.
constexpr int64_t kTile = 64 * 1024;
static_assert(kTile % kAlign == 0, "tiles must start on whole SIMD blocks");

std::mutex g_mutex;
std::unordered_map<int64_t, std::shared_ptr<Adam_Optimizer>> g_states;

void create(int64_t id, bool adamw)
{
    std::lock_guard<std::mutex> lock(g_mutex);
    g_states[id] = std::make_shared<Adam_Optimizer>(1e-3, 0.9, 0.999, 1e-8, 0.0, adamw);
}

void destroy(int64_t id)
{
    std::lock_guard<std::mutex> lock(g_mutex);
    g_states.erase(id);
}

void check(const torch::Tensor& t, const char* name, int64_t n, bool fp32_only)
{
    TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
    auto d = t.scalar_type();
    if (fp32_only) {
        TORCH_CHECK(d == at::kFloat, name, " must be float32, got ", d);
    } else {
        TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16,
                    name, " must be float32, float16 or bfloat16, got ", d);
    }
}

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }

// Gradient tile as fp32 (scaled when scale != 1), or the gradient itself when nothing to do.
template <typename G>
float* grad_tile(const G* g, float* scratch, int64_t n, float scale, bool need_copy)
{
    if (!need_copy) return reinterpret_cast<float*>(const_cast<G*>(g));
    if (scale == 1.0f) {
        for (int64_t i = 0; i < n; ++i) scratch[i] = widen(g[i]);
    } else {
        for (int64_t i = 0; i < n; ++i) scratch[i] = widen(g[i]) * scale;
    }
    return scratch;
}

template <typename O>
void narrow(const float* src, O* dst, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<O>(src[i]);
}

// Where the fused passes read and write; raw pointers taken once, before the GIL is released.
struct Segment {
    float* p;
    float* m;
    float* v;
    float* backup[3];           // all null: no backup
    void* copy;                 // null: no upload copy
    at::ScalarType copy_type;
};

void write_copy(const float* src, const Segment& s, int64_t lo, int64_t n)
{
    switch (s.copy_type) {
        case at::kFloat:
            std::memcpy(static_cast<float*>(s.copy) + lo, src, n * sizeof(float));
            break;
        case at::kHalf: narrow(src, static_cast<at::Half*>(s.copy) + lo, n); break;
        default: narrow(src, static_cast<at::BFloat16*>(s.copy) + lo, n); break;
    }
}

// The backup's copy of a tile: streamed past the caches where the CPU has AVX (non-temporal
// stores: no read of the destination lines first, and the tile's states stay in cache for the
// update that follows, where memcpy's writes would evict them). The rollback reads the backup
// once, much later. Bits as memcpy's; each thread fences its streamed stores before it leaves.
static inline void backup_copy(float* dst, const float* src, int64_t n)
{
#if defined(__AVX__)
    int64_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = src[i];
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    for (; i < n; ++i) dst[i] = src[i];
#else
    std::memcpy(dst, src, n * sizeof(float));
#endif
}

template <typename G>
void run(const Adam_Optimizer& state, const Segment& s, const G* grads, float scale,
         bool need_copy, int64_t n, int threads)
{
    const bool fused = need_copy || s.backup[0] != nullptr || s.copy != nullptr;
    const int64_t blocks = (n + kAlign - 1) / kAlign;
    if (threads < 1) threads = 1;
    threads = static_cast<int>(std::min<int64_t>(threads, blocks));
    // Per thread, allocated here (an allocation failure is an exception for Python, not a
    // terminate inside the parallel region): a private copy of the state (Step_8 only reads
    // it; no reference count shared between threads) and the gradient scratch tile.
    std::vector<std::shared_ptr<Adam_Optimizer>> opts;
    std::vector<std::vector<float>> scratch(threads);
    for (int t = 0; t < threads; ++t) {
        opts.push_back(std::make_shared<Adam_Optimizer>(state));
        if (need_copy) scratch[t].resize(std::min(kTile, n));
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t nt = 1, me = 0;
#endif
        // This thread's contiguous share, starting on a whole SIMD block.
        const int64_t share = (blocks + nt - 1) / nt * kAlign;
        const int64_t lo = std::min(me * share, n), hi = std::min(lo + share, n);
        const std::shared_ptr<Adam_Optimizer>& opt = opts[me];
        const int64_t tile = fused ? kTile : std::max<int64_t>(hi - lo, 1);
        for (int64_t a = lo; a < hi; a += tile) {
            const int64_t len = std::min(tile, hi - a);
            if (s.backup[0] != nullptr) {
                backup_copy(s.backup[0] + a, s.p + a, len);
                backup_copy(s.backup[1] + a, s.m + a, len);
                backup_copy(s.backup[2] + a, s.v + a, len);
            }
            float* g = grad_tile(grads + a, scratch[me].data(), len, scale, need_copy);
            step_invoker<float, float>(opt, s.p + a, g, s.m + a, s.v + a,
                                       static_cast<size_t>(len), false);
            if (s.copy != nullptr) write_copy(s.p + a, s, a, len);
        }
#if defined(__AVX__)
        if (s.backup[0] != nullptr) _mm_sfence();   // the streamed backup visible before return
#endif
    }
}

// One Adam(W) step over a flat fp32 segment. ``grads`` may be fp32 or 16-bit and is only read;
// ``grad_scale`` multiplies it first (1.0: untouched). ``backup`` (3 fp32 tensors, or empty)
// receives master, exp_avg, exp_avg_sq as they were before the step; ``param_copy`` (or
// undefined) receives the updated parameters in its own dtype.
void update(int64_t id,
            int64_t step,
            double lr,
            double beta1,
            double beta2,
            double eps,
            double weight_decay,
            bool bias_correction,
            torch::Tensor params,
            torch::Tensor grads,
            torch::Tensor exp_avg,
            torch::Tensor exp_avg_sq,
            double grad_scale,
            std::vector<torch::Tensor> backup,
            c10::optional<torch::Tensor> param_copy,
            int64_t threads)
{
    const int64_t n = params.numel();
    check(params, "params", n, true);
    check(grads, "grads", n, false);
    check(exp_avg, "exp_avg", n, true);
    check(exp_avg_sq, "exp_avg_sq", n, true);
    TORCH_CHECK(backup.empty() || backup.size() == 3, "backup takes 3 tensors (master, exp_avg, "
                "exp_avg_sq), got ", backup.size());
    for (auto& b : backup) check(b, "backup", n, true);
    if (param_copy.has_value()) check(*param_copy, "param_copy", n, false);

    Adam_Optimizer state;   // this call's snapshot: lr, betas, eps, bias corrections
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_states.find(id);
        TORCH_CHECK(it != g_states.end(), "no CPU Adam state with id ", id, " (create it first)");
        // DeepSpeed's order: advance beta^t for this step, then set lr / eps / corrections.
        it->second->IncrementStep(static_cast<size_t>(step), static_cast<float>(beta1),
                                  static_cast<float>(beta2));
        it->second->update_state(static_cast<float>(lr), static_cast<float>(eps),
                                 static_cast<float>(weight_decay), bias_correction);
        state = *it->second;
    }
    if (n == 0) return;
    const float scale = static_cast<float>(grad_scale);
    const bool need_copy = grads.scalar_type() != at::kFloat || scale != 1.0f;
    Segment seg{params.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                {nullptr, nullptr, nullptr}, nullptr, at::kFloat};
    for (size_t i = 0; i < backup.size(); ++i) seg.backup[i] = backup[i].data_ptr<float>();
    if (param_copy.has_value()) {
        seg.copy = param_copy->data_ptr();
        seg.copy_type = param_copy->scalar_type();
    }
    const int nthreads = static_cast<int>(std::clamp<int64_t>(threads, 1, 1024));

    pybind11::gil_scoped_release no_gil;
    switch (grads.scalar_type()) {
        case at::kFloat:
            run(state, seg, grads.data_ptr<float>(), scale, need_copy, n, nthreads);
            break;
        case at::kHalf:
            run(state, seg, grads.data_ptr<at::Half>(), scale, need_copy, n, nthreads);
            break;
        default:
            run(state, seg, grads.data_ptr<at::BFloat16>(), scale, need_copy, n, nthreads);
            break;
    }
}

// Copy ``src`` tensors into ``dst`` ones (a rollback's restore), without the GIL.
void restore(std::vector<torch::Tensor> dst, std::vector<torch::Tensor> src)
{
    TORCH_CHECK(dst.size() == src.size(), "restore: ", dst.size(), " targets, ", src.size(),
                " sources");
    for (size_t i = 0; i < dst.size(); ++i) {
        check(dst[i], "restore target", src[i].numel(), true);
        check(src[i], "restore source", dst[i].numel(), true);
    }
    pybind11::gil_scoped_release no_gil;
    for (size_t i = 0; i < dst.size(); ++i) {
        std::memcpy(dst[i].data_ptr<float>(), src[i].data_ptr<float>(),
                    dst[i].numel() * sizeof(float));
    }
}

int max_threads()
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("create", &create, "create the Adam state (step, beta^t) of an optimizer id");
    m.def("destroy", &destroy, "drop the Adam state of an optimizer id");
    m.def("update", &update, "one fused Adam(W) step on a flat fp32 segment, GIL released");
    m.def("restore", &restore, "copy tensors back (rollback), GIL released");
    m.def("max_threads", &max_threads, "OpenMP threads available");
}
