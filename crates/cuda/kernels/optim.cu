// Optimizer steps in place, PyTorch's rules element by element (the cpu kernel's Note [Optimizer
// arithmetic]: hyper-parameters derived in f64 on the host, cast to the parameter's dtype).

// One Adam step's hyper-parameters as the host derives them (Python floats); each is cast to the
// parameter's dtype where it is used, as the cpu kernel casts them.
struct AdamArgs {
    double decay;
    i64 has_decay;
    double l2;
    i64 has_l2;
    double lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

// One element's Adam step: the parameter, its gradient and its two moments (in place).
template <typename T>
__device__ __forceinline__ void adam_element(const AdamArgs& a, T& p, T g, T& m, T& v) {
    T param = p, gi = g, w = T(a.lerp_weight);
    if (a.has_decay) param *= T(a.decay);
    if (a.has_l2) gi += T(a.l2) * param;
    T m_new = w < T(0.5) ? m + w * (gi - m) : gi - (gi - m) * (T(1) - w);
    T v_new = v * T(a.beta2) + T(a.one_minus_beta2) * gi * gi;
    T denom = sqrt(v_new) / T(a.bc2_sqrt) + T(a.eps);
    p = param + T(a.neg_step_size) * m_new / denom;
    m = m_new;
    v = v_new;
}

#define OPTIM(T, SUF)                                                                                   \
    /* SGD: g' = g + wd p; buf = g' (first step) or m buf + (1 - d) g'; p -= lr (nesterov ? g' + m buf : buf). */ \
    extern "C" __global__ void sgd_##SUF(T* p, const T* g, T* buf, T wd, int has_wd, T momentum, T one_minus_dampening, int nesterov, int first, T neg_lr, i64 n) { \
        GRID_STRIDE(i, n) {                                                                             \
            T gi = has_wd ? g[i] + wd * p[i] : g[i];                                                    \
            if (buf) {                                                                                  \
                T b = first ? gi : buf[i] * momentum + one_minus_dampening * gi;                        \
                buf[i] = b;                                                                             \
                gi = nesterov ? gi + momentum * b : b;                                                  \
            }                                                                                           \
            p[i] += neg_lr * gi;                                                                        \
        }                                                                                               \
    }                                                                                                   \
    /* Adam/AdamW: ATen's two-sided lerp for exp_avg, addcmul for exp_avg_sq, addcdiv for the step. */ \
    extern "C" __global__ void adam_##SUF(T* p, const T* g, T* m, T* v, AdamArgs a, i64 n) {       \
        GRID_STRIDE(i, n) adam_element<T>(a, p[i], g[i], m[i], v[i]);                                   \
    }                                                                                                   \
    /* grad *= inv_scale; *found_inf = 1 when a value is inf or NaN before or after. */                 \
    extern "C" __global__ void unscale_##SUF(T* g, T inv_scale, int* found_inf, i64 n) {                \
        GRID_STRIDE(i, n) {                                                                             \
            T before = g[i], after = before * inv_scale;                                                \
            if (!isfinite(before) || !isfinite(after)) *found_inf = 1;                                  \
            g[i] = after;                                                                               \
        }                                                                                               \
    }

OPTIM(float, f32)
OPTIM(double, f64)

// Adam over up to ADAM_LIST f32 tensors in one launch (the optimizer's step, a launch per tensor
// before): tensor t holds the elements start[t] .. start[t + 1] of the list's walk; each element's
// step is adam_f32's. Passed by value (2 KiB of the launch's 4 KiB of arguments).
#define ADAM_LIST 48
struct AdamList {
    i64 count;
    i64 start[ADAM_LIST + 1];
    float* p[ADAM_LIST];
    const float* g[ADAM_LIST];
    float* m[ADAM_LIST];
    float* v[ADAM_LIST];
};

