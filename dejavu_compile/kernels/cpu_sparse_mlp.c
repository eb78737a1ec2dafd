/* Neuron-sparse MLP for CPU, fp32: one pass over the selected neurons.

   For each selected neuron r the loop reads its gate row, its up row and its down row (a row of
   the transposed down weight), all contiguous, computes act(gate.x) * (up.x) and adds that times
   the down row into a per-thread accumulator. Nothing is copied; the three reads of one neuron are
   issued back to back, so the core keeps several row misses in flight, and a software prefetch
   touches the start of the rows a few neurons ahead (the hardware prefetcher takes over inside a
   row). Threads split the neurons; their accumulators are summed at the end.

   Built once per machine by native.py (cc -O3 -march=native -fopenmp) and called through ctypes.
   It links against the OpenMP runtime torch has already loaded, so both share one thread pool. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3 };

static inline float activate(float v, int kind) {
    switch (kind) {
    case ACT_SILU: return v / (1.0f + expf(-v));
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case ACT_GELU_TANH: {
        float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
        return 0.5f * v * (1.0f + tanhf(inner));
    }
    default: return v > 0.0f ? v : 0.0f;
    }
}

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

/* out[b] = sum_j act(w_a[r].x_b + b_a[r]) * (w_b[r].x_b + b_b[r]) * w_down_t[r] + b_down,
   r = idx[b * idx_row_stride + j] for j < k.

   x: (nb, d) contiguous. w_a, w_b: rows of d floats, `*_stride` floats apart (w_b NULL: plain MLP,
   h = act(w_a[r].x + b_a[r])). w_down_t: rows of d_out floats, down_stride apart. Biases NULL or
   contiguous. idx_row_stride 0: one idx list shared by every row of x, and each weight row is read
   once for all rows. scratch: n_threads * nb * d_out floats. out: (nb, d_out) contiguous. */
void dejavu_sparse_mlp_f32(const float *x, int64_t nb, int64_t d, int64_t d_out,
                           const float *w_a, int64_t a_stride, const float *w_b, int64_t b_stride,
                           const float *w_down_t, int64_t down_stride,
                           const float *b_a, const float *b_b, const float *b_down,
                           const int64_t *idx, int64_t k, int64_t idx_row_stride, int activation,
                           float *out, float *scratch, int n_threads,
                           int64_t prefetch_rows, int64_t prefetch_bytes) {
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
            /* Sum the per-thread accumulators, each thread a slice of the output columns. */
            const int64_t width = rows_per_pass * d_out;
            const int64_t c_lo = width * t / n_t, c_hi = width * (t + 1) / n_t;
            for (int64_t c = c_lo; c < c_hi; c++) {
                float s = b_down ? b_down[c % d_out] : 0.0f;
                for (int u = 0; u < n_t; u++) s += scratch[(int64_t)u * width + c];
                outp[c] = s;
            }
        }
    }
}
