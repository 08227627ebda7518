// The Python binding of every op in this folder (one extension module, `pdserve_kernels`).
// Light headers: torch/extension.h (all of torch's C++ API) tripled the build time.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace pdserve {
bool brgemm_packs_bf16();
at::Tensor pack_linear_weight(const at::Tensor& w);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages,
                                  const at::Tensor& v_pages, const at::Tensor& tables,
                                  const at::Tensor& lens, int64_t window, double scale,
                                  int64_t form);
at::Tensor paged_flash_attention(const at::Tensor& q, const at::Tensor& k_pages,
                                 const at::Tensor& v_pages, const at::Tensor& tables,
                                 const at::Tensor& q_starts, const at::Tensor& ctx_lens,
                                 int64_t window, double scale, int64_t form);
bool has_dpbf16();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool one_plus);
at::Tensor rope_write(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin_signed, const at::Tensor& k_slots,
                      const at::Tensor& v_slots, const at::Tensor& slots);
}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("brgemm_packs_bf16", &pdserve::brgemm_packs_bf16,
        "whether brgemm runs bf16 with VNNI-packed weights on this CPU");
  m.def("pack_linear_weight", &pdserve::pack_linear_weight, "[N, K] bf16 -> brgemm panels");
  m.def("packed_linear", &pdserve::packed_linear, "x @ W^T (+ bias) (+ residual), invariant");
  m.def("paged_decode_attention", &pdserve::paged_decode_attention,
        "one query row per request against its paged keys, invariant; form: 0 float32 "
        "products, 1 the scores on AVX512-BF16 dot products (bf16)");
  m.def("paged_flash_attention", &pdserve::paged_flash_attention,
        "each request's last query rows against its paged keys (prompt chunks and decode "
        "rows alike), causal, invariant; form: 0 brgemm in the input dtype, 1 bf16 inputs with "
        "float32 products, 2 bf16 on AVX512-BF16 dot products");
  m.def("has_dpbf16", &pdserve::has_dpbf16,
        "whether the kernels' AVX512-BF16 dot products were built");
  m.def("rms_norm", &pdserve::rms_norm, "RMSNorm in one kernel, HF's rounding, invariant");
  m.def("rope_write", &pdserve::rope_write,
        "RoPE on the query and key heads, the rotated K and V stored at their cache slots");
}
