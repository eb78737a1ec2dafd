// The backend's CPU decode ops, registered with the dispatcher from C++ (namespace dejavu):
//
//   cpu_sparse_mlp(x, w_a, w_b?, w_down_t, idx, activation, b_a?, b_b?, b_down?) -> (B, d_out)
//       the C kernel of cpu_sparse_mlp.c (w_b None: plain MLP act(w_a x));
//   cpu_glu_int8_topk(x, w_int8, scale, k, activation) -> (B, k) int64, ascending
//       the int8 predictor's scores |act(g~) * u~| and their top k, in one call;
//   cpu_glu_int8_mlp(x, w_int8, scale, w_down_t, k, activation, b_down?) -> ((B, d_out), (B, k) ids)
//       the whole block for plan entries with values "predictor": the int8 predictor's act(g~) * u~
//       for every neuron, the top k by magnitude, and the down projection of those k values (only
//       the selected rows of w_down_t are read, in the model's dtype or a plan's bf16 copy; the
//       gate and up weights not at all);
//   cpu_linear(x, w, b?) -> (..., n)
//       a dense projection at decode shapes: the GEMV kernels of cpu_sparse_mlp.c read w once, as
//       stored (nn.Linear's rows, or the transposed storage prepare_model gives down and output
//       projections); more than kMaxGemvRows rows of x, or other dtypes, go to at::linear.
//   cpu_q8_linear(x, q, scales, b?) -> (..., n)
//       a projection whose weight is int8 with per-group scales (quantize_weights' format): a few
//       rows of x (decode) quantized to int16 per row, integer products per group, sums in fp32;
//       many rows (prefill) against blocks of the weight widened to fp32, through at::mm;
//   cpu_linear_cat(x, [w, ...], b?) and cpu_q8_linear_cat(x, [q, ...], [scales, ...], b?) -> (..., sum n)
//       several projections of the same x (q, k and v; gate and up) in one call, their outputs
//       concatenated: one parallel region over every weight's rows (and x quantized once);
//   cpu_q8_sparse_mlp(x, q_a, s_a, q_b?, s_b?, q_down_t, s_down_t, idx, activation, b_a?, b_b?, b_down?)
//       the neuron-sparse MLP over int8 weights in that format: the kept neurons' gate and up rows
//       (the dense projections' own values, to the bit) and their rows of the down weight stored
//       transposed, (n, d_out), quantized along d_out;
//   cpu_q8_glu_mlp(x, q_a, s_a, q_b, s_b, q_down_t, s_down_t, k, activation, b_down?) -> ((B, d_out), (B, k) ids)
//       a gated MLP of int8 projections chosen and valued by its own gate and up: every neuron's
//       act(g) * u (the dense projections' values, to the bit), the top k by magnitude, and their
//       rows of the down weight's own int8 values and scales, transposed ((n, d_out) and
//       (n / group, d_out)): a kept neuron adds what it adds in the dense int8 block;
//   cpu_screened_linear(x, w, w_int8, scale, k, b?) -> (..., n)
//       the output head screened by an int8 copy of its rows: the top k of each row recomputed from w;
//   cpu_decode_attention(q, k, v, attn_mask?, scale?) -> (B, H, L, D)
//       scaled_dot_product_attention without dropout or causal flag for a few query rows over a
//       key/value cache: grouped heads read in place, masked slots not read, sums in fp32.
//
// Dtypes: x and the weights in fp32, bf16 or fp16, one dtype per call (as F.linear asks). Weights are
// read as stored and widened in the kernels' loads; the few activations and the biases are widened
// to fp32 first, every sum is fp32, and a half-precision result is rounded once at the end.
//
// Why C++: inside a compiled decode step each op call is made from Inductor's Python wrapper, and
// what it costs there is Python, not arithmetic: with the caches as a decode step leaves them, a
// torch.library.custom_op call with a Python kernel costs as much as a small model's MLP kernel
// (benchmarks/op_overhead.py measures it). These ops go from the wrapper straight to C++ (no
// autograd kernel: inference only). Built by native.py with the activation table's defines.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#define restrict __restrict__
extern "C" {
#include "cpu_sparse_mlp.c"
}
#undef restrict

namespace {

// The table's code for an activation name; both come from the DEJAVU_ACTIVATIONS X-macro.
int activation_code(c10::string_view name) {
#define DEJAVU_NAME_TO_CODE(lower, UPPER) \
  if (name == #lower) return DEJAVU_ACT_##UPPER;
  DEJAVU_ACTIVATIONS(DEJAVU_NAME_TO_CODE)
#undef DEJAVU_NAME_TO_CODE
#define DEJAVU_NAME(lower, UPPER) " " #lower
  TORCH_CHECK(false, "activation must be one of" DEJAVU_ACTIVATIONS(DEJAVU_NAME) ", got ", std::string(name));
#undef DEJAVU_NAME
}

// The C kernels' code for a weight dtype (DEJAVU_W_* in cpu_sparse_mlp.c).
int weight_type(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return DEJAVU_W_BF16;
  if (dtype == at::kHalf) return DEJAVU_W_F16;
  return DEJAVU_W_F32;
}

bool kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// An activation argument: float32, bfloat16 or float16 on the CPU, widened to a contiguous fp32
// tensor (the kernels' input; x is a few rows, so the copy is cheap).
at::Tensor fp32_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU, got ", x.device());
  TORCH_CHECK(kernel_dtype(x.scalar_type()), name, " must be float32, bfloat16 or float16, got ", x.scalar_type());
  return x.to(at::kFloat).contiguous();
}

// The kernels write fp32; a half-precision call returns its dtype (rounded once).
at::Tensor in_dtype(const at::Tensor& out, at::ScalarType dtype) {
  return dtype == at::kFloat ? out : out.to(dtype);
}

// The decode ops called once per projection (cpu_linear, cpu_sparse_mlp, cpu_q8_linear) skip the
// tensor copies of fp32_input and in_dtype, which cost about as much as a small projection's kernel:
// a half-precision x is widened into a per-thread buffer and the fp32 result rounded into the output.
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = static_cast<float>(src[i]);
}

