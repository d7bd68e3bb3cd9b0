// The outermost ops of a CPU-only torch.profiler capture, read off its event tree in C++.
//
// Same walk as profstream.producers.torch_ops.tree_op_columns (see there): from the roots,
// read through annotations (record_function scopes, but those `through(name)` rejects:
// collectives) and through ops that never ended; every other node is an outermost op and
// its subtree is not read. Built against the installed torch's headers by
// profstream.producers.torch_native; one Python call a step instead of ~5 per node.
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/collection.h>

#include <cstdint>
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

// (names, start_ns, dur_ns, tid) of the outermost ops, the numbers as native int64 bytes in
// walk order; None when a node is not a torch op (the caller reads the trace another way).
py::object outermost_ops(const torch::autograd::profiler::ProfilerResult& result, const py::function& through) {
  const auto& roots = result.event_tree();
  std::vector<const Result*> stack;
  for (auto it = roots.rbegin(); it != roots.rend(); ++it) stack.push_back(it->get());
  py::list names;
  std::string start, dur, tid;
  while (!stack.empty()) {
    const Result* node = stack.back();
    stack.pop_back();
    const auto* op = std::get_if<TorchOp>(&node->extra_fields_);
    if (op == nullptr) return py::none();
    py::str name(op->name_);
    const int64_t d = op->end_time_ns_ - node->start_time_ns_;
    if (d < 0 || (op->scope_ == at::RecordScope::USER_SCOPE && through(name).cast<bool>())) {
      for (auto it = node->children_.rbegin(); it != node->children_.rend(); ++it) stack.push_back(it->get());
      continue;
    }
    names.append(name);
    put(start, node->start_time_ns_);
    put(dur, d);
    put(tid, static_cast<int64_t>(node->start_tid_));
  }
  return py::make_tuple(names, py::bytes(start), py::bytes(dur), py::bytes(tid));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("outermost_ops", &outermost_ops, py::arg("result"), py::arg("through"));
}
