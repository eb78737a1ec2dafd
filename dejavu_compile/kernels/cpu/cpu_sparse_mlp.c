/* Neuron-sparse MLP and dense GEMV for CPU: one pass over the selected neurons.

   For each selected neuron r the loop reads its gate row, its up row and its down row (a row of
   the transposed down weight), all contiguous, computes act(gate.x) * (up.x) and adds that times
   the down row into a per-thread accumulator. Nothing is copied; the three reads of one neuron are
   issued back to back, so the core keeps several row misses in flight, and a software prefetch
   touches the start of the rows a few neurons ahead (the hardware prefetcher takes over inside a
   row). Threads split the neurons; their accumulators are summed at the end.

   Weights are read as stored, fp32, bf16 or fp16 (DEJAVU_W_*): a half-precision row is widened to
   fp32 as it is loaded (bf16 is the upper half of an fp32, so widening is a shift; fp16 takes F16C's
   conversion), and every product is summed in fp32. Activations arrive in fp32 (the C++ ops widen
   a half-precision model's few activations first and round the result once).

   Built once per machine by native.py (cc -O3 -march=native -fopenmp, plus the activation table's
   defines) and called through ctypes; cpu_ops.cpp includes this file for the C++ ops.
   It links against the OpenMP runtime torch has already loaded, so both share one thread pool. */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

/* The activation table (dejavu_compile/activations.py) arrives as defines from native.py: a code
   DEJAVU_ACT_<NAME> per activation and the X-macro DEJAVU_ACTIVATIONS(X) listing them all. The enum
   collects every table entry, so a table entry without a case below fails the build (-Wswitch as an
   error), and a case naming an activation the table lacks is an undefined identifier. */
#ifndef DEJAVU_ACTIVATIONS
#error "build with the defines of dejavu_compile.activations.c_defines() (kernels/cpu/native.py does)"
#endif
#define DEJAVU_ACT_ENUM(name, NAME) DEJAVU_ACT_ENUM_##NAME = DEJAVU_ACT_##NAME,
enum dejavu_activation { DEJAVU_ACTIVATIONS(DEJAVU_ACT_ENUM) };
#undef DEJAVU_ACT_ENUM

#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
static inline float activate(float v, int code) {
    switch ((enum dejavu_activation)code) {
    case DEJAVU_ACT_SILU: return v / (1.0f + expf(-v));
    case DEJAVU_ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case DEJAVU_ACT_GELU_TANH: {
        float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
        return 0.5f * v * (1.0f + tanhf(inner));
    }
    case DEJAVU_ACT_RELU: return v > 0.0f ? v : 0.0f;
    case DEJAVU_ACT_RELU2: {
        float r = v > 0.0f ? v : 0.0f;
        return r * r;
    }
    }
    return NAN; /* not a table code: the callers map names through the table, so never reached */
}
#pragma GCC diagnostic pop

#if defined(__AVX512F__)
#define DEJAVU_VEC 16
typedef __m512 vec_t;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vset1(s) _mm512_set1_ps(s)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
static inline float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
#define vload_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define vload_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DEJAVU_VEC 8
typedef __m256 vec_t;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vset1(s) _mm256_set1_ps(s)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vload_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define vload_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline float vsum(vec_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* silu(v) = v / (1 + exp(-v)) in vector lanes: exp as 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2
   (in two parts) and Cephes' degree-6 polynomial for p (about 1 ulp), x clamped to where expf is finite.
   libm's expf is scalar, and a GLU predictor evaluates it for every neuron of every layer: scalar it
   cost a decode step of the int8 SmolLM2 about 0.35 ms. A NaN v gives NaN (v is the numerator). */
#if defined(DEJAVU_VEC)
#if defined(__AVX512F__)
#define vmin(a, b) _mm512_min_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vround(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#else
#define vmin(a, b) _mm256_min_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vround(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#endif
static inline vec_t vexp(vec_t x) {
    x = vmax(vmin(x, vset1(88.3762626647949f)), vset1(-87.3365447504019f));
    const vec_t n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec_t r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec_t p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vmul(p, vpow2i(n));
}
static inline vec_t vsilu(vec_t v) {
    return vdiv(v, vadd(vset1(1.0f), vexp(vmul(v, vset1(-1.0f)))));
}
#endif

/* out[j] = act(ga * g[j]) * (ua * u[j]) for j < n (|...| with magnitude): a GLU's neuron values from
   its gate and up sums and their scales. silu and relu in vector lanes, the others through activate. */
static void glu_values(float *out, const float *g, const float *u, int64_t n, float ga, float ua, int activation,
                       int magnitude) {
    int64_t j = 0;
#if defined(DEJAVU_VEC)
    if (activation == DEJAVU_ACT_SILU || activation == DEJAVU_ACT_RELU) {
        const vec_t a = vset1(ga), b = vset1(ua), sign = vset1(-0.0f);
        for (; j + DEJAVU_VEC <= n; j += DEJAVU_VEC) {
            const vec_t gv = vmul(vload(g + j), a);
            const vec_t h = vmul(activation == DEJAVU_ACT_SILU ? vsilu(gv) : vmax(gv, vzero()), vmul(vload(u + j), b));
#if defined(__AVX512F__)
            vstore(out + j, magnitude ? _mm512_andnot_ps(sign, h) : h);
#else
            vstore(out + j, magnitude ? _mm256_andnot_ps(sign, h) : h);
#endif
        }
    }
#endif
    for (; j < n; j++) {
        const float h = activate(ga * g[j], activation) * (ua * u[j]);
        out[j] = magnitude ? fabsf(h) : h;
    }
}

/* fp32 lanes of the build's vector loops: 16 (AVX-512), 8 (AVX2 with FMA and F16C), 1 (scalar). */
int dejavu_vector_width(void) {
#ifdef DEJAVU_VEC
    return DEJAVU_VEC;
#else
    return 1;
#endif
}

/* ---- Weight element types ---------------------------------------------------------------------

   The C++ ops pass one of these codes with every weight pointer (cpu_ops.cpp's weight_type). */
enum { DEJAVU_W_F32 = 0, DEJAVU_W_BF16 = 1, DEJAVU_W_F16 = 2 };

static inline int64_t element_bytes(int type) { return type == DEJAVU_W_F32 ? 4 : 2; }

static inline float f32_value(float v) { return v; }

static inline float bf16_value(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half to float, exact (subnormals, infinities and NaN included); for the vector tails. */
static inline float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f; /* 2^-24 */
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One row dotted with x, for each element type. Four accumulators keep enough multiply-adds in
   flight. One row at a time keeps each thread's reads a single forward stream, which the hardware
   prefetcher follows at full bandwidth; reading four rows side by side gives each thread four
   streams, which it follows worse. */
#ifdef DEJAVU_VEC
#define DEJAVU_DOT(name, type, vload_w, value)                                                     \
    static inline float name(const type *restrict w, const float *restrict x, int64_t n) {          \
        int64_t i = 0;                                                                             \
        vec_t a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;                                             \
        for (; i + 4 * DEJAVU_VEC <= n; i += 4 * DEJAVU_VEC) {                                     \
            a0 = vfma(vload_w(w + i), vload(x + i), a0);                                           \
            a1 = vfma(vload_w(w + i + DEJAVU_VEC), vload(x + i + DEJAVU_VEC), a1);                 \
            a2 = vfma(vload_w(w + i + 2 * DEJAVU_VEC), vload(x + i + 2 * DEJAVU_VEC), a2);         \
            a3 = vfma(vload_w(w + i + 3 * DEJAVU_VEC), vload(x + i + 3 * DEJAVU_VEC), a3);         \
        }                                                                                          \
        for (; i + DEJAVU_VEC <= n; i += DEJAVU_VEC) a0 = vfma(vload_w(w + i), vload(x + i), a0);  \
        float s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));                                          \
        for (; i < n; i++) s += value(w[i]) * x[i];                                                \
        return s;                                                                                  \
    }