const float* fp32_values(const at::Tensor& x, std::vector<float>& buffer) {  // x contiguous
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  buffer.resize(x.numel());
  if (x.scalar_type() == at::kBFloat16) widen(x.data_ptr<at::BFloat16>(), buffer.data(), x.numel());
  else widen(x.data_ptr<at::Half>(), buffer.data(), x.numel());
  return buffer.data();
}

// Where the kernel writes (the output itself for fp32, else `buffer`), and the output in `dtype`.
struct KernelOutput {
  at::Tensor result;
  float* data;
  KernelOutput(at::IntArrayRef shape, at::ScalarType dtype, std::vector<float>& buffer)
      : result(at::empty(shape, at::TensorOptions().dtype(dtype))) {
    if (dtype == at::kFloat) {
      data = result.data_ptr<float>();
    } else {
      buffer.resize(result.numel());
      data = buffer.data();
    }
  }
  at::Tensor rounded() {  // the fp32 sums rounded once to the output's dtype
    const int64_t n = result.numel();
    if (result.scalar_type() == at::kBFloat16) {
      at::BFloat16* o = result.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; i++) o[i] = at::BFloat16(data[i]);
    } else if (result.scalar_type() == at::kHalf) {
      at::Half* o = result.data_ptr<at::Half>();
      for (int64_t i = 0; i < n; i++) o[i] = at::Half(data[i]);
    }
    return result;
  }
};

thread_local std::vector<float> x_buffer, out_buffer;

// x quantized to int16 for the int8 kernels (rows * d) and its per-row scales (rows), in buffers
// each thread keeps between calls: two tensor allocations cost about as much as quantizing x.
thread_local std::vector<int16_t> x_int16_buffer;
thread_local std::vector<float> x_scale_buffer;
struct QuantizedX {
  int16_t* values;
  float* scales;
  QuantizedX(int64_t rows, int64_t d) {
    x_int16_buffer.resize(std::max<int64_t>(rows * d, 1));
    x_scale_buffer.resize(std::max<int64_t>(rows, 1));
    values = x_int16_buffer.data();
    scales = x_scale_buffer.data();
  }
};

// x's sizes with the last one replaced by n: a projection's output shape.
std::vector<int64_t> with_last(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// An activation argument for those ops: on the CPU, float32, bfloat16 or float16, contiguous.
at::Tensor checked_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU, got ", x.device());
  TORCH_CHECK(kernel_dtype(x.scalar_type()), name, " must be float32, bfloat16 or float16, got ", x.scalar_type());
  return x.contiguous();
}

void check_rows(const at::Tensor& w, const char* name, int64_t n, int64_t width, at::ScalarType dtype) {
  check_cpu(w, name, dtype);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n && w.size(1) == width, name, " must be (", n, ", ", width,
              "), got ", w.sizes());
  TORCH_CHECK(w.stride(1) == 1, name, "'s rows must be contiguous (stride 1 along dim 1)");
}

// A bias in the call's dtype, as a contiguous fp32 tensor (undefined when absent); `keep` holds it.
const float* bias_ptr(const std::optional<at::Tensor>& b, const char* name, int64_t n, at::ScalarType dtype,
                      at::Tensor& keep) {
  if (!b.has_value()) return nullptr;
  check_cpu(*b, name, dtype);
  TORCH_CHECK(b->dim() == 1 && b->size(0) == n, name, " must be (", n, "), got ", b->sizes());
  keep = b->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// The kept neurons of a sparse MLP call: idx int64 (k,) shared by the nb rows of x or (nb, k), unit
// stride along k, every id in [0, n); row_stride 0 when shared.
struct NeuronIds {
  int64_t k, row_stride;
  const int64_t* ids;
  NeuronIds(const at::Tensor& idx, int64_t nb, int64_t n) {
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.device().is_cpu(), "idx must be int64 on the CPU, got ",
                idx.scalar_type(), " on ", idx.device());
    TORCH_CHECK((idx.dim() == 1 || (idx.dim() == 2 && idx.size(0) == nb)) && idx.size(-1) >= 1 &&
                    idx.stride(-1) == 1,
                "idx must be (k,) or (", nb, ", k) with k >= 1 and unit stride along k, got ", idx.sizes());
    k = idx.size(-1);
    row_stride = idx.dim() == 1 ? 0 : idx.stride(0);
    ids = idx.data_ptr<int64_t>();
    for (int64_t r = 0; r < (idx.dim() == 1 ? 1 : nb); r++)
      for (int64_t j = 0; j < k; j++) {
        const int64_t v = ids[r * row_stride + j];
        TORCH_CHECK(v >= 0 && v < n, "idx holds ", v, ", out of range for ", n, " neurons");
      }
  }
};

// A sparse MLP call's optional biases (n for gate and up, d_out for down) as fp32 pointers, or null.
struct MLPBiases {
  at::Tensor keep_a, keep_b, keep_down;
  const float *a, *b, *down;
  MLPBiases(const std::optional<at::Tensor>& b_a, const std::optional<at::Tensor>& b_b,
            const std::optional<at::Tensor>& b_down, int64_t n, int64_t d_out, at::ScalarType dtype)
      : a(bias_ptr(b_a, "b_a", n, dtype, keep_a)), b(bias_ptr(b_b, "b_b", n, dtype, keep_b)),
        down(bias_ptr(b_down, "b_down", d_out, dtype, keep_down)) {}
};

