// The compiled host path of the deep_ep facade's calls (gc_moe_compat/deep_ep/_compiled_host.py builds and loads it):
// the low-latency dispatch and combine (gc_moe_compat/deep_ep/_low_latency.py calls them) and the normal mode's
// dispatch, uncached and cached, and combine (gc_moe_compat/deep_ep/_normal.py).
//
// One call checks the call's tensors against the record of a call shape the Python path checked before (sizes,
// dtypes, device: what its checks accept for that shape, never more), allocates the outputs as the Python path does
// (at::empty / at::empty_strided on the record's device, small outputs as parts of one allocation) and stores their
// device addresses into the call shape's packed parameters (a ctypes EpLlParams or EpNormalParams, at the byte
// offsets Python passed once to set_param_offsets). It returns the outputs, or None at the first argument that
// differs from the record (or an allocation that fails): the Python path then runs its own checks and raises its own
// errors, so every error message lives in Python. Only ATen and the Python binding are used (no CUDA header or library): the allocation goes to the
// device the record names.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// The fields of a packed parameter struct this file stores: their names (the ctypes fields'), their widths (8: an
// address, 4: a count) and, once set_param_offsets has given them, their byte offsets in the struct.
struct Layout {
  const char* name;
  std::vector<const char*> fields;
  std::vector<size_t> widths;
  std::vector<size_t> offsets;  // empty until set

  bool set() const { return !offsets.empty(); }
};

// The EpLlParams pointer fields, in the order of Layout::fields.
enum Field : int {
  kX, kTopkIdx, kTopkWeights, kRecvX, kRecvScales, kRecvCount, kSrcInfo, kSrcRoute, kRouting, kLayoutRange,
  kRecvStats, kOut, kCallGen, kFieldCount
};
Layout g_ll{"EpLlParams",
            {"x", "topk_idx", "topk_weights", "recv_x", "recv_scales", "recv_count", "src_info", "src_route",
             "routing", "layout_range", "recv_stats", "out", "call_gen"},
            std::vector<size_t>(kFieldCount, sizeof(uint64_t)),
            {}};

// The EpNormalParams fields the normal mode's calls set (their addresses, the host record's, the received rows).
enum NormalField : int {
  kNX, kNXScales, kNTopkIdx, kNTopkWeights, kNInRank, kNPerRank, kNPerExpert, kNRankPrefix, kNChannelPrefix,
  kNRecvChannelPrefix, kNSendHead, kNRecvX, kNRecvScales, kNRecvTopkIdx, kNRecvTopkWeights, kNRecvSrcIdx, kNOut,
  kNOutTopkWeights, kNBias0, kNBias1, kNHostCounts, kNRecvRows, kNormalFieldCount
};
Layout g_normal{"EpNormalParams",
                {"x", "x_scales", "topk_idx", "topk_weights", "is_token_in_rank", "num_tokens_per_rank",
                 "num_tokens_per_expert", "rank_prefix", "channel_prefix", "recv_channel_prefix", "send_head",
                 "recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "out",
                 "out_topk_weights", "bias_0", "bias_1", "host_counts", "recv_rows"},
                [] {
                  std::vector<size_t> widths(kNormalFieldCount, sizeof(uint64_t));
                  widths[kNRecvRows] = sizeof(uint32_t);
                  return widths;
                }(),
                {}};

Layout& layout_named(const std::string& name) {
  if (name == g_ll.name) {
    return g_ll;
  }
  if (name == g_normal.name) {
    return g_normal;
  }
  throw py::value_error("set_param_offsets: no parameter struct " + name);
}

void set_param_offsets(const std::string& name, const py::dict& offsets, size_t struct_size) {
  Layout& layout = layout_named(name);
  const size_t count = layout.fields.size();
  if (py::len(offsets) != count) {
    throw py::value_error("set_param_offsets: expected the offsets of " + std::to_string(count) + " fields of " +
                          name);
  }
  std::vector<size_t> found(count);
  for (size_t f = 0; f < count; ++f) {
    if (!offsets.contains(layout.fields[f])) {
      throw py::value_error("set_param_offsets: no offset for field " + name + "." + layout.fields[f]);
    }
    found[f] = offsets[layout.fields[f]].cast<size_t>();
    if (found[f] % layout.widths[f] || found[f] + layout.widths[f] > struct_size) {
      throw py::value_error("set_param_offsets: field " + name + "." + layout.fields[f] + " is not an aligned " +
                            std::to_string(layout.widths[f]) + "-byte field inside the struct");
    }
  }
  layout.offsets = std::move(found);
}

// Stores ``value`` into field ``field`` of the ``layout`` struct at ``params`` (a count field takes its low word).
void put(const Layout& layout, uintptr_t params, int field, uint64_t value) {
  char* at = reinterpret_cast<char*>(params) + layout.offsets[field];
  if (layout.widths[field] == sizeof(uint64_t)) {
    std::memcpy(at, &value, sizeof(value));
  } else {
    const auto word = static_cast<uint32_t>(value);
    std::memcpy(at, &word, sizeof(word));
  }
}

void store(uintptr_t params, Field field, const void* value) {
  put(g_ll, params, field, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(value)));
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

// How the kernels read a tensor: by 16-byte vectors (its address 16-byte aligned), or element by element (the
// routing: aligned to its element size, so that any row slice serves, as with DeepEP).
enum class Reads { kVectors, kElements };