/* acc[i] += v * row[i] */
#define DEJAVU_AXPY(name, type, vload_w, value)                                                    \
    static inline void name(float *restrict acc, float v, const type *restrict row, int64_t n) {   \
        int64_t i = 0;                                                                             \
        const vec_t vv = vset1(v);                                                                 \
        for (; i + DEJAVU_VEC <= n; i += DEJAVU_VEC) vstore(acc + i, vfma(vv, vload_w(row + i), vload(acc + i))); \
        for (; i < n; i++) acc[i] += v * value(row[i]);                                            \
    }
/* acc[i] += v[0] * r0[i] + ... + v[3] * r3[i]: four rows per pass over acc (a quarter of its loads
   and stores, which otherwise cost as much as widening the half-precision rows). */
#define DEJAVU_AXPY4(name, type, vload_w, value)                                                   \
    static inline void name(float *restrict acc, const float *v, const type *r0, const type *r1,   \
                            const type *r2, const type *r3, int64_t n) {                           \
        int64_t i = 0;                                                                             \
        const vec_t v0 = vset1(v[0]), v1 = vset1(v[1]), v2 = vset1(v[2]), v3 = vset1(v[3]);       \
        for (; i + DEJAVU_VEC <= n; i += DEJAVU_VEC) {                                             \
            vec_t a = vfma(v0, vload_w(r0 + i), vload(acc + i));                                   \
            a = vfma(v1, vload_w(r1 + i), a);                                                      \
            a = vfma(v2, vload_w(r2 + i), a);                                                      \
            vstore(acc + i, vfma(v3, vload_w(r3 + i), a));                                         \
        }                                                                                          \
        for (; i < n; i++)                                                                         \
            acc[i] += v[0] * value(r0[i]) + v[1] * value(r1[i]) + v[2] * value(r2[i]) + v[3] * value(r3[i]); \
    }
#else
#define DEJAVU_AXPY4(name, type, vload_w, value)                                                   \
    static inline void name(float *restrict acc, const float *v, const type *r0, const type *r1,   \
                            const type *r2, const type *r3, int64_t n) {                           \
        for (int64_t i = 0; i < n; i++)                                                            \
            acc[i] += v[0] * value(r0[i]) + v[1] * value(r1[i]) + v[2] * value(r2[i]) + v[3] * value(r3[i]); \
    }
#define DEJAVU_DOT(name, type, vload_w, value)                                                     \
    static inline float name(const type *restrict w, const float *restrict x, int64_t n) {          \
        float s = 0.0f;                                                                            \
        for (int64_t i = 0; i < n; i++) s += value(w[i]) * x[i];                                   \
        return s;                                                                                  \
    }
#define DEJAVU_AXPY(name, type, vload_w, value)                                                    \
    static inline void name(float *restrict acc, float v, const type *restrict row, int64_t n) {   \
        for (int64_t i = 0; i < n; i++) acc[i] += v * value(row[i]);                               \
    }
#endif
DEJAVU_DOT(dot_f32, float, vload, f32_value)
DEJAVU_DOT(dot_bf16, uint16_t, vload_bf16, bf16_value)
DEJAVU_DOT(dot_f16, uint16_t, vload_f16, f16_value)
DEJAVU_AXPY(axpy_bf16, uint16_t, vload_bf16, bf16_value)
DEJAVU_AXPY(axpy_f16, uint16_t, vload_f16, f16_value)
DEJAVU_AXPY4(axpy4_bf16, uint16_t, vload_bf16, bf16_value)
DEJAVU_AXPY4(axpy4_f16, uint16_t, vload_f16, f16_value)
#undef DEJAVU_DOT
#undef DEJAVU_AXPY
#undef DEJAVU_AXPY4

static inline void axpy_f32(float *restrict acc, float v, const float *restrict row, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) acc[i] += v * row[i];
}

/* A row of `type` elements at `row`: its dot product with x, and acc += v * row. */
static inline float dot_typed(const void *row, int type, const float *restrict x, int64_t n) {
    if (type == DEJAVU_W_BF16) return dot_bf16((const uint16_t *)row, x, n);
    if (type == DEJAVU_W_F16) return dot_f16((const uint16_t *)row, x, n);
    return dot_f32((const float *)row, x, n);
}

static inline void axpy_typed(float *restrict acc, float v, const void *row, int type, int64_t n) {
    if (type == DEJAVU_W_BF16) axpy_bf16(acc, v, (const uint16_t *)row, n);
    else if (type == DEJAVU_W_F16) axpy_f16(acc, v, (const uint16_t *)row, n);
    else axpy_f32(acc, v, (const float *)row, n);
}

/* Row r of a matrix of `type` elements whose rows are `stride` elements apart. */
static inline const void *row_at(const void *base, int type, int64_t r, int64_t stride) {
    return (const char *)base + r * stride * element_bytes(type);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void prefetch(const void *row, int64_t row_bytes, int64_t max_bytes) {
    int64_t n = row_bytes < max_bytes ? row_bytes : max_bytes;
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)row + o, 0, 3);
}

/* Thread t of n_t sums its slice of the `width` output columns over the n_t per-thread
   accumulators in scratch (width floats apart), adding bias[c % bias_len] when bias is given.
   Called by every thread of a parallel region after its barrier. */
static inline void sum_partials(const float *scratch, int64_t width, const float *bias, int64_t bias_len,
                                float *out, int t, int n_t) {
    const int64_t c_lo = width * t / n_t, c_hi = width * (t + 1) / n_t;
    for (int64_t c = c_lo; c < c_hi; c++) {
        float s = bias ? bias[c % bias_len] : 0.0f;
        for (int u = 0; u < n_t; u++) s += scratch[(int64_t)u * width + c];
        out[c] = s;
    }
}

/* Per-machine settings. The sparse MLP's prefetch: the first mlp_prefetch_bytes of each row,
   mlp_prefetch_rows neurons ahead (the start of a row is what the hardware prefetcher cannot guess;
   prefetching whole rows competes with the demand reads). The dense GEMV's: the row
   linear_prefetch_rows ahead (0: none, the hardware prefetcher alone). The int8 GEMVs' (the
   quantized projections and the int8 predictor): the row int8_prefetch_rows ahead, with its scales.
   An int8 row is a quarter of an fp32 one, too short for the hardware prefetcher to ramp up on:
   without it the int8 GEMV read its weights at about half the fp32 GEMV's rate. native.py measures
   them once per build and machine (machine_tuning) and sets them here; these defaults hold until
   then. The sparse MLP's callers pass -1 to use them; benchmarks/kernels.py --prefetch-sweep passes others. */
typedef struct {
    int64_t mlp_prefetch_rows, mlp_prefetch_bytes, linear_prefetch_rows, int8_prefetch_rows;
} dejavu_tuning_t;
dejavu_tuning_t dejavu_tuning = {4, 256, 0, 8};

void dejavu_set_tuning(int64_t mlp_prefetch_rows, int64_t mlp_prefetch_bytes, int64_t linear_prefetch_rows,
                       int64_t int8_prefetch_rows) {
    dejavu_tuning.mlp_prefetch_rows = mlp_prefetch_rows;
    dejavu_tuning.mlp_prefetch_bytes = mlp_prefetch_bytes;
    dejavu_tuning.linear_prefetch_rows = linear_prefetch_rows;
    dejavu_tuning.int8_prefetch_rows = int8_prefetch_rows;
}