at::Tensor cpu_sparse_mlp(const at::Tensor& x_in, const at::Tensor& w_a, const std::optional<at::Tensor>& w_b,
                          const at::Tensor& w_down_t, const at::Tensor& idx, c10::string_view activation,
                          const std::optional<at::Tensor>& b_a, const std::optional<at::Tensor>& b_b,
                          const std::optional<at::Tensor>& b_down) {
  const int act = activation_code(activation);
  TORCH_CHECK(x_in.dim() == 2, "x must be (batch, d), got ", x_in.sizes());
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = checked_input(x_in, "x");
  const int64_t nb = x.size(0), d = x.size(1), n = w_a.size(0), d_out = w_down_t.size(1);
  check_rows(w_a, "w_a", n, d, dtype);
  if (w_b.has_value()) check_rows(*w_b, "w_b", n, d, dtype);
  check_rows(w_down_t, "w_down_t", n, d_out, dtype);
  const NeuronIds neurons(idx, nb, n);
  const int64_t k = neurons.k, row_stride = neurons.row_stride;
  const int64_t* ids = neurons.ids;
  const MLPBiases biases(b_a, b_b, b_down, n, d_out, dtype);
  const float *pa = biases.a, *pb = biases.b, *pd = biases.down;
  const int threads = at::get_num_threads();
  KernelOutput out({nb, d_out}, dtype, out_buffer);
  at::Tensor scratch = at::empty({threads * nb * d_out}, x.options().dtype(at::kFloat));
  dejavu_sparse_mlp(fp32_values(x, x_buffer), nb, d, d_out, weight_type(dtype), w_a.data_ptr(), w_a.stride(0),
                    w_b.has_value() ? w_b->data_ptr() : nullptr, w_b.has_value() ? w_b->stride(0) : 0,
                    w_down_t.data_ptr(), w_down_t.stride(0), pa, pb, pd, ids, k, row_stride, act,
                    out.data, scratch.data_ptr<float>(), threads, -1, -1);  // the default prefetch
  return out.rounded();
}

// Ids of the k largest of s[0..n) (of |s| with magnitude), ascending (NaN counts as the largest,
// as in torch.topk).
void topk_ascending(const float* s, int64_t n, int64_t k, int64_t* out, std::vector<float>& tmp,
                    bool magnitude = false) {
  const float inf = std::numeric_limits<float>::infinity();
  auto key = [inf, magnitude](float v) { return std::isnan(v) ? inf : (magnitude ? std::fabs(v) : v); };
  tmp.resize(n);
  for (int64_t i = 0; i < n; i++) tmp[i] = key(s[i]);
  std::nth_element(tmp.begin(), tmp.begin() + (n - k), tmp.end());
  const float threshold = tmp[n - k];  // the k-th largest: all above it are in, ties fill the rest
  int64_t above = 0;
  for (int64_t i = 0; i < n; i++) above += key(s[i]) > threshold;
  int64_t ties = k - above, m = 0;
  for (int64_t i = 0; i < n && m < k; i++) {
    const float v = key(s[i]);
    if (v > threshold || (v == threshold && ties-- > 0)) out[m++] = i;
  }
}

// The int8 predictor's act(g~) * u~ (signed_values) or its magnitude for every neuron: (B, F) fp32.
at::Tensor glu_int8_scores(const at::Tensor& x_in, const at::Tensor& w_int8, const at::Tensor& scale, int64_t k,
                           c10::string_view activation, bool signed_values) {
  const int act = activation_code(activation);
  TORCH_CHECK(x_in.dim() == 2, "x must be (batch, d), got ", x_in.sizes());
  const at::Tensor x = fp32_input(x_in, "x");
  const int64_t nb = x.size(0), d = x.size(1);
  TORCH_CHECK(w_int8.device().is_cpu() && w_int8.scalar_type() == at::kChar && w_int8.dim() == 2 &&
                  w_int8.size(1) == d && w_int8.size(0) % 2 == 0 && w_int8.is_contiguous(),
              "w_int8 must be contiguous int8 (2F, ", d, ") on the CPU, got ", w_int8.scalar_type(), " ",
              w_int8.sizes());
  const int64_t n = w_int8.size(0) / 2;
  check_cpu(scale, "scale", at::kFloat);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == 2 * n && scale.is_contiguous(), "scale must be contiguous (",
              2 * n, "), got ", scale.sizes());
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], got ", k);
  at::Tensor scores = at::empty({nb, n}, x.options());
  QuantizedX xq(nb, d);
  at::Tensor gate_up = at::empty({nb, 2 * n}, x.options());
  dejavu_glu_int8_scores_f32(x.data_ptr<float>(), nb, d, w_int8.data_ptr<int8_t>(), scale.data_ptr<float>(), n,
                             act, signed_values, scores.data_ptr<float>(), xq.values,
                             xq.scales, gate_up.data_ptr<float>(), at::get_num_threads());
  return scores;
}

at::Tensor topk_rows(const at::Tensor& scores, int64_t k, bool magnitude) {
  const int64_t nb = scores.size(0), n = scores.size(1);
  at::Tensor idx = at::empty({nb, k}, scores.options().dtype(at::kLong));
  std::vector<float> tmp;
  for (int64_t b = 0; b < nb; b++)
    topk_ascending(scores.data_ptr<float>() + b * n, n, k, idx.data_ptr<int64_t>() + b * k, tmp, magnitude);
  return idx;
}

at::Tensor cpu_glu_int8_topk(const at::Tensor& x, const at::Tensor& w_int8, const at::Tensor& scale, int64_t k,
                             c10::string_view activation) {
  return topk_rows(glu_int8_scores(x, w_int8, scale, k, activation, false), k, false);
}