// What the Python path's ``_tensor(..., dense=True)`` accepts (``vectors`` as ``reads`` says), or stricter:
// ``dtype``, ``dim`` dimensions, a plain strided tensor with storage (no conjugate or negative bit), on ``device``,
// contiguous, and a non-null address aligned as ``reads`` needs unless it is empty.
bool dense(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const at::Device& device,
           Reads reads = Reads::kVectors) {
  if (t.scalar_type() != dtype || t.dim() != dim || t.layout() != at::kStrided || t.is_nested() ||
      !t.has_storage() || t.is_conj() || t.is_neg() || t.device() != device || !t.is_contiguous()) {
    return false;
  }
  const auto address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto alignment = reads == Reads::kVectors ? uintptr_t{16} : static_cast<uintptr_t>(t.element_size());
  return t.numel() == 0 || (address != 0 && address % alignment == 0);
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

// Every part of one allocation starts at a multiple of this many bytes (gc_moe_compat/deep_ep/_parts.py's
// PART_ALIGNMENT: the kernels read by 16-byte vectors).
constexpr int64_t kPartAlignment = 16;

// The byte starts of parts of ``nbytes`` bytes laid out in order, each rounded up to kPartAlignment, and (last) the
// bytes the allocation needs: _parts.vector_aligned_starts.
template <size_t N>
std::array<int64_t, N + 1> vector_aligned_starts(const std::array<int64_t, N>& nbytes) {
  std::array<int64_t, N + 1> starts{};
  int64_t end = 0;
  for (size_t i = 0; i < N; ++i) {
    starts[i] = (end + kPartAlignment - 1) / kPartAlignment * kPartAlignment;
    end = starts[i] + nbytes[i];
  }
  starts[N] = end;
  return starts;
}

// Whether ``block`` (a fresh allocation) is a plain tensor that part_of can share: not one a Python dispatch mode
// made (a tensor subclass such as a fake tensor carries the Python key, and a part without its Python object would
// not); the call then goes to the Python path.
bool plain_block(const at::Tensor& block) {
  return !block.key_set().has(c10::DispatchKey::Python);
}

// A contiguous tensor of ``dtype`` and ``sizes`` on the storage of ``block`` (a plain_block) from byte
// ``start`` (a multiple of the dtype's size): what _parts.part makes with Tensor.set_, here without the dispatcher
// (each ATen view op costs a microsecond or two of host time). Not an autograd view, as DeepEP's separate tensors.
at::Tensor part_of(const at::Tensor& block, at::ScalarType dtype, int64_t start, at::IntArrayRef sizes) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(),
                                                          c10::scalarTypeToTypeMeta(dtype));
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(sizes);
  impl->set_storage_offset(start / static_cast<int64_t>(c10::elementSize(dtype)));
  return t;
}