// The tensor of a list (`count` of them, tensor t the elements start[t] .. start[t + 1] of the
// walk) that holds element e: the last whose walk starts at or before e (empty tensors start where
// the next does).
__device__ __forceinline__ int list_tensor(const i64* start, i64 count, i64 e) {
    int lo = 0, hi = (int)count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (start[mid] <= e) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void adam_list_f32(AdamList list, AdamArgs a) {
    GRID_STRIDE(e, list.start[list.count]) {
        const int lo = list_tensor(list.start, list.count, e);
        i64 j = e - list.start[lo];
        adam_element<float>(a, list.p[lo][j], list.g[lo][j], list.m[lo][j], list.v[lo][j]);
    }
}

// unscale_f32 over up to ADAM_LIST f32 tensors in one launch (a launch per tensor before: GPT-2's
// 148 parameters, checked for NaN and infinity after every step), tensor t the elements start[t] ..
// start[t + 1] of the walk; with inv_scale 1 (that check) nothing is written: x * 1 is x.
struct TensorList {
    i64 count;
    i64 start[ADAM_LIST + 1];
    float* t[ADAM_LIST];
};

extern "C" __global__ void unscale_list_f32(TensorList list, float inv_scale, int* found_inf) {
    GRID_STRIDE(e, list.start[list.count]) {
        const int lo = list_tensor(list.start, list.count, e);
        float* g = list.t[lo] + (e - list.start[lo]);
        const float before = *g, after = before * inv_scale;
        if (!isfinite(before) || !isfinite(after)) *found_inf = 1;
        if (inv_scale != 1.0f) *g = after;
    }
}

// Compact moments of an f32 parameter (the cpu kernels' Note [Compact optimizer state]; the
// bfloat16 casts are common.cuh's).

extern "C" __global__ void adam_bf16_state_f32(float* p, const float* g, unsigned short* m, unsigned short* v, AdamArgs a, i64 n) {
    GRID_STRIDE(i, n) {
        float mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
        adam_element<float>(a, p[i], g[i], mi, vi);
        m[i] = f32_to_bf16(mi);
        v[i] = f32_to_bf16(vi);
    }
}

#define QUANT_BLOCK 2048
#define QUANT_THREADS 256

// The two dynamic maps, by value (signed for exp_avg, unsigned for exp_avg_sq).
struct Maps {
    float signed_map[256];
    float unsigned_map[256];
};

// The code of x: the number of midpoints (between consecutive entries of its map, mids[255] +inf)
// below x, i.e. the nearest entry, the lower one on a tie (the cpu kernel's Codebook).
__device__ unsigned char quantize(const float* mids, float x) {
    int base = 0;
    for (int half = 128; half > 0; half >>= 1) base += (mids[base + half - 1] < x) ? half : 0;
    return (unsigned char)base;
}

// One block of 256 threads per block of QUANT_BLOCK values: read through the absolute maxima
// (exp_avg's, and of exp_avg_sq's square root), updated, the new maxima found, stored again.
extern "C" __global__ void adam_8bit_f32(float* p, const float* g, unsigned char* mc, float* ma, unsigned char* vc, float* va,
                                         AdamArgs a, Maps maps, i64 n) {
    __shared__ float smap[256], umap[256], smid[256], umid[256], shared[QUANT_THREADS];
    smap[threadIdx.x] = maps.signed_map[threadIdx.x];
    umap[threadIdx.x] = maps.unsigned_map[threadIdx.x];
    __syncthreads();
    int t = threadIdx.x;
    smid[t] = t < 255 ? (smap[t] + smap[t + 1]) * 0.5f : INFINITY;
    umid[t] = t < 255 ? (umap[t] + umap[t + 1]) * 0.5f : INFINITY;
    __syncthreads();
    const int per = QUANT_BLOCK / QUANT_THREADS;
    for (i64 b = blockIdx.x; b * QUANT_BLOCK < n; b += gridDim.x) {
        float m_old = ma[b], v_old = va[b];
        float mv[QUANT_BLOCK / QUANT_THREADS], vv[QUANT_BLOCK / QUANT_THREADS];
        float m_max = 0.0f, v_max = 0.0f;
        for (int j = 0; j < per; ++j) {
            i64 i = b * QUANT_BLOCK + threadIdx.x + (i64)j * QUANT_THREADS;
            if (i >= n) { mv[j] = 0.0f; vv[j] = 0.0f; continue; }
            float mi = smap[mc[i]] * m_old, root = umap[vc[i]] * v_old, vi = root * root;
            adam_element<float>(a, p[i], g[i], mi, vi);
            mv[j] = mi;
            vv[j] = sqrtf(vi);
            m_max = fmaxf(m_max, fabsf(mi));
            v_max = fmaxf(v_max, vv[j]);
        }
        m_max = block_max<float>(m_max, shared);
        v_max = block_max<float>(v_max, shared);
        float m_inv = m_max > 0.0f ? 1.0f / m_max : 0.0f, v_inv = v_max > 0.0f ? 1.0f / v_max : 0.0f;
        for (int j = 0; j < per; ++j) {
            i64 i = b * QUANT_BLOCK + threadIdx.x + (i64)j * QUANT_THREADS;
            if (i >= n) continue;
            mc[i] = quantize(smid, mv[j] * m_inv);
            // A positive value keeps at least the smallest positive code (code 1 of the unsigned map).
            unsigned char code = quantize(umid, vv[j] * v_inv);
            vc[i] = (vv[j] > 0.0f && code < 1) ? 1 : code;
        }
        if (threadIdx.x == 0) { ma[b] = m_max; va[b] = v_max; }
        __syncthreads();
    }
}
