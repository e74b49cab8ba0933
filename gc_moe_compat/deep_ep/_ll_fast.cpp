// The compiled host path of the deep_ep facade's low-latency dispatch and combine (gc_moe_compat/deep_ep/_ll_fast.py
// builds and loads it; gc_moe_compat/deep_ep/_low_latency.py calls it).
//
// One call checks the call's tensors against the record of a call shape the Python path checked before (sizes,
// dtypes, device: what its checks accept for that shape, never more), allocates the outputs as the Python path does
// (at::empty / at::empty_strided on the record's device) and stores their device addresses into the call shape's
// packed parameters (a ctypes EpLlParams, at the byte offsets Python passed once to set_param_offsets). It returns the
// outputs, or None at the first argument that differs from the record (or an allocation that fails): the Python path
// then runs its own checks and raises its own errors, so every error message lives in Python. Only ATen and the
// Python binding are used (no CUDA header or library): the allocation goes to the device the record names.

#include <ATen/core/Tensor.h>
#include <ATen/ops/as_strided.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>

namespace py = pybind11;

namespace {

// The EpLlParams pointer fields this file stores, in the order of kFieldNames.
enum Field : int {
  kX, kTopkIdx, kTopkWeights, kRecvX, kRecvScales, kRecvCount, kSrcInfo, kSrcRoute, kRouting, kLayoutRange,
  kRecvStats, kOut, kCallGen, kFieldCount
};
constexpr const char* kFieldNames[kFieldCount] = {
    "x", "topk_idx", "topk_weights", "recv_x", "recv_scales", "recv_count", "src_info", "src_route", "routing",
    "layout_range", "recv_stats", "out", "call_gen"};

// Byte offsets of the fields in EpLlParams (from the ctypes field descriptors); unset until set_param_offsets.
size_t g_offsets[kFieldCount];
bool g_offsets_set = false;

void set_param_offsets(const py::dict& offsets, size_t struct_size) {
  if (py::len(offsets) != kFieldCount) {
    throw py::value_error("set_param_offsets: expected the offsets of " + std::to_string(kFieldCount) + " fields");
  }
  for (int f = 0; f < kFieldCount; ++f) {
    if (!offsets.contains(kFieldNames[f])) {
      throw py::value_error(std::string("set_param_offsets: no offset for field ") + kFieldNames[f]);
    }
    const auto offset = offsets[kFieldNames[f]].cast<size_t>();
    if (offset % sizeof(uint64_t) || offset + sizeof(uint64_t) > struct_size) {
      throw py::value_error(std::string("set_param_offsets: field ") + kFieldNames[f] + " is not an aligned u64 "
                            "inside the struct");
    }
    g_offsets[f] = offset;
  }
  g_offsets_set = true;
}

void store(uintptr_t params, Field field, const void* value) {
  const auto word = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(value));
  std::memcpy(reinterpret_cast<char*>(params) + g_offsets[field], &word, sizeof(word));
}

// torch.Tensor and torch.nn.Parameter, the types whose instances the calls take here (set at import).
PyTypeObject* g_tensor_type = nullptr;
PyTypeObject* g_parameter_type = nullptr;

// The tensor behind ``obj`` when it is a plain torch.Tensor or Parameter (a subclass, which may override what torch
// does with it, goes to the Python path), else an undefined tensor.
at::Tensor plain_tensor(const py::handle& obj) {
  const PyTypeObject* type = Py_TYPE(obj.ptr());
  return type == g_tensor_type || type == g_parameter_type ? obj.cast<at::Tensor>() : at::Tensor();
}

// What the Python path's ``_tensor(..., dense=True)`` accepts, or stricter: ``dtype``, ``dim`` dimensions, a plain
// strided tensor with storage (no conjugate or negative bit), on ``device``, contiguous, and a non-null 16-byte
// aligned address unless it is empty.
bool dense(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const at::Device& device) {
  if (t.scalar_type() != dtype || t.dim() != dim || t.layout() != at::kStrided || t.is_nested() ||
      !t.has_storage() || t.is_conj() || t.is_neg() || t.device() != device || !t.is_contiguous()) {
    return false;
  }
  const auto address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return t.numel() == 0 || (address != 0 && address % 16 == 0);
}

bool sizes_are(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  return t.sizes().equals(at::IntArrayRef(sizes));
}

at::TensorOptions on(const at::Device& device, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(device);
}

py::object wrap(at::Tensor t) {
  return py::cast(std::move(t));
}