// One dispatch call shape as the Python path checked it (gc_moe_compat/deep_ep/_low_latency.py builds it).
struct DispatchRecord {
  py::object launches;  // the shape's LlLaunches (kept alive: ``params`` points into it)
  uintptr_t params;     // address of its EpLlParams
  at::Device device;
  int64_t num_tokens, hidden, topk, local, slots, ranks, groups;
  // The private allocation's parts (_low_latency._PrivateLayout: element offsets) and its elements.
  int64_t layout_at, count_at, info_at, route_at, routing_at, private_size;
  at::ScalarType x_dtype, idx_dtype, stats_dtype, recv_dtype, private_dtype;
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
// (x.shape[0], x.shape[1], topk_idx.shape[1]); a topk_idx of another dtype than the record's (int64) goes to the
// Python path, which refuses it.
py::object dispatch(const py::dict& records, const py::handle& x_obj, const py::handle& idx_obj,
                    const py::handle& stats_obj) {
  const at::Tensor x = plain_tensor(x_obj);
  const at::Tensor idx = plain_tensor(idx_obj);
  if (!g_ll.set() || !x.defined() || !idx.defined() || x.dim() != 2 || idx.dim() != 2) {
    return py::none();
  }
  const py::tuple key = py::make_tuple(x.size(0), x.size(1), idx.size(1));
  // Held for the call (an allocation may run Python code, a dispatch mode's, which could drop it from the dict).
  const auto found = py::reinterpret_borrow<py::object>(PyDict_GetItem(records.ptr(), key.ptr()));
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const DispatchRecord&>();
  if (!dense(x, r.x_dtype, 2, r.device) || !sizes_are(x, {r.num_tokens, r.hidden}) ||
      !dense(idx, r.idx_dtype, 2, r.device, Reads::kElements) || !sizes_are(idx, {r.num_tokens, r.topk})) {
    return py::none();
  }
  at::Tensor stats;
  if (!stats_obj.is_none()) {
    stats = plain_tensor(stats_obj);
    if (!stats.defined() || !dense(stats, r.stats_dtype, 1, r.device, Reads::kElements) ||
        !sizes_are(stats, {r.local})) {
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
    priv = at::empty({r.private_size}, on(r.device, r.private_dtype));
  } catch (const c10::Error&) {  // out of memory and the like: the Python path allocates again and raises torch's
    return py::none();
  }
  if (!plain_block(priv)) {
    return py::none();
  }
  const int64_t word = static_cast<int64_t>(priv.element_size());  // the parts' starts are in its elements
  layout_range = part_of(priv, at::kLong, r.layout_at * word, {r.local, r.ranks});
  recv_count = part_of(priv, r.private_dtype, r.count_at * word, {r.local});
  src_info = part_of(priv, r.private_dtype, r.info_at * word, {r.local, r.slots});
  src_route = part_of(priv, r.private_dtype, r.route_at * word, {r.local, r.slots});
  routing = part_of(priv, r.private_dtype, r.routing_at * word, {2, r.num_tokens, r.topk});
  store(r.params, kX, x.const_data_ptr());
  store(r.params, kTopkIdx, idx.const_data_ptr());
  store(r.params, kRecvX, recv_x.const_data_ptr());
  store(r.params, kRecvScales, scales.defined() ? scales.const_data_ptr() : nullptr);
  store(r.params, kRecvCount, recv_count.const_data_ptr());
  store(r.params, kSrcInfo, src_info.const_data_ptr());
  store(r.params, kLayoutRange, layout_range.const_data_ptr());
  // The parts' addresses from the allocation's (an empty part's data pointer is null, its place in params is not).
  const auto* base = static_cast<const char*>(priv.const_data_ptr());
  store(r.params, kCallGen, base);
  store(r.params, kSrcRoute, base + r.route_at * priv.element_size());
  store(r.params, kRouting, base + r.routing_at * priv.element_size());
  store(r.params, kRecvStats, stats.defined() ? stats.const_data_ptr() : nullptr);
  return py::make_tuple(r.launches, wrap(std::move(recv_x)), scales.defined() ? wrap(std::move(scales)) : py::none(),
                        wrap(std::move(recv_count)), wrap(std::move(src_info)), wrap(std::move(layout_range)),
                        wrap(std::move(priv)), wrap(std::move(src_route)), wrap(std::move(routing)));
}

// low_latency_combine's host work: None, or (launches, out, call_gen). ``record``: the combine record of the
// handle's sizes and the call's flags (held by the caller for the call); a topk_idx of another dtype than the
// record's (int64) goes to the Python path, which refuses it. ``call_gen``: the word the kernels store the call's
// generation into (a call without a receive hook: the workspace's shared one), or None for a new one (a hooked call).
py::object combine(const CombineRecord& r, const py::handle& src_info_obj, const py::handle& layout_obj,
                   const py::handle& route_obj, const py::handle& routing_obj, const py::handle& x_obj,
                   const py::handle& idx_obj, const py::handle& weights_obj, const py::handle& out_obj,
                   const py::handle& call_gen_obj) {
  const at::Tensor idx = plain_tensor(idx_obj);
  if (!g_ll.set() || !idx.defined()) {
    return py::none();
  }
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
      !dense(routing, r.route_dtype, 3, r.device) || !sizes_are(routing, {2, r.num_tokens, r.topk}) ||
      !dense(x, r.x_dtype, 3, r.device) || !sizes_are(x, {r.local, r.slots, r.hidden}) ||
      !dense(idx, r.idx_dtype, 2, r.device, Reads::kElements) || !sizes_are(idx, {r.num_tokens, r.topk}) ||
      !dense(weights, r.weights_dtype, 2, r.device, Reads::kElements) ||
      !sizes_are(weights, {r.num_tokens, r.topk}) ||
      (given && (!dense(out, r.out_dtype, 2, r.device) || !sizes_are(out, {r.num_tokens, r.hidden})))) {
    return py::none();
  }
  const bool own_gen = call_gen_obj.is_none();
  at::Tensor call_gen = own_gen ? at::Tensor() : plain_tensor(call_gen_obj);
  if (!own_gen && (!call_gen.defined() || !dense(call_gen, r.call_gen_dtype, 1, r.device) ||
                   !sizes_are(call_gen, {1}))) {
    return py::none();
  }
  try {
    if (!given) {
      out = at::empty({r.num_tokens, r.hidden}, on(r.device, r.out_dtype));
    }
    if (own_gen) {
      call_gen = at::empty({1}, on(r.device, r.call_gen_dtype));
    }
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
                        own_gen ? wrap(std::move(call_gen)) : py::reinterpret_borrow<py::object>(call_gen_obj));
}

// -- the normal mode ---------------------------------------------------------------------------------------------

constexpr int64_t kCIntMax = (int64_t{1} << 31) - 1;

uint64_t address(const at::Tensor& t) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
}

void put_normal(uintptr_t params, NormalField field, uint64_t value) {
  put(g_normal, params, field, value);
}

int64_t dtype_code(const std::optional<at::ScalarType>& dtype) {
  return dtype ? static_cast<int64_t>(*dtype) : -1;
}

// ``handle.most_sent`` as the Python path accepts it without a message: None or an int (not a bool or a subclass) in
// [0, C_INT_MAX].
bool most_sent_ok(const py::handle& most_sent) {
  if (most_sent.is_none()) {
    return true;
  }
  if (!PyLong_CheckExact(most_sent.ptr())) {
    return false;
  }
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(most_sent.ptr(), &overflow);
  return !overflow && value >= 0 && value <= kCIntMax;
}

// The item of an exact tuple (a NormalHandle is checked exactly in Python), borrowed.
py::handle item(const py::handle& tuple, Py_ssize_t i) {
  return PyTuple_GET_ITEM(tuple.ptr(), i);
}

// x as the dispatch takes it: a plain tensor (the BF16 payload) or an exact pair (FP8 payload, scales), each 2-D;
// false for anything else (the Python path judges it). ``payload_obj`` / ``scales_obj``: the Python objects.
bool x_parts(const py::handle& x_obj, at::Tensor& payload, at::Tensor& scales, py::handle& payload_obj,
             py::handle& scales_obj) {
  if (PyTuple_CheckExact(x_obj.ptr())) {
    if (PyTuple_GET_SIZE(x_obj.ptr()) != 2) {
      return false;
    }
    payload_obj = item(x_obj, 0);
    scales_obj = item(x_obj, 1);
    payload = plain_tensor(payload_obj);
    scales = plain_tensor(scales_obj);
    return payload.defined() && scales.defined() && payload.dim() == 2 && scales.dim() == 2;
  }
  payload_obj = x_obj;
  scales_obj = py::handle(Py_None);
  payload = plain_tensor(x_obj);
  return payload.defined() && payload.dim() == 2;
}

// The entries of NormalDispatchRecord::handle_at, in _normal._HandleLayout's order.
enum HandlePart : int { kRankPrefixAt, kChannelPrefixAt, kSendHeadAt, kRecvChannelPrefixAt, kHandleBytes };