std::tuple<at::Tensor, at::Tensor> cpu_glu_int8_mlp(const at::Tensor& x, const at::Tensor& w_int8,
                                                    const at::Tensor& scale, const at::Tensor& w_down_t, int64_t k,
                                                    c10::string_view activation,
                                                    const std::optional<at::Tensor>& b_down) {
  const int64_t n = w_int8.size(0) / 2, d_out = w_down_t.size(1);  // w_int8 itself: glu_int8_scores checks it
  // w_down_t: the model's down rows (in x's dtype) or a plan's bf16 copy of an fp32 model's
  const at::ScalarType table = w_down_t.scalar_type();
  TORCH_CHECK(w_down_t.device().is_cpu() && kernel_dtype(table) && w_down_t.dim() == 2 && w_down_t.size(0) == n &&
                  w_down_t.stride(1) == 1,
              "w_down_t must be float32, bfloat16 or float16 (", n, ", d_out) on the CPU with contiguous rows, got ",
              w_down_t.scalar_type(), " ", w_down_t.sizes(), " strides ", w_down_t.strides());
  TORCH_CHECK(!b_down.has_value() || kernel_dtype(b_down->scalar_type()),
              "b_down must be float32, bfloat16 or float16, got ", b_down->scalar_type());
  at::Tensor keep_d;
  const float* pd = bias_ptr(b_down, "b_down", d_out, b_down.has_value() ? b_down->scalar_type() : at::kFloat, keep_d);
  const at::Tensor values = glu_int8_scores(x, w_int8, scale, k, activation, true);
  const int64_t nb = values.size(0);
  at::Tensor idx = topk_rows(values, k, true);
  const int threads = at::get_num_threads();
  at::Tensor out = at::empty({nb, d_out}, values.options());
  at::Tensor scratch = at::empty({threads * d_out}, values.options());
  dejavu_weighted_rows(values.data_ptr<float>(), n, idx.data_ptr<int64_t>(), nb, k, w_down_t.data_ptr(),
                       weight_type(table), w_down_t.stride(0), d_out, pd, out.data_ptr<float>(),
                       scratch.data_ptr<float>(), threads);
  return {in_dtype(out, x.scalar_type()), idx};
}

// Up to this many rows of x the GEMV kernels read the weight once for all rows; beyond it a GEMM
// (at::linear) reuses each loaded weight block across rows better.
constexpr int64_t kMaxGemvRows = 16;

at::Tensor cpu_linear(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x_in.dim() >= 1 && w.dim() == 2 && x_in.size(-1) == w.size(1), "cpu_linear: x (..., ", w.size(-1),
              ") and w (n, d) expected, got ", x_in.sizes(), " and ", w.sizes());
  const int64_t n = w.size(0), d = w.size(1);
  const int64_t rows = x_in.numel() / std::max<int64_t>(d, 1);
  const at::ScalarType dtype = x_in.scalar_type();
  const bool one_dtype = kernel_dtype(dtype) && w.scalar_type() == dtype && (!b.has_value() || b->scalar_type() == dtype);
  const bool cpu = x_in.device().is_cpu() && w.device().is_cpu() && (!b.has_value() || b->device().is_cpu());
  const bool rows_layout = w.stride(1) == 1, transposed = w.stride(0) == 1 && !rows_layout;
  if (!one_dtype || !cpu || rows > kMaxGemvRows || rows == 0 || n == 0 || !(rows_layout || transposed))
    return at::linear(x_in, w, b);
  const at::Tensor x = checked_input(x_in, "x");
  at::Tensor keep_b;
  const float* pb = bias_ptr(b, "b", n, dtype, keep_b);
  const std::vector<int64_t> shape = with_last(x, n);
  KernelOutput out(shape, dtype, out_buffer);
  const float* px = fp32_values(x, x_buffer);
  const int threads = at::get_num_threads();
  if (rows_layout) {
    dejavu_linear(px, rows, d, weight_type(dtype), w.data_ptr(), w.stride(0), n, pb, out.data, threads,
                  dejavu_tuning.linear_prefetch_rows);
  } else {
    at::Tensor scratch = at::empty({threads * rows * n}, x.options().dtype(at::kFloat));
    dejavu_linear_t(px, rows, d, weight_type(dtype), w.data_ptr(), w.stride(1), n, pb, out.data,
                    scratch.data_ptr<float>(), threads);
  }
  return out.rounded();
}

// The *_cat ops outside their kernels' conditions: project(i, b_i) for each part i (ns[i] outputs, b_i
// its slice of the concatenated bias b), the results concatenated along the last dimension.
template <typename Project>
at::Tensor cat_of_parts(const std::vector<int64_t>& ns, const std::optional<at::Tensor>& b, Project project) {
  std::vector<at::Tensor> outs;
  int64_t first = 0;
  for (size_t i = 0; i < ns.size(); first += ns[i], i++)
    outs.push_back(project(i, b.has_value() ? std::optional<at::Tensor>(b->narrow(0, first, ns[i])) : std::nullopt));
  return at::cat(outs, -1);
}

