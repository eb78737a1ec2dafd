/* Neuron-sparse MLP for CPU, fp32: one pass over the selected neurons.

   For each selected neuron r the loop reads its gate row, its up row and its down row (a row of
   the transposed down weight), all contiguous, computes act(gate.x) * (up.x) and adds that times
   the down row into a per-thread accumulator. Nothing is copied; the three reads of one neuron are
   issued back to back, so the core keeps several row misses in flight, and a software prefetch
   touches the start of the rows a few neurons ahead (the hardware prefetcher takes over inside a
   row). Threads split the neurons; their accumulators are summed at the end.

   Built once per machine by native.py (cc -O3 -march=native -fopenmp, plus the activation table's
   defines) and called through ctypes; cpu_ops.cpp includes this file for the C++ ops.
   It links against the OpenMP runtime torch has already loaded, so both share one thread pool. */
#include <immintrin.h>
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

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void prefetch(const float *row, int64_t row_bytes, int64_t max_bytes) {
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
   linear_prefetch_rows ahead (0: none, the hardware prefetcher alone). native.py measures them once
   per build and machine (machine_tuning) and sets them here; these defaults hold until then. The sparse
   MLP's callers pass -1 to use them; benchmarks/kernels.py --prefetch-sweep passes others. */
typedef struct {
    int64_t mlp_prefetch_rows, mlp_prefetch_bytes, linear_prefetch_rows;
} dejavu_tuning_t;
dejavu_tuning_t dejavu_tuning = {4, 256, 0};

void dejavu_set_tuning(int64_t mlp_prefetch_rows, int64_t mlp_prefetch_bytes, int64_t linear_prefetch_rows) {
    dejavu_tuning.mlp_prefetch_rows = mlp_prefetch_rows;
    dejavu_tuning.mlp_prefetch_bytes = mlp_prefetch_bytes;
    dejavu_tuning.linear_prefetch_rows = linear_prefetch_rows;
}

/* out[b] = sum_j act(w_a[r].x_b + b_a[r]) * (w_b[r].x_b + b_b[r]) * w_down_t[r] + b_down,
   r = idx[b * idx_row_stride + j] for j < k.

   x: (nb, d) contiguous. w_a, w_b: rows of d floats, `*_stride` floats apart (w_b NULL: plain MLP,
   h = act(w_a[r].x + b_a[r])). w_down_t: rows of d_out floats, down_stride apart. Biases NULL or
   contiguous. idx_row_stride 0: one idx list shared by every row of x, and each weight row is read
   once for all rows. scratch: n_threads * nb * d_out floats. out: (nb, d_out) contiguous.
   prefetch_rows < 0: the machine's setting (dejavu_tuning). */
void dejavu_sparse_mlp_f32(const float *x, int64_t nb, int64_t d, int64_t d_out,
                           const float *w_a, int64_t a_stride, const float *w_b, int64_t b_stride,
                           const float *w_down_t, int64_t down_stride,
                           const float *b_a, const float *b_b, const float *b_down,
                           const int64_t *idx, int64_t k, int64_t idx_row_stride, int activation,
                           float *out, float *scratch, int n_threads,
                           int64_t prefetch_rows, int64_t prefetch_bytes) {
    if (prefetch_rows < 0) prefetch_rows = dejavu_tuning.mlp_prefetch_rows, prefetch_bytes = dejavu_tuning.mlp_prefetch_bytes;
    const int shared = idx_row_stride == 0;
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
                    prefetch(w_a + q * a_stride, d * 4, prefetch_bytes);
                    if (w_b) prefetch(w_b + q * b_stride, d * 4, prefetch_bytes);
                    prefetch(w_down_t + q * down_stride, d_out * 4, prefetch_bytes);
                }
                const int64_t r = ids[j];
                const float *row_a = w_a + r * a_stride, *row_down = w_down_t + r * down_stride;
                for (int64_t b = 0; b < rows_per_pass; b++) {
                    const float *xb = xp + b * d;
                    float h = activate(dot(row_a, xb, d) + (b_a ? b_a[r] : 0.0f), activation);
                    if (w_b) h *= dot(w_b + r * b_stride, xb, d) + (b_b ? b_b[r] : 0.0f);
                    float *acc_b = acc + b * d_out;
#pragma omp simd
                    for (int64_t i = 0; i < d_out; i++) acc_b[i] += h * row_down[i];
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
static inline int32_t dot_i8(const int8_t *restrict w, const int16_t *restrict x, int64_t n) {
    int64_t i = 0;
    int32_t s = 0;
#if defined(__AVX512BW__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
#if defined(__AVX512VNNI__)
#define DEJAVU_MADD(acc, p, xv) acc = _mm512_dpwssd_epi32(acc, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p))), xv)
#else
#define DEJAVU_MADD(acc, p, xv) acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p))), xv))
#endif
    for (; i + 64 <= n; i += 64) {
        DEJAVU_MADD(a0, w + i, _mm512_loadu_si512((const void *)(x + i)));
        DEJAVU_MADD(a1, w + i + 32, _mm512_loadu_si512((const void *)(x + i + 32)));
    }
    for (; i + 32 <= n; i += 32) DEJAVU_MADD(a0, w + i, _mm512_loadu_si512((const void *)(x + i)));
#undef DEJAVU_MADD
    s = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
#define DEJAVU_MADD(acc, p, xp) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p))), \
                                                   _mm256_loadu_si256((const __m256i *)(xp))))
    for (; i + 32 <= n; i += 32) {
        DEJAVU_MADD(a0, w + i, x + i);
        DEJAVU_MADD(a1, w + i + 16, x + i + 16);
    }
    for (; i + 16 <= n; i += 16) DEJAVU_MADD(a0, w + i, x + i);
#undef DEJAVU_MADD
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
static float quantize_x(const float *x, int64_t d, int16_t *xq) {
    int bits = 24;
    while (bits > 1 && ((int64_t)1 << (24 - bits)) < d) bits--;
    if (bits > 15) bits = 15;
    float m = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < d; i++) {
        finite &= isfinite(x[i]) != 0;
        m = fmaxf(m, fabsf(x[i]));
    }
    const float scale = finite && m > 0.0f ? (float)((1 << bits) - 1) / m : 0.0f;
    for (int64_t i = 0; i < d; i++) xq[i] = (int16_t)lrintf(finite ? x[i] * scale : 0.0f);
    return !finite ? NAN : (m > 0.0f ? 1.0f / scale : 0.0f);
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
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t b = 0; b < nb; b++) out[b * n_rows + r] = dequantize(scale[r], inv[b], dot_i8(w + r * d, xq + b * d, d));
}