// One normal-mode dispatch call shape as the Python path checked it (gc_moe_compat/deep_ep/_normal.py builds it):
// uncached (the layout's tensors, notify's parameters and the host record of counts) or cached (the handle's
// tensors instead).
struct NormalDispatchRecord {
  py::object launch;         // the shape's NormalLaunch (kept alive: the params point into it)
  py::object host, tag;      // uncached: the host record of counts and its tag (None when cached)
  uintptr_t notify_params;   // uncached: notify's EpNormalParams (0 when cached)
  uintptr_t params;          // the transfer's EpNormalParams
  uintptr_t host_counts;     // uncached: the host record's address
  at::Device device;
  bool cached;
  int64_t ranks, channels, tokens, hidden, experts, local, topk, num_scales, scale_token_stride,
      scale_hidden_stride;
  at::ScalarType x_dtype, count_dtype, mask_dtype, index_dtype, weight_dtype;
  std::optional<at::ScalarType> scale_dtype, idx_dtype;  // None: no scales (BF16) / no top-k
  // uncached: the byte starts of the handle's four int32 matrices in their one allocation and its bytes, indexed by
  // HandlePart (_normal._HandleLayout)
  std::vector<int64_t> handle_at;

  // What normal_dispatch / normal_cached_dispatch look the record up by: what they read off the call's tensors.
  py::tuple key() const {
    if (cached) {
      return py::make_tuple(tokens, hidden, static_cast<int64_t>(x_dtype), dtype_code(scale_dtype), num_scales,
                            scale_token_stride, scale_hidden_stride);
    }
    return py::make_tuple(tokens, hidden, static_cast<int64_t>(x_dtype), dtype_code(scale_dtype), num_scales,
                          scale_token_stride, scale_hidden_stride, topk, experts);
  }
};

// The record of ``key`` in ``records`` (a new reference, held for the call: an allocation may run Python code, a
// dispatch mode's, which could drop it from the dict), or null.
py::object lookup(const py::handle& records, const py::tuple& key) {
  if (!PyDict_CheckExact(records.ptr())) {
    return py::object();
  }
  return py::reinterpret_borrow<py::object>(PyDict_GetItem(records.ptr(), key.ptr()));
}

// The payload and scales match the record (the scales' strides too: the launch's fields hold them).
bool x_matches(const NormalDispatchRecord& r, const at::Tensor& payload, const at::Tensor& scales) {
  if (!dense(payload, r.x_dtype, 2, r.device) || !sizes_are(payload, {r.tokens, r.hidden})) {
    return false;
  }
  if (!r.scale_dtype) {
    return !scales.defined();
  }
  return scales.defined() && scales.scalar_type() == *r.scale_dtype && scales.layout() == at::kStrided &&
         !scales.is_nested() && scales.has_storage() && !scales.is_conj() && !scales.is_neg() &&
         scales.device() == r.device && sizes_are(scales, {r.tokens, r.num_scales}) &&
         scales.strides().equals(at::IntArrayRef({r.scale_token_stride, r.scale_hidden_stride}));
}

// The transfer's fields of the sent tokens (0 for none: the kernels' contract for an empty tensor).
void store_sent(const NormalDispatchRecord& r, const at::Tensor& payload, const at::Tensor& scales,
                const at::Tensor& idx, const at::Tensor& weights, const at::Tensor& send_head) {
  const bool any = r.tokens > 0;
  put_normal(r.params, kNX, any ? address(payload) : 0);
  put_normal(r.params, kNSendHead, any ? address(send_head) : 0);
  put_normal(r.params, kNXScales, any && scales.defined() ? address(scales) : 0);
  put_normal(r.params, kNTopkIdx, any && r.topk ? address(idx) : 0);
  put_normal(r.params, kNTopkWeights, any && r.topk ? address(weights) : 0);
}

// The small received tensors' parts of one allocation, in _normal._received_layout's order, and its bytes (last).
enum ReceivedPart : int { kSrcIdxAt, kTopkIdxAt, kTopkWeightsAt, kScalesAt, kReceivedBytes };

// The received tensors of ``rows`` rows (recv_x, scales or None, recv_src_idx, top-k ids and weights or None),
// their addresses and the row count stored into the transfer's parameters; None when an allocation fails.
py::object receive(const NormalDispatchRecord& r, int64_t rows) {
  // recv_src_idx alone (no top-k, no scales) is an allocation of its own: a part of one would add work, save none
  const bool alone = !r.topk && !r.scale_dtype;
  std::array<int64_t, kReceivedBytes + 1> at{};
  if (!alone) {  // _normal._received_layout
    const auto size = [rows](int64_t columns, std::optional<at::ScalarType> dtype) {
      return dtype ? rows * columns * static_cast<int64_t>(c10::elementSize(*dtype)) : int64_t{0};
    };
    const auto idx_dtype = r.topk ? r.idx_dtype : std::nullopt;
    const auto weight_dtype = r.topk ? std::optional<at::ScalarType>(r.weight_dtype) : std::nullopt;
    at = vector_aligned_starts<kReceivedBytes>({size(1, r.index_dtype), size(r.topk, idx_dtype),
                                                size(r.topk, weight_dtype), size(r.num_scales, r.scale_dtype)});
  }
  at::Tensor recv_x, block, scales, src_idx, idx, weights;
  try {
    recv_x = at::empty({rows, r.hidden}, on(r.device, r.x_dtype));
    if (alone) {
      src_idx = at::empty({rows}, on(r.device, r.index_dtype));
    } else {
      block = at::empty({at[kReceivedBytes]}, on(r.device, at::kByte));
    }
  } catch (const c10::Error&) {  // out of memory and the like: the Python path allocates again and raises torch's
    return py::none();
  }
  if (!alone) {
    if (!plain_block(block)) {
      return py::none();
    }
    src_idx = part_of(block, r.index_dtype, at[kSrcIdxAt], {rows});
  }
  if (r.topk) {
    idx = part_of(block, *r.idx_dtype, at[kTopkIdxAt], {rows, r.topk});
    weights = part_of(block, r.weight_dtype, at[kTopkWeightsAt], {rows, r.topk});
  }
  if (r.scale_dtype) {
    scales = part_of(block, *r.scale_dtype, at[kScalesAt], {rows, r.num_scales});
  }
  const bool any = rows > 0;
  put_normal(r.params, kNRecvRows, static_cast<uint64_t>(rows));
  put_normal(r.params, kNRecvX, any ? address(recv_x) : 0);
  put_normal(r.params, kNRecvSrcIdx, any ? address(src_idx) : 0);
  put_normal(r.params, kNRecvScales, any && scales.defined() ? address(scales) : 0);
  put_normal(r.params, kNRecvTopkIdx, any && r.topk ? address(idx) : 0);
  put_normal(r.params, kNRecvTopkWeights, any && r.topk ? address(weights) : 0);
  return py::make_tuple(wrap(std::move(recv_x)), scales.defined() ? wrap(std::move(scales)) : py::none(),
                        wrap(std::move(src_idx)), idx.defined() ? wrap(std::move(idx)) : py::none(),
                        weights.defined() ? wrap(std::move(weights)) : py::none());
}