/* out[b] = sum_j act(w_a[r].x_b + b_a[r]) * (w_b[r].x_b + b_b[r]) * w_down_t[r] + b_down,
   r = idx[b * idx_row_stride + j] for j < k.

   x: (nb, d) contiguous. w_a, w_b: rows of d elements of w_type (DEJAVU_W_*), `*_stride` elements
   apart (w_b NULL: plain MLP, h = act(w_a[r].x + b_a[r])). w_down_t: rows of d_out elements,
   down_stride apart. Biases NULL or contiguous fp32. idx_row_stride 0: one idx list shared by every
   row of x, and each weight row is read once for all rows. scratch: n_threads * nb * d_out floats.
   out: (nb, d_out) contiguous. prefetch_rows < 0: the machine's setting (dejavu_tuning). fp32 rows
   take the compiler-vectorised loops (dot, axpy_f32); half-precision rows widen as they load. */
void dejavu_sparse_mlp(const float *x, int64_t nb, int64_t d, int64_t d_out, int w_type,
                       const void *w_a, int64_t a_stride, const void *w_b, int64_t b_stride,
                       const void *w_down_t, int64_t down_stride,
                       const float *b_a, const float *b_b, const float *b_down,
                       const int64_t *idx, int64_t k, int64_t idx_row_stride, int activation,
                       float *out, float *scratch, int n_threads,
                       int64_t prefetch_rows, int64_t prefetch_bytes) {
    if (prefetch_rows < 0) prefetch_rows = dejavu_tuning.mlp_prefetch_rows, prefetch_bytes = dejavu_tuning.mlp_prefetch_bytes;
    const int shared = idx_row_stride == 0;
    const int64_t esize = element_bytes(w_type);
    const int64_t passes = shared ? 1 : nb;      /* one pass over idx per row (or one for all) */
    const int64_t rows_per_pass = shared ? nb : 1;
    for (int64_t p = 0; p < passes; p++) {
        const int64_t *ids = idx + p * idx_row_stride;
        const float *xp = x + p * d;
        float *outp = out + p * d_out;
#pragma omp parallel num_threads(n_threads)
        {
            const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
            const int64_t lo = k * t / n_t, hi = k * (t + 1) / n_t;
            float *acc = scratch + (int64_t)t * rows_per_pass * d_out;
            memset(acc, 0, sizeof(float) * rows_per_pass * d_out);
            for (int64_t j = lo; j < hi; j++) {
                if (prefetch_bytes > 0 && j + prefetch_rows < hi) {
                    const int64_t q = ids[j + prefetch_rows];
                    prefetch(row_at(w_a, w_type, q, a_stride), d * esize, prefetch_bytes);
                    if (w_b) prefetch(row_at(w_b, w_type, q, b_stride), d * esize, prefetch_bytes);
                    prefetch(row_at(w_down_t, w_type, q, down_stride), d_out * esize, prefetch_bytes);
                }
                if (w_type != DEJAVU_W_F32 && j + 4 <= hi) {
                    /* half-precision rows: four neurons' down rows in one pass over each accumulator
                       (a quarter of its loads and stores, which cost as much as widening the rows) */
                    const uint16_t *down[4];
                    for (int u = 0; u < 4; u++)
                        down[u] = (const uint16_t *)row_at(w_down_t, w_type, ids[j + u], down_stride);
                    for (int64_t b = 0; b < rows_per_pass; b++) {
                        const float *xb = xp + b * d;
                        float h4[4];
                        for (int u = 0; u < 4; u++) {
                            const int64_t r = ids[j + u];
                            float h = activate(dot_typed(row_at(w_a, w_type, r, a_stride), w_type, xb, d) +
                                                   (b_a ? b_a[r] : 0.0f), activation);
                            if (w_b) h *= dot_typed(row_at(w_b, w_type, r, b_stride), w_type, xb, d) + (b_b ? b_b[r] : 0.0f);
                            h4[u] = h;
                        }
                        if (w_type == DEJAVU_W_BF16)
                            axpy4_bf16(acc + b * d_out, h4, down[0], down[1], down[2], down[3], d_out);
                        else
                            axpy4_f16(acc + b * d_out, h4, down[0], down[1], down[2], down[3], d_out);
                    }
                    for (int u = 1; u < 4 && prefetch_bytes > 0; u++) {  /* the rows the skipped steps prefetch */
                        if (j + u + prefetch_rows >= hi) break;
                        const int64_t q = ids[j + u + prefetch_rows];
                        prefetch(row_at(w_a, w_type, q, a_stride), d * esize, prefetch_bytes);
                        if (w_b) prefetch(row_at(w_b, w_type, q, b_stride), d * esize, prefetch_bytes);
                        prefetch(row_at(w_down_t, w_type, q, down_stride), d_out * esize, prefetch_bytes);
                    }
                    j += 3;
                    continue;
                }
                const int64_t r = ids[j];
                const void *row_a = row_at(w_a, w_type, r, a_stride), *row_down = row_at(w_down_t, w_type, r, down_stride);
                const void *row_b = w_b ? row_at(w_b, w_type, r, b_stride) : NULL;
                for (int64_t b = 0; b < rows_per_pass; b++) {
                    const float *xb = xp + b * d;
                    float *acc_b = acc + b * d_out;
                    if (w_type == DEJAVU_W_F32) {
                        float h = activate(dot((const float *)row_a, xb, d) + (b_a ? b_a[r] : 0.0f), activation);
                        if (row_b) h *= dot((const float *)row_b, xb, d) + (b_b ? b_b[r] : 0.0f);
                        axpy_f32(acc_b, h, (const float *)row_down, d_out);
                    } else {
                        float h = activate(dot_typed(row_a, w_type, xb, d) + (b_a ? b_a[r] : 0.0f), activation);
                        if (row_b) h *= dot_typed(row_b, w_type, xb, d) + (b_b ? b_b[r] : 0.0f);
                        axpy_typed(acc_b, h, row_down, w_type, d_out);
                    }
                }
            }
#pragma omp barrier
            sum_partials(scratch, rows_per_pass * d_out, b_down, d_out, outp, t, n_t);
        }
    }
}

/* One int8 row dotted with x quantized to int16, products summed in int32. With AVX-512 (AVX2) one
   multiply-add instruction takes 32 (16) int16 pairs (VNNI fuses the add). Integer multiply-adds keep
   the GEMV memory bound; converting each int8 to fp32 instead makes it compute bound. Callers go one
   row at a time: walking several rows side by side (sharing each load of x) read the weights from
   memory well below the rate of a single stream, and x is in L1 anyway. */
/* acc += the products of 32 (AVX-512) or 16 (AVX2) int8 weights at p and int16 x, summed in int32 pairs. */
#if defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
#define DEJAVU_MADD(acc, p, xp) \
    acc = _mm512_dpwssd_epi32(acc, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p))), \
                              _mm512_loadu_si512((const void *)(xp)))
#else
#define DEJAVU_MADD(acc, p, xp) \
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p))), \
                                                   _mm512_loadu_si512((const void *)(xp))))
#endif
#define DEJAVU_INT8_LANES 32
#elif defined(__AVX2__)
#define DEJAVU_MADD(acc, p, xp) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p))), \
                                                   _mm256_loadu_si256((const __m256i *)(xp))))
#define DEJAVU_INT8_LANES 16
#endif

static inline int32_t dot_i8(const int8_t *restrict w, const int16_t *restrict x, int64_t n) {
    int64_t i = 0;
    int32_t s = 0;
#if defined(__AVX512BW__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    for (; i + 64 <= n; i += 64) {
        DEJAVU_MADD(a0, w + i, x + i);
        DEJAVU_MADD(a1, w + i + 32, x + i + 32);
    }
    for (; i + 32 <= n; i += 32) DEJAVU_MADD(a0, w + i, x + i);
    s = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (; i + 32 <= n; i += 32) {
        DEJAVU_MADD(a0, w + i, x + i);
        DEJAVU_MADD(a1, w + i + 16, x + i + 16);
    }
    for (; i + 16 <= n; i += 16) DEJAVU_MADD(a0, w + i, x + i);
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(a0, a1));
    for (int l = 0; l < 8; l++) s += lanes[l];