/* The int8 predictor's scores (plan entries "glu_int8"): for each neuron j < n_neurons,
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
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t j = 0; j < F; j++) {
        for (int64_t b = 0; b < nb; b++) {
            const float v = activate(gu[b * 2 * F + j], activation) * gu[b * 2 * F + F + j];
            scores[b * F + j] = signed_values ? v : fabsf(v);
        }
    }
}

/* acc[i] += v * row[i] for a row of bf16 values (the upper half of an fp32: widening is a shift). */
static inline void axpy_bf16(float *restrict acc, float v, const uint16_t *restrict row, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vv = _mm512_set1_ps(v);
    for (; i + 16 <= n; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + i)));
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vv, w, _mm512_loadu_ps(acc + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vv, w, _mm256_loadu_ps(acc + i)));
    }
#endif
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)row[i] << 16;
        float w;
        memcpy(&w, &bits, sizeof w);
        acc[i] += v * w;
    }
}

/* out[b] = sum_j h[b * h_stride + r] * table[r] + bias, r = idx[b * k + j] for j < k: the down
   projection of neurons whose values are already known (plan entries with values "predictor": the
   int8 predictor's act(g~) * u~), each selected row of the transposed down weight read once, in
   place. table: rows of d_out fp32 values (table_bf16 0) or bf16 values (1: a plan's bf16 copy of
   the down rows, half the bytes), table_stride elements apart; bias NULL or (d_out,) fp32; scratch:
   n_threads * d_out floats; out: (nb, d_out) contiguous. Threads split the rows, as in
   dejavu_sparse_mlp_f32. */
