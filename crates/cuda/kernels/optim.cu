// Optimizer steps in place, PyTorch's rules element by element (the cpu kernel's Note [Optimizer
// arithmetic]: hyper-parameters derived in f64 on the host, cast to the parameter's dtype).

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
    extern "C" __global__ void adam_##SUF(T* p, const T* g, T* m, T* v, T decay, int has_decay, T l2, int has_l2, T lerp_weight, T beta2, T one_minus_beta2, T bc2_sqrt, T eps, T neg_step_size, i64 n) { \
        GRID_STRIDE(i, n) {                                                                             \
            T param = p[i], gi = g[i];                                                                  \
            if (has_decay) param *= decay;                                                              \
            if (has_l2) gi += l2 * param;                                                               \
            T mi = m[i];                                                                                \
            T m_new = lerp_weight < T(0.5) ? mi + lerp_weight * (gi - mi) : gi - (gi - mi) * (T(1) - lerp_weight); \
            T v_new = v[i] * beta2 + one_minus_beta2 * gi * gi;                                         \
            T denom = sqrt(v_new) / bc2_sqrt + eps;                                                     \
            p[i] = param + neg_step_size * m_new / denom;                                               \
            m[i] = m_new;                                                                               \
            v[i] = v_new;                                                                               \
        }                                                                                               \
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