#endif
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* x scaled to int16 so that its dot product with any int8 row of d entries fits in int32:
   |w| <= 127 < 2^7, so |x_q| < 2^(24 - ceil(log2 d)), at most 2^15 - 1. Returns 1 / scale
   (x ~= x_q / scale), NaN when x holds a NaN or an infinity. The rounding error is under 2^-12 of
   max|x| for d <= 4096, far below the int8 weights' own. */
static float quantize_x_bits(const float *x, int64_t d, int bits, int16_t *xq) {
    /* written so that gcc vectorises both loops (fmaxf, isfinite and lrintf keep them scalar) */
    float m = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < d; i++) {
        const float a = fabsf(x[i]);
        bad |= !(a <= FLT_MAX);
        m = a > m ? a : m;
    }
    if (bad) {
        memset(xq, 0, sizeof(int16_t) * d);
        return NAN;
    }
    const float scale = m > 0.0f ? (float)((1 << bits) - 1) / m : 0.0f;
    for (int64_t i = 0; i < d; i++) xq[i] = (int16_t)rintf(x[i] * scale);  /* |x scale| <= 2^bits - 1 */
    return m > 0.0f ? 1.0f / scale : 0.0f;
}

static float quantize_x(const float *x, int64_t d, int16_t *xq) {
    int bits = 24;
    while (bits > 1 && ((int64_t)1 << (24 - bits)) < d) bits--;
    if (bits > 15) bits = 15;
    return quantize_x_bits(x, d, bits, xq);
}

static void quantize_rows(const float *x, int64_t nb, int64_t d, int16_t *xq, float *inv) {
    for (int64_t b = 0; b < nb; b++) inv[b] = quantize_x(x + b * d, d, xq + b * d);
}

/* One dequantized entry: the row's scale times x's, times the integer dot product. Both functions
   below use this expression, so the int8 predictor's scores are the same numbers whichever op
   computes them. */
static inline float dequantize(float row_scale, float x_inv_scale, int32_t dot) {
    return (row_scale * x_inv_scale) * (float)dot;
}

/* out[b, r] = scale[r] * (w[r] . x_b) for r < n_rows: an int8 GEMV (w: (n_rows, d) int8, rows d
   apart; x: (nb, d) contiguous; out: (nb, n_rows)). Scratch: nb * d int16 and nb floats. Each thread
   streams one contiguous share of the rows, each row read once for all rows of x. */
void dejavu_int8_linear_f32(const float *x, int64_t nb, int64_t d, const int8_t *w, int64_t n_rows,
                            const float *scale, float *out, int16_t *xq, float *inv, int n_threads) {
    quantize_rows(x, nb, d, xq, inv);
    const int64_t ahead = dejavu_tuning.int8_prefetch_rows;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        if (ahead > 0 && r + ahead < n_rows) prefetch(w + (r + ahead) * d, d, d);
        for (int64_t b = 0; b < nb; b++) out[b * n_rows + r] = dequantize(scale[r], inv[b], dot_i8(w + r * d, xq + b * d, d));
    }
}

/* The int8 predictor's scores: for each neuron j < n_neurons,
   scores[b, j] = |act(g) * u|, g = a[j] * (w[j].x_b), u = a[F + j] * (w[F + j].x_b), F = n_neurons:
   what dejavu_int8_linear_f32 followed by the activation computes, and computed that way: the
   weights are cold on each call, and a thread reading one contiguous share of all 2F rows (gate
   then up) is what the hardware prefetcher follows best; walking gate and up rows side by side
   read them well below the streaming rate.

   w: (2F, d) int8, the gate rows then the up rows; a: (2F,) per-row scales; x: (nb, d) contiguous;
   scratch: nb * d int16, nb floats and nb * 2F floats (gu: g and u); scores: (nb, F) contiguous. A
   row of x holding a NaN or an infinity gets NaN scores. signed_values: store act(g) * u itself
   (plan entries with values "predictor" use it as the kept neurons' values); the scores are its
   magnitude. */
void dejavu_glu_int8_scores_f32(const float *x, int64_t nb, int64_t d, const int8_t *w, const float *a,
                                int64_t n_neurons, int activation, int signed_values, float *scores, int16_t *xq,
                                float *inv, float *gu, int n_threads) {
    const int64_t F = n_neurons;
    dejavu_int8_linear_f32(x, nb, d, w, 2 * F, a, gu, xq, inv, n_threads);
    const int64_t chunk = 256, chunks = (F + chunk - 1) / chunk;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t c = 0; c < nb * chunks; c++) {
        const int64_t b = c / chunks, j = c % chunks * chunk, m = F - j < chunk ? F - j : chunk;
        glu_values(scores + b * F + j, gu + b * 2 * F + j, gu + b * 2 * F + F + j, m, 1.0f, 1.0f, activation,
                   !signed_values);
    }
}

/* ---- int8 weights with per-group scales (quantize_weights' format) ------------------------------

   A row of d int8 weights holds d / group groups, each with its own fp32 scale (group a multiple
   of 32 dividing d, at most 256): w[r, i] ~= q[r, i] * scales[r, i / group]. x is quantized to
   int16 per row at 15 bits (one group's int32 sum stays below 127 * 32767 * 256 < 2^31), each
   group's integer dot product is scaled in fp32, and the groups are summed in fp32 vector lanes
   (one horizontal sum per row). The weight bytes are the int8 values plus 4 / group per weight. */
#if defined(DEJAVU_INT8_LANES) && defined(DEJAVU_VEC) && DEJAVU_VEC * 2 == DEJAVU_INT8_LANES
#if defined(__AVX512BW__)
typedef __m512i ivec_t;
#define ivzero() _mm512_setzero_si512()
#define ivto_ps(v) _mm512_cvtepi32_ps(v)
#else
typedef __m256i ivec_t;
#define ivzero() _mm256_setzero_si256()
#define ivto_ps(v) _mm256_cvtepi32_ps(v)
#endif
/* One group's integer products as fp32 lanes. */
static inline vec_t group_q8(const int8_t *restrict w, const int16_t *restrict x, int64_t group) {
    ivec_t sum = ivzero();
    for (int64_t i = 0; i < group; i += DEJAVU_INT8_LANES) DEJAVU_MADD(sum, w + i, x + i);
    return ivto_ps(sum);
}
#endif

/* sum over groups g of scales[g] * (w . x over group g): four groups per pass into four fp32 chains
   held in named registers (an accumulator array indexed by the group number is kept in memory by
   the compiler, and its store-to-load latency halved the in-cache rate). */
static inline __attribute__((always_inline)) float dot_q8_groups_of(const int8_t *restrict w, const int16_t *restrict x,
                                                                  const float *restrict scales, int64_t d, int64_t group) {
    float s = 0.0f;
#if defined(DEJAVU_INT8_LANES) && defined(DEJAVU_VEC) && DEJAVU_VEC * 2 == DEJAVU_INT8_LANES
    vec_t a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    int64_t g0 = 0, g = 0;
    for (; g0 + 4 * group <= d; g0 += 4 * group, g += 4) {
        a0 = vfma(group_q8(w + g0, x + g0, group), vset1(scales[g]), a0);
        a1 = vfma(group_q8(w + g0 + group, x + g0 + group, group), vset1(scales[g + 1]), a1);
        a2 = vfma(group_q8(w + g0 + 2 * group, x + g0 + 2 * group, group), vset1(scales[g + 2]), a2);
        a3 = vfma(group_q8(w + g0 + 3 * group, x + g0 + 3 * group, group), vset1(scales[g + 3]), a3);
    }
    for (; g0 < d; g0 += group, g++) a0 = vfma(group_q8(w + g0, x + g0, group), vset1(scales[g]), a0);
    s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#else
    for (int64_t g0 = 0, g = 0; g0 < d; g0 += group, g++) {
        int32_t sum = 0;
        for (int64_t i = g0; i < g0 + group; i++) sum += w[i] * x[i];
        s += scales[g] * (float)sum;
    }
#endif
    return s;
}