// Several projections of the same x whose outputs are concatenated along the last dimension (a
// layer's q, k and v; its gate and up), b the concatenated bias: one call of the GEMV kernel over
// every weight's rows (dejavu_linear_parts), where separate cpu_linear calls pay a call, a fork and
// join and a short parallel region's imbalance each. Outside the kernel's conditions, at::linear per
// weight.
at::Tensor cpu_linear_cat(const at::Tensor& x_in, at::TensorList w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(!w.empty() && x_in.dim() >= 1, "cpu_linear_cat: x (..., d) and at least one weight expected");
  const int64_t d = x_in.size(-1);
  const at::ScalarType dtype = x_in.scalar_type();
  std::vector<const void*> ptrs;
  std::vector<int64_t> strides, ns;
  bool kernel = kernel_dtype(dtype) && x_in.device().is_cpu() && (!b.has_value() || b->scalar_type() == dtype);
  for (const at::Tensor& wi : w) {
    TORCH_CHECK(wi.dim() == 2 && wi.size(1) == d, "cpu_linear_cat: weights (n, ", d, ") expected, got ", wi.sizes());
    kernel = kernel && wi.scalar_type() == dtype && wi.device().is_cpu() && wi.stride(1) == 1;
    ptrs.push_back(wi.data_ptr());
    strides.push_back(wi.stride(0));
    ns.push_back(wi.size(0));
  }
  const int64_t n = std::accumulate(ns.begin(), ns.end(), int64_t{0});
  const int64_t rows = x_in.numel() / std::max<int64_t>(d, 1);
  if (!kernel || rows > kMaxGemvRows || rows == 0 || n == 0)
    return cat_of_parts(ns, b, [&](size_t i, const std::optional<at::Tensor>& b_i) {
      return at::linear(x_in, w[i], b_i);
    });
  const at::Tensor x = checked_input(x_in, "x");
  at::Tensor keep_b;
  const float* pb = bias_ptr(b, "b", n, dtype, keep_b);
  const std::vector<int64_t> shape = with_last(x, n);
  KernelOutput out(shape, dtype, out_buffer);
  dejavu_linear_parts(fp32_values(x, x_buffer), rows, d, weight_type(dtype), static_cast<int>(w.size()), ptrs.data(),
                      strides.data(), ns.data(), pb, out.data, at::get_num_threads(), dejavu_tuning.linear_prefetch_rows);
  return out.rounded();
}

// The group size of int8 rows q (n, width) with per-group fp32 scales (n, groups): quantize_weights'
// format (a multiple of 32 up to 256 weights per group); `what` names them in errors.
int64_t q8_group(const at::Tensor& q, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              what, ": q must be contiguous int8 (n, d) on the CPU, got ", q.scalar_type(), " ", q.sizes());
  const int64_t n = q.size(0), d = q.size(1);
  check_cpu(scales, "scales", at::kFloat);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) >= 1 && scales.is_contiguous() &&
                  d % scales.size(1) == 0,
              what, ": scales must be contiguous float32 (", n, ", groups) with groups dividing ", d, ", got ",
              scales.sizes());
  const int64_t group = d / scales.size(1);
  TORCH_CHECK(group % 32 == 0 && group <= 256, what, ": groups of a multiple of 32 up to 256 weights, got ", group);
  return group;
}

// From this many rows of x (a prefill) cpu_q8_linear multiplies in fp32 blocks: kQ8GemmBlock weight rows
// at a time are widened to fp32 and multiplied by all of x with at::mm (a tiled GEMM). The row-at-a-time
// integer kernel re-reads x for every weight row; at 512 rows it ran SmolLM2's prefill at under half
// the fp32 model's rate (benchmarks/prefill.py). The block buffer is a few MB, the result the same
// products summed in fp32 (x is not rounded to int16 here).
constexpr int64_t kQ8GemmRows = 32, kQ8GemmBlock = 256;

// bias: cpu_q8_linear's checked fp32 bias (bias_ptr's `keep`), undefined when there is none.
at::Tensor q8_linear_blocked(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group,
                             const at::Tensor& bias, at::ScalarType dtype) {
  const int64_t n = q.size(0), d = q.size(1);
  const at::Tensor x2d = x.reshape({-1, d}).to(at::kFloat);
  at::Tensor out = at::empty({x2d.size(0), n}, x2d.options());
  at::Tensor block = at::empty({std::min(n, kQ8GemmBlock), d}, x2d.options());
  for (int64_t r0 = 0; r0 < n; r0 += kQ8GemmBlock) {
    const int64_t rows = std::min(kQ8GemmBlock, n - r0);
    dejavu_q8_dequantize_rows(q.data_ptr<int8_t>(), scales.data_ptr<float>(), d, group, r0, rows,
                              block.data_ptr<float>(), at::get_num_threads());
    out.narrow(1, r0, rows).copy_(at::mm(x2d, block.narrow(0, 0, rows).t()));
  }
  if (bias.defined()) out.add_(bias);
  return out.to(dtype);
}

at::Tensor cpu_q8_linear(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                         const std::optional<at::Tensor>& b) {
  const int64_t group = q8_group(q, scales, "cpu_q8_linear");
  const int64_t n = q.size(0), d = q.size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == d, "cpu_q8_linear: x (..., ", d, ") expected, got ", x_in.sizes());
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = checked_input(x_in, "x");
  at::Tensor keep_b;
  const float* pb = bias_ptr(b, "b", n, dtype, keep_b);
  const int64_t rows = x.numel() / d;
  const std::vector<int64_t> shape = with_last(x, n);
  if (rows >= kQ8GemmRows && n > 0) return q8_linear_blocked(x, q, scales, group, keep_b, dtype).reshape(shape);
  KernelOutput out(shape, dtype, out_buffer);
  if (rows == 0 || n == 0) return out.result;
  QuantizedX xq(rows, d);
  dejavu_q8_linear(fp32_values(x, x_buffer), rows, d, q.data_ptr<int8_t>(), n, scales.data_ptr<float>(), group, pb,
                   out.data, xq.values, xq.scales, at::get_num_threads());
  return out.rounded();
}

