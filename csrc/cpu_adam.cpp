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
// Results are bit-identical to DeepSpeedCPUAdam on the same inputs: every element goes through
// DeepSpeed's code path with the same constants, tiles are whole multiples of the widest SIMD
// span (so each element takes the same vector or scalar path as in one call over the segment),
// and the scaling / conversions are single IEEE operations as torch does them.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_adam.h"

// Defined in DeepSpeed's cpu_adam_impl.cpp: dispatch on the tensors' dtypes to
// Adam_Optimizer::Step_8 (SIMD, then the scalar tail).
void invoke(std::shared_ptr<Adam_Optimizer> opt,
            torch::Tensor& params,
            torch::Tensor& grads,
            torch::Tensor& exp_avg,
            torch::Tensor& exp_avg_sq,
            size_t param_size,
            bool parallel);

namespace {

// Elements per tile: a multiple of 16 lanes x span 8 (AVX512), small enough that a tile's
// master, m, v, gradient and scratch (5 x 256 KiB) stay in L2 between the fused passes.
constexpr int64_t kTile = 64 * 1024;

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

void write_copy(const float* src, torch::Tensor& out, int64_t lo, int64_t n)
{
    switch (out.scalar_type()) {
        case at::kFloat: std::memcpy(out.data_ptr<float>() + lo, src, n * sizeof(float)); break;
        case at::kHalf: narrow(src, out.data_ptr<at::Half>() + lo, n); break;
        case at::kBFloat16: narrow(src, out.data_ptr<at::BFloat16>() + lo, n); break;
        default: TORCH_CHECK(false, "unsupported copy dtype");
    }
}

template <typename G>
void run_tiles(const std::shared_ptr<Adam_Optimizer>& opt,
               torch::Tensor& params,
               const G* grads,
               torch::Tensor& exp_avg,
               torch::Tensor& exp_avg_sq,
               float scale,
               bool need_copy,
               torch::Tensor* backup,
               torch::Tensor* param_copy,
               int64_t n,
               int threads)
{
    float* p = params.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    const int64_t n_tiles = (n + kTile - 1) / kTile;
    if (threads < 1) threads = 1;
    threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(n_tiles, 1)));
    std::vector<std::vector<float>> scratch(threads);
    if (need_copy) {
        for (auto& s : scratch) s.resize(std::min(kTile, n));
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n_tiles; ++t) {
#ifdef _OPENMP
        const int me = omp_get_thread_num();
#else
        const int me = 0;
#endif
        const int64_t lo = t * kTile;
        const int64_t len = std::min(kTile, n - lo);
        if (backup != nullptr) {
            std::memcpy(backup[0].data_ptr<float>() + lo, p + lo, len * sizeof(float));
            std::memcpy(backup[1].data_ptr<float>() + lo, m + lo, len * sizeof(float));
            std::memcpy(backup[2].data_ptr<float>() + lo, v + lo, len * sizeof(float));
        }
        float* g = grad_tile(grads + lo, need_copy ? scratch[me].data() : nullptr, len, scale,
                             need_copy);
        // Tensors over this tile (no allocation: views of the caller's memory).
        auto opts = torch::TensorOptions().dtype(torch::kFloat32);
        torch::Tensor pt = torch::from_blob(p + lo, {len}, opts);
        torch::Tensor gt = torch::from_blob(g, {len}, opts);
        torch::Tensor mt = torch::from_blob(m + lo, {len}, opts);
        torch::Tensor vt = torch::from_blob(v + lo, {len}, opts);
        invoke(opt, pt, gt, mt, vt, static_cast<size_t>(len), false);
        if (param_copy != nullptr) write_copy(p + lo, *param_copy, lo, len);
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

    std::shared_ptr<Adam_Optimizer> snapshot;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_states.find(id);
        TORCH_CHECK(it != g_states.end(), "no CPU Adam state with id ", id, " (create it first)");
        // DeepSpeed's order: advance beta^t for this step, then set lr / eps / corrections.
        it->second->IncrementStep(static_cast<size_t>(step), static_cast<float>(beta1),
                                  static_cast<float>(beta2));
        it->second->update_state(static_cast<float>(lr), static_cast<float>(eps),
                                 static_cast<float>(weight_decay), bias_correction);
        snapshot = std::make_shared<Adam_Optimizer>(*it->second);
    }
    if (n == 0) return;
    const float scale = static_cast<float>(grad_scale);
    const bool need_copy = grads.scalar_type() != at::kFloat || scale != 1.0f;
    torch::Tensor* bk = backup.empty() ? nullptr : backup.data();
    torch::Tensor* pc = param_copy.has_value() ? &*param_copy : nullptr;

    pybind11::gil_scoped_release no_gil;
    switch (grads.scalar_type()) {
        case at::kFloat:
            run_tiles(snapshot, params, grads.data_ptr<float>(), exp_avg, exp_avg_sq, scale,
                      need_copy, bk, pc, n, static_cast<int>(threads));
            break;
        case at::kHalf:
            run_tiles(snapshot, params, grads.data_ptr<at::Half>(), exp_avg, exp_avg_sq, scale,
                      need_copy, bk, pc, n, static_cast<int>(threads));
            break;
        default:
            run_tiles(snapshot, params, grads.data_ptr<at::BFloat16>(), exp_avg, exp_avg_sq,
                      scale, need_copy, bk, pc, n, static_cast<int>(threads));
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