/* quantize_weights' default group of 32 as a constant: a group's multiply-adds unrolled with no inner
   loop, the same operations in the same order as any other group size. Where a multiply-add takes
   16 pairs (AVX2) that loop's control was most of the work per group, and the int8 GEMV was
   compute bound below the fp32 GEMV's byte rate (benchmarks/kernel_speed.py --dtype int8). */
static inline float dot_q8_groups(const int8_t *restrict w, const int16_t *restrict x, const float *restrict scales,
                                  int64_t d, int64_t group) {
    return group == 32 ? dot_q8_groups_of(w, x, scales, d, 32) : dot_q8_groups_of(w, x, scales, d, group);
}

/* dot_q8_groups of two rows (a neuron's gate and up) with the same x, in one pass: each load of x
   serves both rows, and each row's sum is formed exactly as dot_q8_groups forms it (the same
   chains, the same order), so both values are bit-equal to the dense int8 GEMV's. Two passes read x
   (int16, twice the bytes of a weight row) twice per neuron and kept one row stream in flight. */
static inline __attribute__((always_inline)) void dot2_q8_groups_of(
    const int8_t *restrict wa, const int8_t *restrict wb, const int16_t *restrict x, const float *restrict sa,
    const float *restrict sb, int64_t d, int64_t group, float *out_a, float *out_b) {
#if defined(DEJAVU_INT8_LANES) && defined(DEJAVU_VEC) && DEJAVU_VEC * 2 == DEJAVU_INT8_LANES
    vec_t a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    vec_t b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
    int64_t g0 = 0, g = 0;
#define DEJAVU_GROUP2(A, B, off, gi)                                                               \
    {                                                                                              \
        ivec_t ia = ivzero(), ib = ivzero();                                                       \
        for (int64_t i = 0; i < group; i += DEJAVU_INT8_LANES) {                                   \
            DEJAVU_MADD(ia, wa + (off) + i, x + (off) + i);                                        \
            DEJAVU_MADD(ib, wb + (off) + i, x + (off) + i);                                        \
        }                                                                                          \
        A = vfma(ivto_ps(ia), vset1(sa[gi]), A);                                                   \
        B = vfma(ivto_ps(ib), vset1(sb[gi]), B);                                                   \
    }
    for (; g0 + 4 * group <= d; g0 += 4 * group, g += 4) {
        DEJAVU_GROUP2(a0, b0, g0, g)
        DEJAVU_GROUP2(a1, b1, g0 + group, g + 1)
        DEJAVU_GROUP2(a2, b2, g0 + 2 * group, g + 2)
        DEJAVU_GROUP2(a3, b3, g0 + 3 * group, g + 3)
    }
    for (; g0 < d; g0 += group, g++) DEJAVU_GROUP2(a0, b0, g0, g)
#undef DEJAVU_GROUP2
    *out_a = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
    *out_b = vsum(vadd(vadd(b0, b1), vadd(b2, b3)));
#else
    *out_a = dot_q8_groups(wa, x, sa, d, group);
    *out_b = dot_q8_groups(wb, x, sb, d, group);
#endif
}

static inline void dot2_q8_groups(const int8_t *restrict wa, const int8_t *restrict wb, const int16_t *restrict x,
                                  const float *restrict sa, const float *restrict sb, int64_t d, int64_t group,
                                  float *out_a, float *out_b) {
    if (group == 32)  /* as dot_q8_groups: the default group size as a constant */
        dot2_q8_groups_of(wa, wb, x, sa, sb, d, 32, out_a, out_b);
    else
        dot2_q8_groups_of(wa, wb, x, sa, sb, d, group, out_a, out_b);
}

/* The parts functions below share one parallel region over the rows of every part (n[p] rows each,
   part p's after part p - 1's): the total, and the rows of part p (starting at row `first`) within a
   thread's share [lo, hi), as [*r_lo, *r_hi) (empty when r_lo >= r_hi). */
static inline int64_t total_rows(const int64_t *n, int parts) {
    int64_t total = 0;
    for (int p = 0; p < parts; p++) total += n[p];
    return total;
}
static inline void part_share(int64_t lo, int64_t hi, int64_t first, int64_t n, int64_t *r_lo, int64_t *r_hi) {
    *r_lo = lo > first ? lo - first : 0;
    *r_hi = hi - first < n ? hi - first : n;
}

/* Several projections of the same x in one call (a layer's q, k and v; its gate and up): part p's
   rows q[p] (n[p], d) with scales[p] follow part p - 1's in out's rows (nb, sum n), bias NULL or
   (sum n,). x is quantized once and the rows of every part are shared among the threads in one
   parallel region: separate calls pay the quantization, the fork and join and the imbalance of
   each short call once per projection. */
void dejavu_q8_linear_parts(const float *x, int64_t nb, int64_t d, int parts, const int8_t *const *w,
                            const float *const *scales, const int64_t *n, int64_t group, const float *bias,
                            float *out, int16_t *xq, float *inv, int n_threads) {
    for (int64_t b = 0; b < nb; b++) inv[b] = quantize_x_bits(x + b * d, d, 15, xq + b * d);
    const int64_t groups = d / group, ahead = dejavu_tuning.int8_prefetch_rows;
    const int64_t total = total_rows(n, parts);
#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t lo = total * t / n_t, hi = total * (t + 1) / n_t;
        int64_t first = 0;
        for (int p = 0; p < parts; first += n[p], p++) {
            const int8_t *wp = w[p];
            const float *sp = scales[p];
            int64_t r_lo, r_hi;
            part_share(lo, hi, first, n[p], &r_lo, &r_hi);
            for (int64_t r = r_lo; r < r_hi; r++) {
                if (ahead > 0 && r + ahead < r_hi) {
                    prefetch(wp + (r + ahead) * d, d, d);
                    prefetch(sp + (r + ahead) * groups, groups * 4, groups * 4);
                }
                for (int64_t b = 0; b < nb; b++)
                    out[b * total + first + r] = inv[b] * dot_q8_groups(wp + r * d, xq + b * d, sp + r * groups, d, group) +
                                                 (bias ? bias[first + r] : 0.0f);
            }
        }
    }
}

/* out[b, r] = (q[r] . x_b with q's group scales) + bias[r] for r < n: q (n, d) int8 rows, d apart;
   scales (n, d / group) fp32; x (nb, d) and out (nb, n) contiguous; bias NULL or (n,). Scratch: nb * d
   int16 and nb floats. Each thread streams one contiguous share of the rows, each row read once for
   all rows of x (prefill included: the same kernel, x's rows stay in cache). */
void dejavu_q8_linear(const float *x, int64_t nb, int64_t d, const int8_t *w, int64_t n, const float *scales,
                      int64_t group, const float *bias, float *out, int16_t *xq, float *inv, int n_threads) {
    dejavu_q8_linear_parts(x, nb, d, 1, &w, &scales, &n, group, bias, out, xq, inv, n_threads);
}

/* out[r - r0] = the fp32 values of int8 rows r0 .. r0 + n_rows - 1 (q rows d apart, scales (n, d / group)):
   the weight a prefill multiplies in blocks (cpu_q8_linear with many rows of x). */
void dejavu_q8_dequantize_rows(const int8_t *q, const float *scales, int64_t d, int64_t group, int64_t r0,
                               int64_t n_rows, float *out, int n_threads) {
    const int64_t groups = d / group;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = r0; r < r0 + n_rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float s = scales[r * groups + g];
            const int8_t *src = q + r * d + g * group;
            float *dst = out + (r - r0) * d + g * group;
            for (int64_t i = 0; i < group; i++) dst[i] = s * (float)src[i];
        }
}