// cpu_q8_linear over several int8 weights of the same x (quantize_weights' format, one group size),
// the outputs concatenated along the last dimension, b the concatenated bias: x quantized once, one
// call of the kernel over every weight's rows (dejavu_q8_linear_parts). A prefill's rows go to
// cpu_q8_linear per weight.
at::Tensor cpu_q8_linear_cat(const at::Tensor& x_in, at::TensorList q, at::TensorList scales,
                             const std::optional<at::Tensor>& b) {
  TORCH_CHECK(!q.empty() && q.size() == scales.size(), "cpu_q8_linear_cat: as many scales as weights (at least one), got ",
              q.size(), " and ", scales.size());
  std::vector<const int8_t*> wp;
  std::vector<const float*> sp;
  std::vector<int64_t> ns;
  int64_t group = 0, n = 0;
  for (size_t i = 0; i < q.size(); i++) {
    const int64_t g = q8_group(q[i], scales[i], "cpu_q8_linear_cat");
    TORCH_CHECK(i == 0 || (g == group && q[i].size(1) == q[0].size(1)),
                "cpu_q8_linear_cat: weights of one width and group size expected, got ", q[i].sizes(), " in groups of ", g,
                " after ", q[0].sizes(), " in groups of ", group);
    group = g;
    wp.push_back(q[i].data_ptr<int8_t>());
    sp.push_back(scales[i].data_ptr<float>());
    ns.push_back(q[i].size(0));
    n += q[i].size(0);
  }
  const int64_t d = q[0].size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == d, "cpu_q8_linear_cat: x (..., ", d, ") expected, got ", x_in.sizes());
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = checked_input(x_in, "x");
  const int64_t rows = x.numel() / d;
  if (rows >= kQ8GemmRows)
    return cat_of_parts(ns, b, [&](size_t i, const std::optional<at::Tensor>& b_i) {
      return cpu_q8_linear(x, q[i], scales[i], b_i);
    });
  at::Tensor keep_b;
  const float* pb = bias_ptr(b, "b", n, dtype, keep_b);
  const std::vector<int64_t> shape = with_last(x, n);
  KernelOutput out(shape, dtype, out_buffer);
  if (rows == 0 || n == 0) return out.result;
  QuantizedX xq(rows, d);
  dejavu_q8_linear_parts(fp32_values(x, x_buffer), rows, d, static_cast<int>(q.size()), wp.data(), sp.data(), ns.data(),
                         group, pb, out.data, xq.values, xq.scales, at::get_num_threads());
  return out.rounded();
}

at::Tensor cpu_q8_sparse_mlp(const at::Tensor& x_in, const at::Tensor& q_a, const at::Tensor& s_a,
                             const std::optional<at::Tensor>& q_b, const std::optional<at::Tensor>& s_b,
                             const at::Tensor& q_down_t, const at::Tensor& s_down_t, const at::Tensor& idx,
                             c10::string_view activation, const std::optional<at::Tensor>& b_a,
                             const std::optional<at::Tensor>& b_b, const std::optional<at::Tensor>& b_down) {
  const int act = activation_code(activation);
  TORCH_CHECK(x_in.dim() == 2, "x must be (batch, d), got ", x_in.sizes());
  const int64_t group = q8_group(q_a, s_a, "cpu_q8_sparse_mlp (gate)");
  const int64_t nb = x_in.size(0), n = q_a.size(0), d = q_a.size(1);
  TORCH_CHECK(x_in.size(1) == d, "cpu_q8_sparse_mlp: x (batch, ", d, ") expected, got ", x_in.sizes());
  TORCH_CHECK(q_b.has_value() == s_b.has_value(), "cpu_q8_sparse_mlp: q_b and s_b go together");
  if (q_b.has_value()) {
    TORCH_CHECK(q8_group(*q_b, *s_b, "cpu_q8_sparse_mlp (up)") == group && q_b->sizes() == q_a.sizes(),
                "cpu_q8_sparse_mlp: up must have gate's shape ", q_a.sizes(), " and group size ", group);
  }
  const int64_t down_group = q8_group(q_down_t, s_down_t, "cpu_q8_sparse_mlp (down)");
  TORCH_CHECK(q_down_t.size(0) == n, "cpu_q8_sparse_mlp: q_down_t must have ", n, " rows, got ", q_down_t.size(0));
  const int64_t d_out = q_down_t.size(1);
  const NeuronIds neurons(idx, nb, n);
  const int64_t k = neurons.k, row_stride = neurons.row_stride;
  const int64_t* ids = neurons.ids;
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = checked_input(x_in, "x");
  const MLPBiases biases(b_a, b_b, b_down, n, d_out, dtype);
  const float *pa = biases.a, *pb = biases.b, *pd = biases.down;
  const int threads = at::get_num_threads();
  KernelOutput out({nb, d_out}, dtype, out_buffer);
  if (nb == 0) return out.result;
  at::Tensor scratch = at::empty({threads * nb * d_out}, x.options().dtype(at::kFloat));
  at::Tensor values = at::empty({nb * k}, x.options().dtype(at::kFloat));
  QuantizedX xq(nb, d);
  dejavu_q8_sparse_mlp(fp32_values(x, x_buffer), nb, d, d_out, q_a.data_ptr<int8_t>(), s_a.data_ptr<float>(),
                       q_b.has_value() ? q_b->data_ptr<int8_t>() : nullptr,
                       s_b.has_value() ? s_b->data_ptr<float>() : nullptr, group, q_down_t.data_ptr<int8_t>(),
                       s_down_t.data_ptr<float>(), down_group, pa, pb, pd, ids, k, row_stride, act, out.data,
                       scratch.data_ptr<float>(), values.data_ptr<float>(), xq.values,
                       xq.scales, threads);
  return out.rounded();
}