// One dispatch call shape as the Python path checked it (gc_moe_compat/deep_ep/_low_latency.py builds it).
struct DispatchRecord {
  py::object launches;  // the shape's LlLaunches (kept alive: ``params`` points into it)
  uintptr_t params;     // address of its EpLlParams
  at::Device device;
  int64_t num_tokens, hidden, topk, local, slots, ranks, groups, route_at, routing_at;
  at::ScalarType x_dtype, idx_dtype, stats_dtype, recv_dtype, count_dtype, src_info_dtype, layout_dtype,
      private_dtype;
  std::optional<at::ScalarType> scale_dtype;  // None: a BF16 payload, no scales
};

// One combine call shape as the Python path checked it.
struct CombineRecord {
  py::object launches;
  uintptr_t params;
  at::Device device;
  int64_t num_tokens, hidden, topk, local, slots, ranks;
  bool zero_copy;  // the send rows are the workspace's (set once in params), x only checked
  at::ScalarType x_dtype, idx_dtype, weights_dtype, out_dtype, src_info_dtype, layout_dtype, route_dtype,
      call_gen_dtype;
};

// low_latency_dispatch's host work: None, or (launches, recv_x, scales or None, recv_count, src_info, layout_range,
// private, src_route, routing). ``records``: the dispatch records of the call's other arguments, keyed by
// (x.shape[0], x.shape[1], topk_idx.shape[1], topk_idx.element_size()).
py::object dispatch(const py::dict& records, const py::handle& x_obj, const py::handle& idx_obj,
                    const py::handle& stats_obj) {
  const at::Tensor x = plain_tensor(x_obj);
  const at::Tensor idx = plain_tensor(idx_obj);
  if (!g_offsets_set || !x.defined() || !idx.defined() || x.dim() != 2 || idx.dim() != 2) {
    return py::none();
  }
  const py::tuple key = py::make_tuple(x.size(0), x.size(1), idx.size(1), idx.element_size());
  // Held for the call (an allocation may run Python code, a dispatch mode's, which could drop it from the dict).
  const auto found = py::reinterpret_borrow<py::object>(PyDict_GetItem(records.ptr(), key.ptr()));
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const DispatchRecord&>();
  if (!dense(x, r.x_dtype, 2, r.device) || !sizes_are(x, {r.num_tokens, r.hidden}) ||
      !dense(idx, r.idx_dtype, 2, r.device) || !sizes_are(idx, {r.num_tokens, r.topk})) {
    return py::none();
  }
  at::Tensor stats;
  if (!stats_obj.is_none()) {
    stats = plain_tensor(stats_obj);
    if (!stats.defined() || !dense(stats, r.stats_dtype, 1, r.device) || !sizes_are(stats, {r.local})) {
      return py::none();
    }
  }
  at::Tensor recv_x, scales, recv_count, src_info, layout_range, priv, src_route, routing;
  try {
    recv_x = at::empty({r.local, r.slots, r.hidden}, on(r.device, r.recv_dtype));
    if (r.scale_dtype) {  // column-major in the last two dimensions, as the Python path allocates them
      scales = at::empty_strided({r.local, r.slots, r.groups}, {r.groups * r.slots, 1, r.slots},
                                 on(r.device, *r.scale_dtype));
    }
    recv_count = at::empty({r.local}, on(r.device, r.count_dtype));
    src_info = at::empty({r.local, r.slots}, on(r.device, r.src_info_dtype));
    layout_range = at::empty({r.local, r.ranks}, on(r.device, r.layout_dtype));
    priv = at::empty({r.routing_at + r.num_tokens * r.topk}, on(r.device, r.private_dtype));
    src_route = at::as_strided(priv, {r.local, r.slots}, {r.slots, 1}, r.route_at);
    routing = at::as_strided(priv, {r.num_tokens, r.topk}, {r.topk, 1}, r.routing_at);
  } catch (const c10::Error&) {  // out of memory and the like: the Python path allocates again and raises torch's
    return py::none();
  }
  store(r.params, kX, x.const_data_ptr());
  store(r.params, kTopkIdx, idx.const_data_ptr());
  store(r.params, kRecvX, recv_x.const_data_ptr());
  store(r.params, kRecvScales, scales.defined() ? scales.const_data_ptr() : nullptr);
  store(r.params, kRecvCount, recv_count.const_data_ptr());
  store(r.params, kSrcInfo, src_info.const_data_ptr());
  store(r.params, kLayoutRange, layout_range.const_data_ptr());
  // The views' addresses from the allocation's (an empty view's data pointer is null, its place in params is not).
  const auto* base = static_cast<const char*>(priv.const_data_ptr());
  store(r.params, kCallGen, base);
  store(r.params, kSrcRoute, base + r.route_at * priv.element_size());
  store(r.params, kRouting, base + r.routing_at * priv.element_size());
  store(r.params, kRecvStats, stats.defined() ? stats.const_data_ptr() : nullptr);
  return py::make_tuple(r.launches, wrap(std::move(recv_x)), scales.defined() ? wrap(std::move(scales)) : py::none(),
                        wrap(std::move(recv_count)), wrap(std::move(src_info)), wrap(std::move(layout_range)),
                        wrap(std::move(priv)), wrap(std::move(src_route)), wrap(std::move(routing)));
}