/* acc[i] += sum_u v[u] * s_u[i / group] * q_u[i] for the n_rows (1-4) int8 rows q_u with per-group
   scales s_u: rows of a transposed down weight in quantize_weights' format, widened to fp32 as they
   load (8 or 16 at a time), several rows per pass over acc as in DEJAVU_AXPY4. group: a multiple of
   32, so a group is whole vectors. */
#if defined(DEJAVU_VEC)
#if defined(__AVX512F__)
#define vload_q8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#else
#define vload_q8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
#endif
static inline void axpy_q8_rows(float *restrict acc, const float *v, const int8_t *const *q, const float *const *s,
                                int n_rows, int64_t n, int64_t group) {
    for (int64_t g0 = 0, g = 0; g0 < n; g0 += group, g++) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int u = 0; u < n_rows; u++) c[u] = v[u] * s[u][g];
#if defined(DEJAVU_VEC)
        if (n_rows == 4) {
            const vec_t c0 = vset1(c[0]), c1 = vset1(c[1]), c2 = vset1(c[2]), c3 = vset1(c[3]);
            for (int64_t i = g0; i < g0 + group; i += DEJAVU_VEC) {
                vec_t a = vfma(c0, vload_q8(q[0] + i), vload(acc + i)), b = vmul(c1, vload_q8(q[1] + i));
                a = vfma(c2, vload_q8(q[2] + i), a);
                b = vfma(c3, vload_q8(q[3] + i), b);
                vstore(acc + i, vadd(a, b));
            }
            continue;
        }
        for (int u = 0; u < n_rows; u++) {
            const vec_t cu = vset1(c[u]);
            for (int64_t i = g0; i < g0 + group; i += DEJAVU_VEC) vstore(acc + i, vfma(cu, vload_q8(q[u] + i), vload(acc + i)));
        }
#else
        for (int u = 0; u < n_rows; u++)
            for (int64_t i = g0; i < g0 + group; i++) acc[i] += c[u] * (float)q[u][i];
#endif
    }
}

/* The neuron-sparse MLP over int8 weights with per-group scales (quantize_weights' format):
   out[b] = sum_j act(g_r) * u_r * deq(down_t[r]) + b_down, r = idx[b * idx_row_stride + j], j < k,
   with g_r = inv_b * dot_q8_groups(q_a[r], xq_b) + b_a[r] and u_r likewise from q_b: the expression
   dejavu_q8_linear computes, so a kept neuron's gate and up values are those of the dense int8
   projections, to the bit. q_a, q_b: (n, d) int8 rows d apart with scales (n, d / group) (q_b NULL:
   plain MLP, h = act(g_r)); q_down_t: (n, d_out) int8, the down weight transposed and quantized
   along d_out, scales (n, d_out / down_group). x (nb, d) contiguous fp32, quantized to int16 per row
   into xq / inv (nb * d int16, nb floats); scratch: n_threads * nb * d_out floats; values: nb * k
   floats (the kept neurons' act(g) * u); out (nb, d_out).
   Threads split the kept neurons and sum their accumulators at the end, as in dejavu_sparse_mlp;
   the software prefetch also fetches each row's scales (a second stream per row). */
void dejavu_q8_sparse_mlp(const float *x, int64_t nb, int64_t d, int64_t d_out,
                          const int8_t *q_a, const float *s_a, const int8_t *q_b, const float *s_b, int64_t group,
                          const int8_t *q_down_t, const float *s_down, int64_t down_group,
                          const float *b_a, const float *b_b, const float *b_down,
                          const int64_t *idx, int64_t k, int64_t idx_row_stride, int activation,
                          float *out, float *scratch, float *values, int16_t *xq, float *inv, int n_threads) {
    for (int64_t b = 0; b < nb; b++) inv[b] = quantize_x_bits(x + b * d, d, 15, xq + b * d);
    const int64_t ahead = dejavu_tuning.mlp_prefetch_rows, bytes = dejavu_tuning.mlp_prefetch_bytes;
    const int64_t groups = d / group, down_groups = d_out / down_group;
    const int shared = idx_row_stride == 0;
    const int64_t passes = shared ? 1 : nb, rows_per_pass = shared ? nb : 1;
    for (int64_t p = 0; p < passes; p++) {
        const int64_t *ids = idx + p * idx_row_stride;
#pragma omp parallel num_threads(n_threads)
        {
            const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
            const int64_t lo = k * t / n_t, hi = k * (t + 1) / n_t;
            float *acc = scratch + (int64_t)t * rows_per_pass * d_out;
            memset(acc, 0, sizeof(float) * rows_per_pass * d_out);
            /* the kept neurons' values first (their gate and up rows), then their down rows, four
               per pass over the accumulator */
            float *h = values + lo * rows_per_pass;
            for (int64_t j = lo; j < hi; j++) {
                if (bytes > 0 && j + ahead < hi) {  /* a row's scales are a second stream: fetched whole */
                    const int64_t r = ids[j + ahead];
                    prefetch(q_a + r * d, d, bytes);
                    prefetch(s_a + r * groups, groups * 4, groups * 4);
                    if (q_b) {
                        prefetch(q_b + r * d, d, bytes);
                        prefetch(s_b + r * groups, groups * 4, groups * 4);
                    }
                }
                const int64_t r = ids[j];
                for (int64_t b = 0; b < rows_per_pass; b++) {
                    const int64_t row = p * rows_per_pass + b;  /* the row of x */
                    float v;
                    if (q_b) {
                        float gate, up;
                        dot2_q8_groups(q_a + r * d, q_b + r * d, xq + row * d, s_a + r * groups, s_b + r * groups, d,
                                       group, &gate, &up);
                        v = activate(inv[row] * gate + (b_a ? b_a[r] : 0.0f), activation) *
                            (inv[row] * up + (b_b ? b_b[r] : 0.0f));
                    } else {
                        v = activate(inv[row] * dot_q8_groups(q_a + r * d, xq + row * d, s_a + r * groups, d, group) +
                                         (b_a ? b_a[r] : 0.0f), activation);
                    }
                    h[(j - lo) * rows_per_pass + b] = v;
                }
            }
            for (int64_t j = lo; j < hi; j += 4) {
                const int n_rows = hi - j < 4 ? (int)(hi - j) : 4;
                for (int u = 0; u < n_rows && bytes > 0; u++)
                    if (j + u + ahead < hi) {
                        prefetch(q_down_t + ids[j + u + ahead] * d_out, d_out, bytes);
                        prefetch(s_down + ids[j + u + ahead] * down_groups, down_groups * 4, down_groups * 4);
                    }
                const int8_t *down[4];
                const float *down_scales[4];
                for (int u = 0; u < n_rows; u++) {
                    down[u] = q_down_t + ids[j + u] * d_out;
                    down_scales[u] = s_down + ids[j + u] * down_groups;
                }
                for (int64_t b = 0; b < rows_per_pass; b++) {
                    float v[4];
                    for (int u = 0; u < n_rows; u++) v[u] = h[(j - lo + u) * rows_per_pass + b];
                    axpy_q8_rows(acc + b * d_out, v, down, down_scales, n_rows, d_out, down_group);
                }
            }
#pragma omp barrier
            sum_partials(scratch, rows_per_pass * d_out, b_down, d_out, out + p * d_out, t, n_t);
        }
    }
}

/* ---- The int8 MLP chosen and valued by its own gate and up ---------------------------------------

   A gated MLP of quantize_weights' int8 projections under a sparse plan: its own gate and up are the
   predictor. Every neuron's h = act(g) * u is computed (g and u bit-equal to the dense int8
   projections'), the k largest |h| of each row are kept (cpu_ops.cpp), and only their rows of the
   down weight are read. The down weight is read as its own int8 values transposed, (n, d_out), with
   its scales transposed, (n / group, d_out): the `group` consecutive neurons that share one scale in
   the dense projection's rows share one row of scales here, so a kept neuron adds exactly what it
   adds in the dense int8 projection (no second rounding). */

