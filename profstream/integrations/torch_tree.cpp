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
//
// The walk and the arithmetic touch no Python object and run with the GIL released, so
// that another thread of the process (a data loader's pinning thread) runs meanwhile
// rather than after. Whether an annotation is read through is Python's answer
// (`through(name)`), asked once per name and kept for the next steps; only a name not
// seen before takes the GIL back in the middle of the walk.
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/collection.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
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

// `through`'s answers, per name, for the `through` they came from (kept alive here).
struct ThroughCache {
  std::mutex mu;
  py::object owner;
  std::unordered_map<std::string, bool> answers;
};

ThroughCache& through_cache() {
  static auto* cache = new ThroughCache();  // never destroyed: it holds a Python object
  return *cache;
}

// (names, start_ns, dur_ns, tid, in_order, one_thread, data) of the outermost ops, in walk
// order: start_ns with `offset_ns` added, start_ns, dur_ns and tid as native int64 bytes;
// `names` is `previous` itself when it holds the same names; in_order: start_ns never
// decreases; one_thread: one tid throughout; data: u8 bytes, 1 where an op ends by
// `data_until_ns`, or None when none does (or data_until_ns is None). None when a node is
// not a torch op (the caller reads the trace another way).
py::object outermost_ops(const torch::autograd::profiler::ProfilerResult& result, const py::function& through,
                         int64_t offset_ns, const py::object& data_until_ns, const py::list& previous) {
  ThroughCache& cache = through_cache();
  {
    std::lock_guard<std::mutex> g(cache.mu);
    if (!cache.owner.is(through)) {
      cache.owner = through;
      cache.answers.clear();
    }
  }
  const bool has_until = !data_until_ns.is_none();
  const int64_t until = has_until ? data_until_ns.cast<int64_t>() : 0;
  std::vector<const std::string*> names;
  std::string start, dur, tid, mask;
  bool torch_ops_only = true, in_order = true, one_thread = true, any_data = false;
  {
    py::gil_scoped_release nogil;
    const auto& roots = result.event_tree();
    std::vector<const Result*> stack;
    for (auto it = roots.rbegin(); it != roots.rend(); ++it) stack.push_back(it->get());
    while (!stack.empty()) {
      const Result* node = stack.back();
      stack.pop_back();
      const auto* op = std::get_if<TorchOp>(&node->extra_fields_);
      if (op == nullptr) {
        torch_ops_only = false;
        break;
      }
      const int64_t d = op->end_time_ns_ - node->start_time_ns_;
      bool read_through = d < 0;
      if (!read_through && op->scope_ == at::RecordScope::USER_SCOPE) {
        std::unique_lock<std::mutex> l(cache.mu);
        auto found = cache.answers.find(op->name_);
        if (found != cache.answers.end()) {
          read_through = found->second;
        } else {
          l.unlock();
          {
            py::gil_scoped_acquire gil;  // a name not seen before: Python says
            read_through = through(py::str(op->name_)).cast<bool>();
          }
          l.lock();
          if (cache.answers.size() >= 4096) cache.answers.clear();  // names that change every step
          cache.answers.emplace(op->name_, read_through);
        }
      }
      if (read_through) {
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
    for (size_t i = 1; i < n; ++i) {
      in_order = in_order && starts[i] >= starts[i - 1];
      one_thread = one_thread && tids[i] == tids[0];
    }
    if (has_until) {
      mask.assign(n, '\0');
      for (size_t i = 0; i < n; ++i) {
        if (starts[i] + durs[i] <= until) mask[i] = any_data = true;
      }
    }
  }
  if (!torch_ops_only) return py::none();
  const size_t n = names.size();
  py::object data = any_data ? py::object(py::bytes(mask)) : py::object(py::none());
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