std::tuple<at::Tensor, at::Tensor> cpu_q8_glu_mlp(const at::Tensor& x_in, const at::Tensor& q_a, const at::Tensor& s_a,
                                                  const at::Tensor& q_b, const at::Tensor& s_b,
                                                  const at::Tensor& q_down_t, const at::Tensor& s_down_t, int64_t k,
                                                  c10::string_view activation,
                                                  const std::optional<at::Tensor>& b_down) {
  const int act = activation_code(activation);
  TORCH_CHECK(x_in.dim() == 2, "x must be (batch, d), got ", x_in.sizes());
  const int64_t group = q8_group(q_a, s_a, "cpu_q8_glu_mlp (gate)");
  const int64_t nb = x_in.size(0), n = q_a.size(0), d = q_a.size(1);
  TORCH_CHECK(x_in.size(1) == d, "cpu_q8_glu_mlp: x (batch, ", d, ") expected, got ", x_in.sizes());
  TORCH_CHECK(q8_group(q_b, s_b, "cpu_q8_glu_mlp (up)") == group && q_b.sizes() == q_a.sizes(),
              "cpu_q8_glu_mlp: up must have gate's shape ", q_a.sizes(), " and group size ", group);
  TORCH_CHECK(q_down_t.device().is_cpu() && q_down_t.scalar_type() == at::kChar && q_down_t.dim() == 2 &&
                  q_down_t.size(0) == n && q_down_t.is_contiguous() && q_down_t.size(1) % 32 == 0,
              "cpu_q8_glu_mlp: q_down_t must be contiguous int8 (", n, ", d_out) with d_out a multiple of 32, got ",
              q_down_t.scalar_type(), " ", q_down_t.sizes());
  const int64_t d_out = q_down_t.size(1);
  check_cpu(s_down_t, "s_down_t", at::kFloat);
  TORCH_CHECK(s_down_t.dim() == 2 && s_down_t.size(1) == d_out && s_down_t.size(0) >= 1 &&
                  n % s_down_t.size(0) == 0 && s_down_t.is_contiguous(),
              "cpu_q8_glu_mlp: s_down_t must be contiguous float32 (groups, ", d_out, ") with groups dividing ", n,
              ", got ", s_down_t.sizes());
  const int64_t down_group = n / s_down_t.size(0);
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], got ", k);
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = checked_input(x_in, "x");
  at::Tensor keep_d;
  const float* pd = bias_ptr(b_down, "b_down", d_out, dtype, keep_d);
  const int threads = at::get_num_threads();
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  at::Tensor values = at::empty({nb, n}, f32), up = at::empty({nb, n}, f32);
  QuantizedX xq(nb, d);
  dejavu_q8_glu_values(fp32_values(x, x_buffer), nb, d, q_a.data_ptr<int8_t>(), s_a.data_ptr<float>(),
                       q_b.data_ptr<int8_t>(), s_b.data_ptr<float>(), group, n, act, values.data_ptr<float>(),
                       up.data_ptr<float>(), xq.values, xq.scales, threads);
  at::Tensor idx = topk_rows(values, k, true);
  at::Tensor out = at::empty({nb, d_out}, f32);
  at::Tensor scratch = at::empty({2 * threads * d_out}, f32);
  dejavu_q8_down_rows(values.data_ptr<float>(), n, idx.data_ptr<int64_t>(), nb, k, q_down_t.data_ptr<int8_t>(),
                      s_down_t.data_ptr<float>(), n, d_out, down_group, pd, out.data_ptr<float>(),
                      scratch.data_ptr<float>(), threads);
  return {in_dtype(out, dtype), idx};
}

at::Tensor cpu_screened_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& w_int8,
                               const at::Tensor& scale, int64_t k, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(w.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == w.size(1), "cpu_screened_linear: x (..., ",
              w.size(-1), ") and w (n, d) expected, got ", x_in.sizes(), " and ", w.sizes());
  const at::ScalarType dtype = x_in.scalar_type();
  const at::Tensor x = fp32_input(x_in, "x");
  const int64_t n = w.size(0), d = w.size(1);
  check_rows(w, "w", n, d, dtype);
  TORCH_CHECK(w_int8.device().is_cpu() && w_int8.scalar_type() == at::kChar && w_int8.dim() == 2 &&
                  w_int8.size(0) == n && w_int8.size(1) == d && w_int8.is_contiguous(),
              "w_int8 must be contiguous int8 (", n, ", ", d, ") on the CPU, got ", w_int8.scalar_type(), " ",
              w_int8.sizes());
  check_cpu(scale, "scale", at::kFloat);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous(), "scale must be contiguous (", n,
              "), got ", scale.sizes());
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], got ", k);
  TORCH_CHECK(d >= 1, "cpu_screened_linear: w must have at least one column");
  at::Tensor keep_b;
  const float* pb = bias_ptr(b, "b", n, dtype, keep_b);
  const int64_t rows = x.numel() / std::max<int64_t>(d, 1);
  const std::vector<int64_t> shape = with_last(x, n);
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return in_dtype(out, dtype);
  QuantizedX xq(rows, d);
  float* o = out.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  dejavu_int8_linear_f32(px, rows, d, w_int8.data_ptr<int8_t>(), n, scale.data_ptr<float>(), o,
                         xq.values, xq.scales, at::get_num_threads());
  if (pb)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < n; c++) o[r * n + c] += pb[c];
  const int type = weight_type(dtype);
  std::vector<int64_t> ids(k);
  std::vector<float> tmp;
  for (int64_t r = 0; r < rows; r++) {
    topk_ascending(o + r * n, n, k, ids.data(), tmp);
    for (int64_t c : ids)  // cpu_linear's expression for these outputs (dejavu_linear)
      o[r * n + c] = dot_typed(row_at(w.data_ptr(), type, c, w.stride(0)), type, px + r * d, d) + (pb ? pb[c] : 0.0f);
  }
  return in_dtype(out, dtype);
}

// Up to this many query rows per (batch, head) the decode attention kernel runs; beyond it (prefill)
// at::scaled_dot_product_attention's blocked kernels reuse each key across rows.
constexpr int64_t kMaxAttentionRows = 16;