/* values[b * n + r] = act(g_r) * u_r for every neuron r < n: q_a (gate), q_b (up) (n, d) int8 rows
   with scales (n, d / group); x (nb, d) quantized into xq / inv (nb * d int16, nb floats) as
   dejavu_q8_linear quantizes it, g and u summed as it sums them (bit-equal). Each thread streams its
   share of the gate rows, then the same share of the up rows; up: nb * n floats of scratch. */
void dejavu_q8_glu_values(const float *x, int64_t nb, int64_t d, const int8_t *q_a, const float *s_a,
                          const int8_t *q_b, const float *s_b, int64_t group, int64_t n, int activation,
                          float *values, float *up, int16_t *xq, float *inv, int n_threads) {
    for (int64_t b = 0; b < nb; b++) inv[b] = quantize_x_bits(x + b * d, d, 15, xq + b * d);
    const int64_t groups = d / group, ahead = dejavu_tuning.int8_prefetch_rows;
    const int64_t chunk = 256, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel num_threads(n_threads)
    {
        for (int half = 0; half < 2; half++) {
            const int8_t *q = half ? q_b : q_a;
            const float *s = half ? s_b : s_a;
            float *sums = half ? up : values;
#pragma omp for schedule(static) nowait
            for (int64_t r = 0; r < n; r++) {
                if (ahead > 0 && r + ahead < n) {
                    prefetch(q + (r + ahead) * d, d, d);
                    prefetch(s + (r + ahead) * groups, groups * 4, groups * 4);
                }
                for (int64_t b = 0; b < nb; b++) sums[b * n + r] = dot_q8_groups(q + r * d, xq + b * d, s + r * groups, d, group);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nb * chunks; c++) {
            const int64_t b = c / chunks, j = c % chunks * chunk, m = n - j < chunk ? n - j : chunk;
            glu_values(values + b * n + j, values + b * n + j, up + b * n + j, m, inv[b], inv[b], activation, 0);
        }
    }
}

static inline int64_t first_at_least(const int64_t *ids, int64_t k, int64_t value) {
    int64_t lo = 0, hi = k;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ids[mid] < value) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* out[b] = sum_j h[b * h_stride + r] * deq(down)[:, r] + bias, r = idx[b * k + j] for j < k (ascending
   in each row): q_t (n, d_out) the down weight's int8 values transposed, s_t (n / group, d_out) its
   scales transposed; d_out a multiple of 32; bias NULL or (d_out,). Threads split the groups of
   neurons; within a group the kept rows are summed unscaled, four per pass, then scaled once by the
   group's row of scales. scratch: 2 * n_threads * d_out floats; out (nb, d_out). */
void dejavu_q8_down_rows(const float *h, int64_t h_stride, const int64_t *idx, int64_t nb, int64_t k,
                         const int8_t *q_t, const float *s_t, int64_t n, int64_t d_out, int64_t group,
                         const float *bias, float *out, float *scratch, int n_threads) {
    const int64_t ahead = dejavu_tuning.mlp_prefetch_rows, groups = n / group;
    static const float one = 1.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t *ids = idx + b * k;
        const float *hb = h + b * h_stride;
#pragma omp parallel num_threads(n_threads)
        {
            const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
            const int64_t lo = first_at_least(ids, k, groups * t / n_t * group);
            const int64_t hi = first_at_least(ids, k, groups * (t + 1) / n_t * group);
            float *acc = scratch + (int64_t)t * d_out, *part = scratch + (int64_t)(n_t + t) * d_out;
            memset(acc, 0, sizeof(float) * d_out);
            for (int64_t j = lo; j < hi;) {
                const int64_t g = ids[j] / group;
                int64_t end = j;
                while (end < hi && ids[end] / group == g) end++;
                memset(part, 0, sizeof(float) * d_out);
                while (j < end) {
                    const int n_rows = end - j < 4 ? (int)(end - j) : 4;
                    const int8_t *rows[4];
                    const float *ones[4] = {&one, &one, &one, &one};
                    float v[4];
                    for (int u = 0; u < n_rows; u++) {
                        rows[u] = q_t + ids[j + u] * d_out;
                        v[u] = hb[ids[j + u]];
                        if (ahead > 0 && j + u + ahead < hi) prefetch(q_t + ids[j + u + ahead] * d_out, d_out, d_out);
                    }
                    axpy_q8_rows(part, v, rows, ones, n_rows, d_out, d_out);
                    j += n_rows;
                }
                const float *scale = s_t + g * d_out;
                for (int64_t i = 0; i < d_out; i++) acc[i] += part[i] * scale[i];
            }
#pragma omp barrier
            sum_partials(scratch, d_out, bias, d_out, out + b * d_out, t, n_t);
        }
    }
}

/* out[b] = sum_j h[b * h_stride + r] * table[r] + bias, r = idx[b * k + j] for j < k: the down
   projection of neurons whose values are already known (plan entries with values "predictor": the
   int8 predictor's act(g~) * u~), each selected row of the transposed down weight read once, in
   place. table: rows of d_out table_type elements (fp32; bf16: a plan's bf16 copy of the down rows,
   half the bytes, or a bf16 model's own; fp16), table_stride elements apart; bias NULL or (d_out,)
   fp32; scratch: n_threads * d_out floats; out: (nb, d_out) contiguous. Threads split the rows, as
   in dejavu_sparse_mlp. */
void dejavu_weighted_rows(const float *h, int64_t h_stride, const int64_t *idx, int64_t nb, int64_t k,
                          const void *table, int table_type, int64_t table_stride, int64_t d_out, const float *bias,
                          float *out, float *scratch, int n_threads) {
    const int64_t ahead = dejavu_tuning.mlp_prefetch_rows, bytes = dejavu_tuning.mlp_prefetch_bytes;
    const int64_t row_bytes = d_out * element_bytes(table_type);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t *ids = idx + b * k;
        const float *hb = h + b * h_stride;
#pragma omp parallel num_threads(n_threads)
        {
            const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
            const int64_t lo = k * t / n_t, hi = k * (t + 1) / n_t;
            float *acc = scratch + (int64_t)t * d_out;
            memset(acc, 0, sizeof(float) * d_out);
            for (int64_t j = lo; j < hi; j++) {
                if (j + ahead < hi) prefetch(row_at(table, table_type, ids[j + ahead], table_stride), row_bytes, bytes);
                const int64_t r = ids[j];
                axpy_typed(acc, hb[r], row_at(table, table_type, r, table_stride), table_type, d_out);
            }
#pragma omp barrier
            sum_partials(scratch, d_out, bias, d_out, out + b * d_out, t, n_t);
        }
    }
}

/* ---- Dense GEMV (decode's dense projections and output head) ----------------------------------

   At batch 1 a projection is a GEMV and reading its weight is all the work: the kernels below read
   each weight row once, from contiguous memory, with each thread streaming its own contiguous share
   of the rows (what the hardware prefetcher follows best), and the arithmetic hides under the
   loads. Exact: every product is summed, only the order differs from torch's GEMM. */


/* dejavu_linear over several weights of the same x in one parallel region, as dejavu_q8_linear_parts:
   part p's rows w[p] (n[p], d), w_stride[p] elements apart, follow part p - 1's in out (nb, sum n). */