// An uncached dispatch's host work before notify's launch: None, or (launch, record, host, tag, local, payload,
// scales or None, topk_idx or None, topk_weights or None, is_token_in_rank, rank_prefix, channel_prefix, send_head,
// recv_channel_prefix), every address that does not depend on the received count stored into both parameter sets.
// ``records``: the uncached records of the call's config and flags, keyed by NormalDispatchRecord::key; a topk_idx
// of another dtype than the record's (int64) goes to the Python path, which refuses it.
py::object normal_dispatch(const py::handle& records, const py::handle& x_obj, const py::handle& per_rank_obj,
                           const py::handle& in_rank_obj, const py::handle& per_expert_obj,
                           const py::handle& idx_obj, const py::handle& weights_obj) {
  at::Tensor payload, scales;
  py::handle payload_obj, scales_obj;
  if (!g_normal.set() || !x_parts(x_obj, payload, scales, payload_obj, scales_obj)) {
    return py::none();
  }
  const at::Tensor per_rank = plain_tensor(per_rank_obj);
  const at::Tensor in_rank = plain_tensor(in_rank_obj);
  const at::Tensor per_expert = plain_tensor(per_expert_obj);
  const bool with_topk = !idx_obj.is_none();
  const at::Tensor idx = with_topk ? plain_tensor(idx_obj) : at::Tensor();
  const at::Tensor weights = with_topk ? plain_tensor(weights_obj) : at::Tensor();
  if (!per_rank.defined() || !in_rank.defined() || !per_expert.defined() || per_expert.dim() != 1 ||
      with_topk != !weights_obj.is_none() ||
      (with_topk && (!idx.defined() || !weights.defined() || idx.dim() != 2 || idx.size(1) < 1))) {
    return py::none();
  }
  const auto scale_dtype = scales.defined() ? std::optional<at::ScalarType>(scales.scalar_type()) : std::nullopt;
  const py::tuple key = py::make_tuple(
      payload.size(0), payload.size(1), static_cast<int64_t>(payload.scalar_type()), dtype_code(scale_dtype),
      scales.defined() ? scales.size(1) : 0, scales.defined() ? scales.stride(0) : 0,
      scales.defined() ? scales.stride(1) : 0, with_topk ? idx.size(1) : 0, per_expert.size(0));
  const py::object found = lookup(records, key);
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const NormalDispatchRecord&>();
  constexpr Reads kEach = Reads::kElements;
  if (r.cached || !x_matches(r, payload, scales) || !dense(per_rank, r.count_dtype, 1, r.device, kEach) ||
      !sizes_are(per_rank, {r.ranks}) || !dense(in_rank, r.mask_dtype, 2, r.device, kEach) ||
      !sizes_are(in_rank, {r.tokens, r.ranks}) || !dense(per_expert, r.count_dtype, 1, r.device, kEach) ||
      !sizes_are(per_expert, {r.experts}) ||
      (r.topk && (!dense(idx, *r.idx_dtype, 2, r.device, kEach) || !sizes_are(idx, {r.tokens, r.topk}) ||
                  !dense(weights, r.weight_dtype, 2, r.device, kEach) || !sizes_are(weights, {r.tokens, r.topk})))) {
    return py::none();
  }
  at::Tensor block;
  try {
    block = at::empty({r.handle_at[kHandleBytes]}, on(r.device, at::kByte));
  } catch (const c10::Error&) {
    return py::none();
  }
  if (!plain_block(block)) {
    return py::none();
  }
  const auto handle_part = [&](int part, int64_t rows, int64_t columns) {
    return part_of(block, r.index_dtype, r.handle_at[part], {rows, columns});
  };
  const at::Tensor rank_prefix = handle_part(kRankPrefixAt, r.ranks, r.ranks);
  const at::Tensor channel_prefix = handle_part(kChannelPrefixAt, r.ranks, r.channels);
  at::Tensor send_head = handle_part(kSendHeadAt, r.tokens, r.ranks);
  const at::Tensor recv_channel_prefix = handle_part(kRecvChannelPrefixAt, r.ranks, r.channels);
  put_normal(r.params, kNRankPrefix, address(rank_prefix));
  put_normal(r.params, kNChannelPrefix, address(channel_prefix));
  put_normal(r.params, kNRecvChannelPrefix, address(recv_channel_prefix));
  store_sent(r, payload, scales, idx, weights, send_head);
  const bool any = r.tokens > 0;
  put_normal(r.notify_params, kNHostCounts, r.host_counts);
  put_normal(r.notify_params, kNPerRank, address(per_rank));
  put_normal(r.notify_params, kNPerExpert, address(per_expert));
  put_normal(r.notify_params, kNInRank, any ? address(in_rank) : 0);
  put_normal(r.notify_params, kNSendHead, any ? address(send_head) : 0);
  put_normal(r.notify_params, kNRankPrefix, address(rank_prefix));
  put_normal(r.notify_params, kNChannelPrefix, address(channel_prefix));
  return py::make_tuple(r.launch, found, r.host, r.tag, r.local, payload_obj, scales_obj, idx_obj, weights_obj,
                        in_rank_obj, wrap(rank_prefix), wrap(channel_prefix), wrap(std::move(send_head)),
                        wrap(recv_channel_prefix));
}