void dejavu_weighted_rows(const float *h, int64_t h_stride, const int64_t *idx, int64_t nb, int64_t k,
                          const void *table, int table_bf16, int64_t table_stride, int64_t d_out, const float *bias,
                          float *out, float *scratch, int n_threads) {
    const int64_t ahead = dejavu_tuning.mlp_prefetch_rows, bytes = dejavu_tuning.mlp_prefetch_bytes;
    const int64_t element = table_bf16 ? 2 : 4, row_bytes = d_out * element;
    const char *rows = (const char *)table;
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
                if (j + ahead < hi) prefetch((const float *)(rows + ids[j + ahead] * table_stride * element), row_bytes, bytes);
                const int64_t r = ids[j];
                const float v = hb[r];
                if (table_bf16) {
                    axpy_bf16(acc, v, (const uint16_t *)(rows + r * table_stride * element), d_out);
                } else {
                    const float *row = (const float *)(rows + r * table_stride * element);
#pragma omp simd
                    for (int64_t i = 0; i < d_out; i++) acc[i] += v * row[i];
                }
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

#if defined(__AVX512F__)
#define DEJAVU_VEC 16
typedef __m512 vec_t;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vset1(s) _mm512_set1_ps(s)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
static inline float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define DEJAVU_VEC 8
typedef __m256 vec_t;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vset1(s) _mm256_set1_ps(s)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
static inline float vsum(vec_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* One row dotted with x. Four accumulators keep enough multiply-adds in flight. One row at a time
   keeps each thread's reads a single forward stream, which the hardware prefetcher follows at full
   bandwidth; reading four rows side by side gives each thread four streams, which it follows worse. */
static inline float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef DEJAVU_VEC
    vec_t a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * DEJAVU_VEC <= n; i += 4 * DEJAVU_VEC) {
        a0 = vfma(vload(w + i), vload(x + i), a0);
        a1 = vfma(vload(w + i + DEJAVU_VEC), vload(x + i + DEJAVU_VEC), a1);
        a2 = vfma(vload(w + i + 2 * DEJAVU_VEC), vload(x + i + 2 * DEJAVU_VEC), a2);
        a3 = vfma(vload(w + i + 3 * DEJAVU_VEC), vload(x + i + 3 * DEJAVU_VEC), a3);
    }
    for (; i + DEJAVU_VEC <= n; i += DEJAVU_VEC) a0 = vfma(vload(w + i), vload(x + i), a0);
    s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#endif
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* out[b, r] = w[r] . x[b] + bias[r] for r < n: w (n, d) rows w_stride floats apart (nn.Linear's
   layout), x (nb, d) and out (nb, n) contiguous, bias NULL or (n,). Thread t takes the rows
   [n t / T, n (t+1) / T); each row is read once for all rows of x (it stays in L1 between them).
   prefetch_rows > 0: also prefetch the row that many ahead (tuned per machine, see native.py). */
void dejavu_linear_f32(const float *x, int64_t nb, int64_t d, const float *w, int64_t w_stride, int64_t n,
                       const float *bias, float *out, int n_threads, int64_t prefetch_rows) {
#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t lo = n * t / n_t, hi = n * (t + 1) / n_t;
        for (int64_t r = lo; r < hi; r++) {
            if (prefetch_rows > 0 && r + prefetch_rows < hi) prefetch(w + (r + prefetch_rows) * w_stride, d * 4, d * 4);
            for (int64_t b = 0; b < nb; b++) out[b * n + r] = dot_f32(w + r * w_stride, x + b * d, d) + (bias ? bias[r] : 0.0f);
        }
    }
}

/* out[b] = sum_i x[b, i] * w_t[i] + bias: the same product for a weight stored transposed, w_t (d, n)
   rows t_stride floats apart (the layout prepare_model gives down and output projections, which the
   sparse kernels read by rows). Thread t sums rows [d t / T, d (t+1) / T) into its accumulator
   (scratch: n_threads * nb * n floats); the accumulators are added at the end. */
void dejavu_linear_t_f32(const float *x, int64_t nb, int64_t d, const float *w_t, int64_t t_stride, int64_t n,
                         const float *bias, float *out, float *scratch, int n_threads) {
#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t lo = d * t / n_t, hi = d * (t + 1) / n_t;
        float *acc = scratch + (int64_t)t * nb * n;
        memset(acc, 0, sizeof(float) * nb * n);
        for (int64_t i = lo; i < hi; i++) {
            const float *row = w_t + i * t_stride;
            for (int64_t b = 0; b < nb; b++) {
                const float v = x[b * d + i];
                float *acc_b = acc + b * n;
#pragma omp simd
                for (int64_t c = 0; c < n; c++) acc_b[c] += v * row[c];
            }
        }
#pragma omp barrier
        sum_partials(scratch, nb * n, bias, n, out, t, n_t);
    }
}