void dejavu_linear_parts(const float *x, int64_t nb, int64_t d, int w_type, int parts, const void *const *w,
                         const int64_t *w_stride, const int64_t *n, const float *bias, float *out, int n_threads,
                         int64_t prefetch_rows) {
    const int64_t row_bytes = d * element_bytes(w_type);
    const int64_t total = total_rows(n, parts);
#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t lo = total * t / n_t, hi = total * (t + 1) / n_t;
        int64_t first = 0;
        for (int p = 0; p < parts; first += n[p], p++) {
            int64_t r_lo, r_hi;
            part_share(lo, hi, first, n[p], &r_lo, &r_hi);
            for (int64_t r = r_lo; r < r_hi; r++) {
                if (prefetch_rows > 0 && r + prefetch_rows < r_hi)
                    prefetch(row_at(w[p], w_type, r + prefetch_rows, w_stride[p]), row_bytes, row_bytes);
                const void *row = row_at(w[p], w_type, r, w_stride[p]);
                for (int64_t b = 0; b < nb; b++)
                    out[b * total + first + r] = dot_typed(row, w_type, x + b * d, d) + (bias ? bias[first + r] : 0.0f);
            }
        }
    }
}

/* out[b, r] = w[r] . x[b] + bias[r] for r < n: w (n, d) rows w_stride floats apart (nn.Linear's
   layout), x (nb, d) and out (nb, n) contiguous, bias NULL or (n,). Thread t takes the rows
   [n t / T, n (t+1) / T); each row is read once for all rows of x (it stays in L1 between them).
   prefetch_rows > 0: also prefetch the row that many ahead (tuned per machine, see native.py). */
void dejavu_linear(const float *x, int64_t nb, int64_t d, int w_type, const void *w, int64_t w_stride, int64_t n,
                   const float *bias, float *out, int n_threads, int64_t prefetch_rows) {
    dejavu_linear_parts(x, nb, d, w_type, 1, &w, &w_stride, &n, bias, out, n_threads, prefetch_rows);
}

void dejavu_linear_f32(const float *x, int64_t nb, int64_t d, const float *w, int64_t w_stride, int64_t n,
                       const float *bias, float *out, int n_threads, int64_t prefetch_rows) {
    dejavu_linear(x, nb, d, DEJAVU_W_F32, w, w_stride, n, bias, out, n_threads, prefetch_rows);
}

/* out[b] = sum_i x[b, i] * w_t[i] + bias: the same product for a weight stored transposed, w_t (d, n)
   rows t_stride elements apart (the layout prepare_model gives down and output projections, which the
   sparse kernels read by rows). Thread t sums rows [d t / T, d (t+1) / T) into its accumulator
   (scratch: n_threads * nb * n floats); the accumulators are added at the end. */
void dejavu_linear_t(const float *x, int64_t nb, int64_t d, int w_type, const void *w_t, int64_t t_stride, int64_t n,
                     const float *bias, float *out, float *scratch, int n_threads) {
#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t lo = d * t / n_t, hi = d * (t + 1) / n_t;
        float *acc = scratch + (int64_t)t * nb * n;
        memset(acc, 0, sizeof(float) * nb * n);
        int64_t i = lo;
        if (w_type != DEJAVU_W_F32)  /* half-precision rows four at a time (see DEJAVU_AXPY4) */
            for (; i + 4 <= hi; i += 4) {
                const uint16_t *r0 = (const uint16_t *)row_at(w_t, w_type, i, t_stride);
                const uint16_t *r1 = (const uint16_t *)row_at(w_t, w_type, i + 1, t_stride);
                const uint16_t *r2 = (const uint16_t *)row_at(w_t, w_type, i + 2, t_stride);
                const uint16_t *r3 = (const uint16_t *)row_at(w_t, w_type, i + 3, t_stride);
                for (int64_t b = 0; b < nb; b++) {
                    const float v[4] = {x[b * d + i], x[b * d + i + 1], x[b * d + i + 2], x[b * d + i + 3]};
                    if (w_type == DEJAVU_W_BF16) axpy4_bf16(acc + b * n, v, r0, r1, r2, r3, n);
                    else axpy4_f16(acc + b * n, v, r0, r1, r2, r3, n);
                }
            }
        for (; i < hi; i++) {
            const void *row = row_at(w_t, w_type, i, t_stride);
            for (int64_t b = 0; b < nb; b++) axpy_typed(acc + b * n, x[b * d + i], row, w_type, n);
        }
#pragma omp barrier
        sum_partials(scratch, nb * n, bias, n, out, t, n_t);
    }
}

/* Attention of a few query rows over a key/value cache (decode steps: one row per sequence):
   out[r] = sum_s p_s v[g, s], p = softmax(scale * q[r] . k[g, s] + bias[r, s]), for each row
   r = (b, h, l) of q, g = h / (heads / kv_heads) its key/value head (grouped-query attention reads
   the shared heads in place, with no repeated copy). q (nb, heads, L, d) fp32 contiguous; k and v of
   `kv_type` elements, (nb, kv_heads, S, d) with element strides (sb, sh, ss) and unit stride along d;
   mask NULL, or boolean (keep: uint8, mask_is_bool) or an fp32 additive bias, with element strides
   (sb, sh, sl, ss), 0 where it broadcasts; a slot masked out (false, or a bias of -inf) has its key
   and value unread. A row with every slot masked gets zeros, one with a NaN score NaNs (as SDPA). scores: n_threads * S
   floats. Rows are split over threads only when there is enough work to pay for the fork. */
void dejavu_decode_attention(const float *q, int64_t nb, int64_t heads, int64_t L, int64_t d, int64_t kv_heads,
                             int64_t S, int kv_type, const void *k, const int64_t *k_strides, const void *v,
                             const int64_t *v_strides, const void *mask, int mask_is_bool, const int64_t *m_strides,
                             float scale,
                             float *out, float *scores, int n_threads) {
    const int64_t group = heads / kv_heads, rows = nb * heads * L, eb = element_bytes(kv_type);
    const int parallel = n_threads > 1 && rows > 1 && rows * S * d >= 65536;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / (heads * L), h = (r / L) % heads, l = r % L, g = h / group;
        float *sc = scores + (int64_t)omp_get_thread_num() * S, *o = out + r * d;
        const float *qr = q + r * d;
        const char *kb = (const char *)k + (b * k_strides[0] + g * k_strides[1]) * eb;
        const char *vb = (const char *)v + (b * v_strides[0] + g * v_strides[1]) * eb;
        const int64_t m_off = b * m_strides[0] + h * m_strides[1] + l * m_strides[2];
        const uint8_t *keep = mask && mask_is_bool ? (const uint8_t *)mask + m_off : NULL;
        const float *add_row = mask && !mask_is_bool ? (const float *)mask + m_off : NULL;
        /* the slots after the last one the mask keeps are not visited: a static cache allocated for
           long sequences is mostly masked slots at its end, and scoring each took longer than the kept
           ones together */
        int64_t S_row = S;
        if (keep)
            while (S_row > 0 && !keep[(S_row - 1) * m_strides[3]]) S_row--;
        else if (add_row)
            while (S_row > 0 && add_row[(S_row - 1) * m_strides[3]] == -INFINITY) S_row--;
        float top = -INFINITY;
        int nan = 0;
        for (int64_t s = 0; s < S_row; s++) {
            const float add = keep ? (keep[s * m_strides[3]] ? 0.0f : -INFINITY) : add_row ? add_row[s * m_strides[3]] : 0.0f;
            sc[s] = add == -INFINITY ? -INFINITY : scale * dot_typed(kb + s * k_strides[2] * eb, kv_type, qr, d) + add;
            top = sc[s] > top ? sc[s] : top;
            nan |= isnan(sc[s]);
        }
        memset(o, 0, sizeof(float) * d);
        if (nan) {  /* a NaN in q, a key or the mask: the row is NaN, as in SDPA */
            for (int64_t i = 0; i < d; i++) o[i] = NAN;
            continue;
        }
        if (top == -INFINITY) continue;
        float total = 0.0f;
        for (int64_t s = 0; s < S_row; s++) {
            const float p = sc[s] == -INFINITY ? 0.0f : expf(sc[s] - top);
            total += p;
            if (p != 0.0f) axpy_typed(o, p, vb + s * v_strides[2] * eb, kv_type, d);
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
}