at::Tensor cpu_decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4,
              "cpu_decode_attention: q (B, H, L, D), k and v (B, H_kv, S, D) expected, got ", q_in.sizes(), ", ",
              k_in.sizes(), ", ", v_in.sizes());
  const int64_t nb = q_in.size(0), heads = q_in.size(1), L = q_in.size(2), d = q_in.size(3);
  const int64_t kv_heads = k_in.size(1), S = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == nb && v_in.size(0) == nb && v_in.size(1) == kv_heads && v_in.size(2) == S &&
                  k_in.size(3) == d && v_in.size(3) == d && kv_heads >= 1 && heads % kv_heads == 0,
              "cpu_decode_attention: k and v must be (", nb, ", H_kv, S, ", d, ") with H_kv dividing ", heads,
              ", got ", k_in.sizes(), " and ", v_in.sizes());
  const at::ScalarType dtype = q_in.scalar_type();
  const at::Tensor q = checked_input(q_in, "q");
  check_cpu(k_in, "k", dtype);
  check_cpu(v_in, "v", dtype);
  // the cache as stored; only a head dimension with a stride (none in a KV cache) is copied
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  at::Tensor mask;  // bool, or an fp32 additive bias
  int64_t m_strides[4] = {0, 0, 0, 0};  // element strides of the mask broadcast to (B, H, L, S)
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.device().is_cpu() && (m.scalar_type() == at::kBool || m.scalar_type() == dtype ||
                                        m.scalar_type() == at::kFloat),
                "cpu_decode_attention: attn_mask must be bool or ", dtype, " on the CPU, got ", m.scalar_type());
    mask = m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat ? m : m.to(at::kFloat);
    const int64_t full[4] = {nb, heads, L, S};
    TORCH_CHECK(mask.dim() <= 4, "cpu_decode_attention: attn_mask of ", mask.dim(), " dimensions");
    for (int64_t i = 0; i < mask.dim(); i++) {  // broadcasting, right-aligned as in SDPA
      const int64_t j = 4 - mask.dim() + i, size = mask.size(i);
      TORCH_CHECK(size == full[j] || size == 1, "cpu_decode_attention: attn_mask of shape ", mask.sizes(),
                  " does not broadcast to (", nb, ", ", heads, ", ", L, ", ", S, ")");
      m_strides[j] = size == 1 ? 0 : mask.stride(i);
    }
  }
  if (L > kMaxAttentionRows || S == 0 || d == 0)
    return at::scaled_dot_product_attention(q_in, k_in, v_in, attn_mask, 0.0, false, scale, heads != kv_heads);
  const int64_t k_strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_strides[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int threads = at::get_num_threads();
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(threads) * S);
  KernelOutput out({nb, heads, L, d}, dtype, out_buffer);
  dejavu_decode_attention(fp32_values(q, x_buffer), nb, heads, L, d, kv_heads, S, weight_type(dtype), k.data_ptr(),
                          k_strides, v.data_ptr(), v_strides, mask.defined() ? mask.data_ptr() : nullptr,
                          mask.defined() && mask.scalar_type() == at::kBool, m_strides,
                          static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d)))), out.data,
                          scores.data(), threads);
  return out.rounded();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dejavu, m) {
  m.def("cpu_sparse_mlp(Tensor x, Tensor w_a, Tensor? w_b, Tensor w_down_t, Tensor idx, str activation, "
        "Tensor? b_a=None, Tensor? b_b=None, Tensor? b_down=None) -> Tensor");
  m.def("cpu_glu_int8_topk(Tensor x, Tensor w_int8, Tensor scale, int k, str activation) -> Tensor");
  m.def("cpu_glu_int8_mlp(Tensor x, Tensor w_int8, Tensor scale, Tensor w_down_t, int k, str activation, "
        "Tensor? b_down=None) -> (Tensor, Tensor)");
  m.def("cpu_linear(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
  m.def("cpu_screened_linear(Tensor x, Tensor w, Tensor w_int8, Tensor scale, int k, Tensor? b=None) -> Tensor");
  m.def("cpu_q8_linear(Tensor x, Tensor q, Tensor scales, Tensor? b=None) -> Tensor");
  m.def("cpu_linear_cat(Tensor x, Tensor[] w, Tensor? b=None) -> Tensor");
  m.def("cpu_q8_linear_cat(Tensor x, Tensor[] q, Tensor[] scales, Tensor? b=None) -> Tensor");
  m.def("cpu_q8_sparse_mlp(Tensor x, Tensor q_a, Tensor s_a, Tensor? q_b, Tensor? s_b, Tensor q_down_t, "
        "Tensor s_down_t, Tensor idx, str activation, Tensor? b_a=None, Tensor? b_b=None, Tensor? b_down=None) "
        "-> Tensor");
  m.def("cpu_q8_glu_mlp(Tensor x, Tensor q_a, Tensor s_a, Tensor q_b, Tensor s_b, Tensor q_down_t, Tensor s_down_t, "
        "int k, str activation, Tensor? b_down=None) -> (Tensor, Tensor)");
  m.def("cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dejavu, CPU, m) {
  m.impl("cpu_sparse_mlp", &cpu_sparse_mlp);
  m.impl("cpu_glu_int8_topk", &cpu_glu_int8_topk);
  m.impl("cpu_glu_int8_mlp", &cpu_glu_int8_mlp);
  m.impl("cpu_linear", &cpu_linear);
  m.impl("cpu_screened_linear", &cpu_screened_linear);
  m.impl("cpu_q8_linear", &cpu_q8_linear);
  m.impl("cpu_linear_cat", &cpu_linear_cat);
  m.impl("cpu_q8_linear_cat", &cpu_q8_linear_cat);
  m.impl("cpu_q8_sparse_mlp", &cpu_q8_sparse_mlp);
  m.impl("cpu_q8_glu_mlp", &cpu_q8_glu_mlp);
  m.impl("cpu_decode_attention", &cpu_decode_attention);
}
