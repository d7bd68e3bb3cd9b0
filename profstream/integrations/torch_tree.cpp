// The outermost ops of a CPU-only torch.profiler capture, read off its event tree in C++.
//
// Same walk as profstream.integrations.torch_ops.tree_op_columns (see there): from the roots,
// read through annotations (record_function scopes, but those `through(name)` rejects:
// collectives) and through ops that never ended; every other node is an outermost op and
// its subtree is not read. Built against the installed torch's headers by
// profstream.integrations.torch_native.
//
// It runs on the training thread right after a training step, when the caches hold the
// step's tensors: there every numpy call costs 5-20 times its warm cost. So this one call
// does all the per-op work: the clock offset, the order and one-thread checks, the data
// mask, and the names, which are handed back as the very list of the step before when
// they are the same (the usual case: no new str objects, no list comparison in Python).
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/collection.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;
using torch::profiler::impl::EventType;
using torch::profiler::impl::Result;
using TorchOp = torch::profiler::impl::ExtraFields<EventType::TorchOp>;

namespace {

void put(std::string& column, int64_t value) {
  column.append(reinterpret_cast<const char*>(&value), sizeof value);
}

// Whether `names` (a list of str) holds exactly `found`, in order.
bool same_names(const py::list& names, const std::vector<const std::string*>& found) {
  if (static_cast<size_t>(PyList_GET_SIZE(names.ptr())) != found.size()) return false;
  for (size_t i = 0; i < found.size(); ++i) {
    PyObject* item = PyList_GET_ITEM(names.ptr(), i);
    if (!PyUnicode_Check(item)) return false;
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(item, &size);
    if (utf8 == nullptr) {
      PyErr_Clear();
      return false;
    }
    const std::string& name = *found[i];
    if (static_cast<size_t>(size) != name.size() || std::memcmp(utf8, name.data(), name.size()) != 0) return false;
  }
  return true;
}

// (names, start_ns, dur_ns, tid, in_order, one_thread, data) of the outermost ops, in walk
// order: start_ns with `offset_ns` added, start_ns, dur_ns and tid as native int64 bytes;
// `names` is `previous` itself when it holds the same names; in_order: start_ns never
// decreases; one_thread: one tid throughout; data: u8 bytes, 1 where an op ends by
// `data_until_ns`, or None when none does (or data_until_ns is None). None when a node is
// not a torch op (the caller reads the trace another way).
py::object outermost_ops(const torch::autograd::profiler::ProfilerResult& result, const py::function& through,
                         int64_t offset_ns, const py::object& data_until_ns, const py::list& previous) {
  const auto& roots = result.event_tree();
  std::vector<const Result*> stack;
  for (auto it = roots.rbegin(); it != roots.rend(); ++it) stack.push_back(it->get());
  std::vector<const std::string*> names;
  std::string start, dur, tid;
  while (!stack.empty()) {
    const Result* node = stack.back();
    stack.pop_back();
    const auto* op = std::get_if<TorchOp>(&node->extra_fields_);
    if (op == nullptr) return py::none();
    const int64_t d = op->end_time_ns_ - node->start_time_ns_;
    if (d < 0 || (op->scope_ == at::RecordScope::USER_SCOPE && through(py::str(op->name_)).cast<bool>())) {
      for (auto it = node->children_.rbegin(); it != node->children_.rend(); ++it) stack.push_back(it->get());
      continue;
    }
    names.push_back(&op->name_);
    put(start, node->start_time_ns_ + offset_ns);
    put(dur, d);
    put(tid, static_cast<int64_t>(node->start_tid_));
  }
  const size_t n = names.size();
  const auto* starts = reinterpret_cast<const int64_t*>(start.data());
  const auto* durs = reinterpret_cast<const int64_t*>(dur.data());
  const auto* tids = reinterpret_cast<const int64_t*>(tid.data());
  bool in_order = true, one_thread = true;
  for (size_t i = 1; i < n; ++i) {
    in_order = in_order && starts[i] >= starts[i - 1];
    one_thread = one_thread && tids[i] == tids[0];
  }
  py::object data = py::none();
  if (!data_until_ns.is_none()) {
    const int64_t until = data_until_ns.cast<int64_t>();
    std::string mask(n, '\0');
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      if (starts[i] + durs[i] <= until) mask[i] = any = true;
    }
    if (any) data = py::bytes(mask);
  }
  py::list out_names;
  if (same_names(previous, names)) {
    out_names = previous;
  } else {
    out_names = py::list(n);
    for (size_t i = 0; i < n; ++i) out_names[i] = py::str(*names[i]);
  }
  return py::make_tuple(out_names, py::bytes(start), py::bytes(dur), py::bytes(tid), in_order, one_thread, data);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("outermost_ops", &outermost_ops, py::arg("result"), py::arg("through"), py::arg("offset_ns"),
        py::arg("data_until_ns"), py::arg("previous"));
}