// low_latency_combine's host work: None, or (launches, out, call_gen). ``records``: the combine records of the
// handle's sizes and the call's flags, keyed by topk_idx.element_size().
py::object combine(const py::dict& records, const py::handle& src_info_obj, const py::handle& layout_obj,
                   const py::handle& route_obj, const py::handle& routing_obj, const py::handle& x_obj,
                   const py::handle& idx_obj, const py::handle& weights_obj, const py::handle& out_obj) {
  const at::Tensor idx = plain_tensor(idx_obj);
  if (!g_offsets_set || !idx.defined()) {
    return py::none();
  }
  const py::int_ key(idx.element_size());
  const auto found = py::reinterpret_borrow<py::object>(PyDict_GetItem(records.ptr(), key.ptr()));
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const CombineRecord&>();
  const at::Tensor src_info = plain_tensor(src_info_obj);
  const at::Tensor layout = plain_tensor(layout_obj);
  const at::Tensor route = plain_tensor(route_obj);
  const at::Tensor routing = plain_tensor(routing_obj);
  const at::Tensor x = plain_tensor(x_obj);
  const at::Tensor weights = plain_tensor(weights_obj);
  const bool given = !out_obj.is_none();
  at::Tensor out = given ? plain_tensor(out_obj) : at::Tensor();
  if (!src_info.defined() || !layout.defined() || !route.defined() || !routing.defined() || !x.defined() ||
      !weights.defined() || (given && !out.defined())) {
    return py::none();
  }
  if (!dense(src_info, r.src_info_dtype, 2, r.device) || !sizes_are(src_info, {r.local, r.slots}) ||
      !dense(layout, r.layout_dtype, 2, r.device) || !sizes_are(layout, {r.local, r.ranks}) ||
      !dense(route, r.route_dtype, 2, r.device) || !sizes_are(route, {r.local, r.slots}) ||
      !dense(routing, r.route_dtype, 2, r.device) || !sizes_are(routing, {r.num_tokens, r.topk}) ||
      !dense(x, r.x_dtype, 3, r.device) || !sizes_are(x, {r.local, r.slots, r.hidden}) ||
      !dense(idx, r.idx_dtype, 2, r.device) || !sizes_are(idx, {r.num_tokens, r.topk}) ||
      !dense(weights, r.weights_dtype, 2, r.device) || !sizes_are(weights, {r.num_tokens, r.topk}) ||
      (given && (!dense(out, r.out_dtype, 2, r.device) || !sizes_are(out, {r.num_tokens, r.hidden})))) {
    return py::none();
  }
  at::Tensor call_gen;
  try {
    if (!given) {
      out = at::empty({r.num_tokens, r.hidden}, on(r.device, r.out_dtype));
    }
    call_gen = at::empty({1}, on(r.device, r.call_gen_dtype));
  } catch (const c10::Error&) {
    return py::none();
  }
  if (!r.zero_copy) {  // the zero-copy send rows are the workspace's, set once
    store(r.params, kX, x.const_data_ptr());
  }
  store(r.params, kTopkIdx, idx.const_data_ptr());
  store(r.params, kTopkWeights, weights.const_data_ptr());
  store(r.params, kOut, out.const_data_ptr());
  store(r.params, kSrcInfo, src_info.const_data_ptr());
  store(r.params, kLayoutRange, layout.const_data_ptr());
  store(r.params, kSrcRoute, route.const_data_ptr());
  store(r.params, kRouting, routing.const_data_ptr());
  store(r.params, kCallGen, call_gen.const_data_ptr());
  return py::make_tuple(r.launches, given ? py::reinterpret_borrow<py::object>(out_obj) : wrap(std::move(out)),
                        wrap(std::move(call_gen)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const py::module_ torch = py::module_::import("torch");
  g_tensor_type = reinterpret_cast<PyTypeObject*>(torch.attr("Tensor").ptr());
  g_parameter_type = reinterpret_cast<PyTypeObject*>(torch.attr("nn").attr("Parameter").ptr());
  m.doc() = "The compiled host path of the deep_ep facade's low-latency calls (gc_moe_compat/deep_ep/_ll_fast.py)";
  py::tuple fields(static_cast<size_t>(kFieldCount));
  for (int f = 0; f < kFieldCount; ++f) {
    fields[f] = py::str(kFieldNames[f]);
  }
  m.attr("PARAM_FIELDS") = fields;
  m.def("set_param_offsets", &set_param_offsets, py::arg("offsets"), py::arg("struct_size"),
        "Sets the byte offsets of the EpLlParams fields PARAM_FIELDS names (once, from the ctypes fields).");
  py::class_<DispatchRecord>(m, "DispatchRecord")
      .def(py::init([](py::object launches, uintptr_t params, at::Device device, int64_t num_tokens, int64_t hidden,
                       int64_t topk, int64_t local, int64_t slots, int64_t ranks, int64_t groups, int64_t route_at,
                       int64_t routing_at, at::ScalarType x_dtype, at::ScalarType idx_dtype,
                       at::ScalarType stats_dtype, at::ScalarType recv_dtype, std::optional<at::ScalarType> scale_dtype,
                       at::ScalarType count_dtype, at::ScalarType src_info_dtype, at::ScalarType layout_dtype,
                       at::ScalarType private_dtype) {
             return DispatchRecord{std::move(launches), params, device, num_tokens, hidden, topk, local, slots,
                                   ranks, groups, route_at, routing_at, x_dtype, idx_dtype, stats_dtype,
                                   recv_dtype, count_dtype, src_info_dtype, layout_dtype, private_dtype,
                                   scale_dtype};
           }),
           py::kw_only(), py::arg("launches"), py::arg("params"), py::arg("device"), py::arg("num_tokens"),
           py::arg("hidden"), py::arg("topk"), py::arg("local"), py::arg("slots"), py::arg("ranks"),
           py::arg("groups"), py::arg("route_at"), py::arg("routing_at"), py::arg("x_dtype"), py::arg("idx_dtype"),
           py::arg("stats_dtype"), py::arg("recv_dtype"), py::arg("scale_dtype"), py::arg("count_dtype"),
           py::arg("src_info_dtype"), py::arg("layout_dtype"), py::arg("private_dtype"))
      .def_readonly("launches", &DispatchRecord::launches);
  py::class_<CombineRecord>(m, "CombineRecord")
      .def(py::init([](py::object launches, uintptr_t params, at::Device device, int64_t num_tokens, int64_t hidden,
                       int64_t topk, int64_t local, int64_t slots, int64_t ranks, bool zero_copy,
                       at::ScalarType x_dtype, at::ScalarType idx_dtype, at::ScalarType weights_dtype,
                       at::ScalarType out_dtype, at::ScalarType src_info_dtype, at::ScalarType layout_dtype,
                       at::ScalarType route_dtype, at::ScalarType call_gen_dtype) {
             return CombineRecord{std::move(launches), params, device, num_tokens, hidden, topk, local, slots,
                                  ranks, zero_copy, x_dtype, idx_dtype, weights_dtype, out_dtype, src_info_dtype,
                                  layout_dtype, route_dtype, call_gen_dtype};
           }),
           py::kw_only(), py::arg("launches"), py::arg("params"), py::arg("device"), py::arg("num_tokens"),
           py::arg("hidden"), py::arg("topk"), py::arg("local"), py::arg("slots"), py::arg("ranks"),
           py::arg("zero_copy"), py::arg("x_dtype"), py::arg("idx_dtype"), py::arg("weights_dtype"),
           py::arg("out_dtype"), py::arg("src_info_dtype"), py::arg("layout_dtype"), py::arg("route_dtype"),
           py::arg("call_gen_dtype"))
      .def_readonly("launches", &CombineRecord::launches);
  m.def("dispatch", &dispatch, py::arg("records"), py::arg("x"), py::arg("topk_idx"), py::arg("recv_stats"),
        "low_latency_dispatch's checks, allocations and pointer stores for a recorded call shape, or None.");
  m.def("combine", &combine, py::arg("records"), py::arg("src_info"), py::arg("layout_range"), py::arg("src_route"),
        py::arg("routing"), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("out"),
        "low_latency_combine's checks, allocations and pointer stores for a recorded call shape, or None.");
}