// An uncached dispatch's host work after the CPU wait: the received tensors of ``rows`` rows, as receive() makes
// them (None when an allocation fails: the Python path then allocates).
py::object normal_received(const NormalDispatchRecord& record, int64_t rows) {
  return receive(record, rows);
}

// The handle's six tensors as the Python path checks them for a call over ``channels`` channels and ``tokens``
// tokens; its received rows (handle[3]'s length) into ``rows``.
bool handle_matches(const py::handle& handle, const at::Device& device, int64_t ranks, int64_t channels,
                    int64_t tokens, at::ScalarType index_dtype, at::ScalarType mask_dtype, int64_t& rows) {
  at::Tensor m[6];
  for (int i = 0; i < 6; ++i) {
    m[i] = plain_tensor(item(handle, i));
    if (!m[i].defined()) {
      return false;
    }
  }
  if (!dense(m[3], index_dtype, 1, device)) {
    return false;
  }
  rows = m[3].size(0);
  return dense(m[0], index_dtype, 2, device) && sizes_are(m[0], {ranks, ranks}) &&
         dense(m[1], index_dtype, 2, device) && sizes_are(m[1], {ranks, channels}) &&
         dense(m[2], index_dtype, 2, device) && sizes_are(m[2], {ranks, channels}) &&
         dense(m[4], mask_dtype, 2, device, Reads::kElements) && sizes_are(m[4], {tokens, ranks}) &&
         dense(m[5], index_dtype, 2, device) && sizes_are(m[5], {tokens, ranks});
}

// A cached dispatch's host work: None, or (launch, payload, scales or None, recv_x, recv_scales or None,
// recv_src_idx), every address and the received rows stored. ``handle``: a NormalHandle (checked exactly in
// Python); ``most_sent``: its attribute. ``records``: the cached records of the call's config and flags.
py::object normal_cached_dispatch(const py::handle& records, const py::handle& x_obj, const py::handle& handle,
                                  const py::handle& most_sent) {
  at::Tensor payload, scales;
  py::handle payload_obj, scales_obj;
  if (!g_normal.set() || !PyTuple_Check(handle.ptr()) || PyTuple_GET_SIZE(handle.ptr()) != 6 ||
      !most_sent_ok(most_sent) || !x_parts(x_obj, payload, scales, payload_obj, scales_obj)) {
    return py::none();
  }
  const auto scale_dtype = scales.defined() ? std::optional<at::ScalarType>(scales.scalar_type()) : std::nullopt;
  const py::tuple key = py::make_tuple(
      payload.size(0), payload.size(1), static_cast<int64_t>(payload.scalar_type()), dtype_code(scale_dtype),
      scales.defined() ? scales.size(1) : 0, scales.defined() ? scales.stride(0) : 0,
      scales.defined() ? scales.stride(1) : 0);
  const py::object found = lookup(records, key);
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const NormalDispatchRecord&>();
  int64_t rows = 0;
  if (!r.cached || !handle_matches(handle, r.device, r.ranks, r.channels, r.tokens, r.index_dtype, r.mask_dtype,
                                   rows) ||
      !x_matches(r, payload, scales)) {
    return py::none();
  }
  py::object received = receive(r, rows);
  if (received.is_none()) {
    return received;
  }
  put_normal(r.params, kNRankPrefix, address(plain_tensor(item(handle, 0))));
  put_normal(r.params, kNChannelPrefix, address(plain_tensor(item(handle, 1))));
  put_normal(r.params, kNRecvChannelPrefix, 0);
  store_sent(r, payload, scales, at::Tensor(), at::Tensor(), plain_tensor(item(handle, 5)));
  const auto out = received.cast<py::tuple>();
  return py::make_tuple(r.launch, payload_obj, scales_obj, out[0], out[1], out[2]);
}

// One normal-mode combine call shape as the Python path checked it.
struct NormalCombineRecord {
  py::object launch;  // the shape's NormalLaunch
  uintptr_t params;   // its EpNormalParams
  at::Device device;
  int64_t ranks, channels, tokens, hidden, topk;
  at::ScalarType row_dtype, weight_dtype, index_dtype, mask_dtype;  // row: x, the biases and out

  // What normal_combine looks the record up by: the handle's tokens, x's hidden size, topk_weights' columns.
  py::tuple key() const { return py::make_tuple(tokens, hidden, topk); }
};

// A bias as the Python path takes it without a message: None, or a [tokens, hidden] tensor of the rows' dtype.
bool bias_matches(const py::handle& obj, const NormalCombineRecord& r, at::Tensor& bias) {
  if (obj.is_none()) {
    return true;
  }
  bias = plain_tensor(obj);
  return bias.defined() && dense(bias, r.row_dtype, 2, r.device) && sizes_are(bias, {r.tokens, r.hidden});
}

// combine's host work: None, or (launch, out, out_topk_weights or None), every address and the received rows
// stored. ``handle``: a NormalHandle (checked exactly in Python); ``most_sent``: its attribute; ``bias``: None, a
// tensor or an exact pair. ``records``: the combine records of the call's config, keyed by NormalCombineRecord::key.
py::object normal_combine(const py::handle& records, const py::handle& x_obj, const py::handle& handle,
                          const py::handle& most_sent, const py::handle& weights_obj, const py::handle& bias) {
  const at::Tensor x = plain_tensor(x_obj);
  if (!g_normal.set() || !x.defined() || x.dim() != 2 || !PyTuple_Check(handle.ptr()) ||
      PyTuple_GET_SIZE(handle.ptr()) != 6 || !most_sent_ok(most_sent)) {
    return py::none();
  }
  const at::Tensor send_head = plain_tensor(item(handle, 5));
  const bool with_topk = !weights_obj.is_none();
  const at::Tensor weights = with_topk ? plain_tensor(weights_obj) : at::Tensor();
  // top-k 0 is the key of a call without topk_weights: given ones need a column (the Python path says so)
  if (!send_head.defined() || send_head.dim() != 2 ||
      (with_topk && (!weights.defined() || weights.dim() != 2 || weights.size(1) < 1))) {
    return py::none();
  }
  const py::tuple key = py::make_tuple(send_head.size(0), x.size(1), with_topk ? weights.size(1) : 0);
  const py::object found = lookup(records, key);
  if (!found) {
    return py::none();
  }
  const auto& r = found.cast<const NormalCombineRecord&>();
  int64_t rows = 0;
  if (!handle_matches(handle, r.device, r.ranks, r.channels, r.tokens, r.index_dtype, r.mask_dtype, rows) ||
      !dense(x, r.row_dtype, 2, r.device) || !sizes_are(x, {rows, r.hidden}) ||
      (r.topk && (!dense(weights, r.weight_dtype, 2, r.device, Reads::kElements) ||
                  !sizes_are(weights, {rows, r.topk})))) {
    return py::none();
  }
  at::Tensor bias_0, bias_1;
  if (PyTuple_CheckExact(bias.ptr())) {
    if (PyTuple_GET_SIZE(bias.ptr()) != 2 || !bias_matches(item(bias, 0), r, bias_0) ||
        !bias_matches(item(bias, 1), r, bias_1)) {
      return py::none();
    }
  } else if (!bias_matches(bias, r, bias_0)) {
    return py::none();
  }
  at::Tensor out, out_weights;
  try {
    out = at::empty({r.tokens, r.hidden}, on(r.device, r.row_dtype));
    if (r.topk) {
      out_weights = at::empty({r.tokens, r.topk}, on(r.device, r.weight_dtype));
    }
  } catch (const c10::Error&) {
    return py::none();
  }
  const bool any = r.tokens > 0;
  put_normal(r.params, kNRecvRows, static_cast<uint64_t>(rows));
  put_normal(r.params, kNRankPrefix, address(plain_tensor(item(handle, 0))));
  put_normal(r.params, kNChannelPrefix, address(plain_tensor(item(handle, 1))));
  put_normal(r.params, kNX, rows ? address(x) : 0);
  put_normal(r.params, kNTopkWeights, r.topk && rows ? address(weights) : 0);
  put_normal(r.params, kNSendHead, any ? address(send_head) : 0);
  put_normal(r.params, kNOut, any ? address(out) : 0);
  put_normal(r.params, kNOutTopkWeights, any && r.topk ? address(out_weights) : 0);
  put_normal(r.params, kNBias0, any && bias_0.defined() ? address(bias_0) : 0);
  put_normal(r.params, kNBias1, any && bias_1.defined() ? address(bias_1) : 0);
  return py::make_tuple(r.launch, wrap(std::move(out)), out_weights.defined() ? wrap(std::move(out_weights))
                                                                              : py::none());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const py::module_ torch = py::module_::import("torch");
  g_tensor_type = reinterpret_cast<PyTypeObject*>(torch.attr("Tensor").ptr());
  g_parameter_type = reinterpret_cast<PyTypeObject*>(torch.attr("nn").attr("Parameter").ptr());
  m.doc() = "The compiled host path of the deep_ep facade's calls (gc_moe_compat/deep_ep/_compiled_host.py)";
  py::dict structs;
  for (const Layout* layout : {&g_ll, &g_normal}) {
    py::dict fields;
    for (size_t f = 0; f < layout->fields.size(); ++f) {
      fields[py::str(layout->fields[f])] = layout->widths[f];
    }
    structs[py::str(layout->name)] = fields;
  }
  m.attr("PARAM_FIELDS") = structs;
  m.def("set_param_offsets", &set_param_offsets, py::arg("struct"), py::arg("offsets"), py::arg("struct_size"),
        "Sets the byte offsets of the fields PARAM_FIELDS[struct] names (once, from the ctypes fields).");
  py::class_<DispatchRecord>(m, "DispatchRecord")
      .def(py::init([](py::object launches, uintptr_t params, at::Device device, int64_t num_tokens, int64_t hidden,
                       int64_t topk, int64_t local, int64_t slots, int64_t ranks, int64_t groups, int64_t layout_at,
                       int64_t count_at, int64_t info_at, int64_t route_at, int64_t routing_at, int64_t private_size,
                       at::ScalarType x_dtype, at::ScalarType idx_dtype, at::ScalarType stats_dtype,
                       at::ScalarType recv_dtype, std::optional<at::ScalarType> scale_dtype,
                       at::ScalarType private_dtype) {
             return DispatchRecord{std::move(launches), params, device, num_tokens, hidden, topk, local, slots,
                                   ranks, groups, layout_at, count_at, info_at, route_at, routing_at, private_size,
                                   x_dtype, idx_dtype, stats_dtype, recv_dtype, private_dtype, scale_dtype};
           }),
           py::kw_only(), py::arg("launches"), py::arg("params"), py::arg("device"), py::arg("num_tokens"),
           py::arg("hidden"), py::arg("topk"), py::arg("local"), py::arg("slots"), py::arg("ranks"),
           py::arg("groups"), py::arg("layout_at"), py::arg("count_at"), py::arg("info_at"), py::arg("route_at"),
           py::arg("routing_at"), py::arg("private_size"), py::arg("x_dtype"), py::arg("idx_dtype"),
           py::arg("stats_dtype"), py::arg("recv_dtype"), py::arg("scale_dtype"), py::arg("private_dtype"))
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
  m.def("combine", &combine, py::arg("record"), py::arg("src_info"), py::arg("layout_range"), py::arg("src_route"),
        py::arg("routing"), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("out"),
        py::arg("call_gen"),
        "low_latency_combine's checks, allocations and pointer stores for a recorded call shape, or None.");
  py::class_<NormalDispatchRecord>(m, "NormalDispatchRecord")
      .def(py::init([](py::object launch, py::object host, py::object tag, uintptr_t notify_params, uintptr_t params,
                       uintptr_t host_counts, at::Device device, bool cached, int64_t ranks, int64_t channels,
                       int64_t tokens, int64_t hidden, int64_t experts, int64_t topk, int64_t num_scales,
                       int64_t scale_token_stride, int64_t scale_hidden_stride, at::ScalarType x_dtype,
                       std::optional<at::ScalarType> scale_dtype, std::optional<at::ScalarType> idx_dtype,
                       at::ScalarType count_dtype, at::ScalarType mask_dtype, at::ScalarType index_dtype,
                       at::ScalarType weight_dtype, std::vector<int64_t> handle_at) {
             if (ranks < 1 || experts % ranks || (topk > 0) != idx_dtype.has_value() ||
                 (num_scales > 0) != scale_dtype.has_value() ||
                 handle_at.size() != (cached ? 0 : static_cast<size_t>(kHandleBytes + 1))) {
               throw py::value_error("NormalDispatchRecord: inconsistent sizes and dtypes");
             }
             return NormalDispatchRecord{std::move(launch), std::move(host), std::move(tag), notify_params, params,
                                         host_counts, device, cached, ranks, channels, tokens, hidden, experts,
                                         experts / ranks, topk, num_scales, scale_token_stride, scale_hidden_stride,
                                         x_dtype, count_dtype, mask_dtype, index_dtype, weight_dtype, scale_dtype,
                                         idx_dtype, std::move(handle_at)};
           }),
           py::kw_only(), py::arg("launch"), py::arg("host"), py::arg("tag"), py::arg("notify_params"),
           py::arg("params"), py::arg("host_counts"), py::arg("device"), py::arg("cached"), py::arg("ranks"),
           py::arg("channels"), py::arg("tokens"), py::arg("hidden"), py::arg("experts"), py::arg("topk"),
           py::arg("num_scales"), py::arg("scale_token_stride"), py::arg("scale_hidden_stride"), py::arg("x_dtype"),
           py::arg("scale_dtype"), py::arg("idx_dtype"), py::arg("count_dtype"), py::arg("mask_dtype"),
           py::arg("index_dtype"), py::arg("weight_dtype"), py::arg("handle_at"))
      .def_readonly("launch", &NormalDispatchRecord::launch)
      .def_property_readonly("key", &NormalDispatchRecord::key);
  py::class_<NormalCombineRecord>(m, "NormalCombineRecord")
      .def(py::init([](py::object launch, uintptr_t params, at::Device device, int64_t ranks, int64_t channels,
                       int64_t tokens, int64_t hidden, int64_t topk, at::ScalarType row_dtype,
                       at::ScalarType weight_dtype, at::ScalarType index_dtype, at::ScalarType mask_dtype) {
             return NormalCombineRecord{std::move(launch), params, device, ranks, channels, tokens, hidden, topk,
                                        row_dtype, weight_dtype, index_dtype, mask_dtype};
           }),
           py::kw_only(), py::arg("launch"), py::arg("params"), py::arg("device"), py::arg("ranks"),
           py::arg("channels"), py::arg("tokens"), py::arg("hidden"), py::arg("topk"), py::arg("row_dtype"),
           py::arg("weight_dtype"), py::arg("index_dtype"), py::arg("mask_dtype"))
      .def_readonly("launch", &NormalCombineRecord::launch)
      .def_property_readonly("key", &NormalCombineRecord::key);
  m.def("normal_dispatch", &normal_dispatch, py::arg("records"), py::arg("x"), py::arg("num_tokens_per_rank"),
        py::arg("is_token_in_rank"), py::arg("num_tokens_per_expert"), py::arg("topk_idx"), py::arg("topk_weights"),
        "An uncached normal dispatch's checks, allocations and stores before notify's launch, or None.");
  m.def("normal_received", &normal_received, py::arg("record"), py::arg("rows"),
        "An uncached normal dispatch's received tensors after the CPU wait (their addresses stored), or None.");
  m.def("normal_cached_dispatch", &normal_cached_dispatch, py::arg("records"), py::arg("x"), py::arg("handle"),
        py::arg("most_sent"), "A cached normal dispatch's checks, allocations and stores, or None.");
  m.def("normal_combine", &normal_combine, py::arg("records"), py::arg("x"), py::arg("handle"), py::arg("most_sent"),
        py::arg("topk_weights"), py::arg("bias"), "A normal combine's checks, allocations and stores, or None.");
}
