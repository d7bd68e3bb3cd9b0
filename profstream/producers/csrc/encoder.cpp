#include "encoder.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace ps {

void Buffer::reserve(size_t n) {
  if (n <= cap_) return;
  size_t cap = cap_ ? cap_ : 4096;
  while (cap < n) cap *= 2;
  char* p = static_cast<char*>(std::realloc(data_, cap));
  if (p == nullptr) throw std::bad_alloc();
  data_ = p;
  cap_ = cap;
}

void Buffer::put_long(int64_t v) {  // Avro long: zigzag varint
  char tmp[10];
  put(tmp, zigzag_varint(v, tmp));
}

char* Buffer::release(size_t* size) {
  char* out = data_;
  *size = size_;
  data_ = nullptr;
  size_ = cap_ = 0;
  return out;
}

namespace {

int field_id(const char* name) {
  static const char* names[N_FIELDS] = {"seq", "sent_ns", "dropped_ops", "dropped_samples", "complete_through_step",
                                        "buffer_fill_ratio", "send_latency_ns"};
  for (int i = 0; i < N_FIELDS; ++i)
    if (!std::strcmp(name, names[i])) return i;
  return -1;
}

int64_t field_value(const Header& h, int f) {
  switch (f) {
    case SEQ: return h.seq;
    case SENT_NS: return h.sent_ns;
    case DROPPED_OPS: return h.dropped_ops;
    case DROPPED_SAMPLES: return h.dropped_samples;
    case COMPLETE_THROUGH: return h.complete_through;
    default: return h.send_latency_ns;
  }
}

}  // namespace

bool Encoder::parse(PyObject* plan, const std::vector<SectionSpec>& specs) {
  specs_ = &specs;
  PyObject* seq = PySequence_Fast(plan, "the plan must be a sequence");
  if (seq == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(item, 0))) {
      PyErr_SetString(PyExc_ValueError, "a plan step is (kind, ...)");
      ok = false;
      break;
    }
    const char* kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(item, 0));
    Step step;
    if (!std::strcmp(kind, "raw")) {
      const char* data;
      Py_ssize_t n;
      ok = PyArg_ParseTuple(item, "sy#", &kind, &data, &n);
      step.kind = RAW;
      if (ok) step.raw.assign(data, n);
    } else if (!std::strcmp(kind, "long") || !std::strcmp(kind, "double") || !std::strcmp(kind, "optional_long")) {
      const char* field;
      long long null_branch = 0, value_branch = 1;
      ok = PyArg_ParseTuple(item, "ss|LL", &kind, &field, &null_branch, &value_branch);
      step.kind = !std::strcmp(kind, "long") ? LONG : !std::strcmp(kind, "double") ? DOUBLE : OPTIONAL_LONG;
      step.field = ok ? field_id(field) : -1;
      step.null_branch = null_branch;
      step.value_branch = value_branch;
      if (ok && (step.field < 0 || (step.kind == DOUBLE) != (step.field == FILL_RATIO))) {
        PyErr_Format(PyExc_ValueError, "the native encoder cannot write header field %s as %s", field, kind);
        ok = false;
      }
    } else if (!std::strcmp(kind, "names_blob") || !std::strcmp(kind, "names_array")) {
      int s, d;
      ok = PyArg_ParseTuple(item, "sii", &kind, &s, &d);
      step.kind = !std::strcmp(kind, "names_blob") ? NAMES_BLOB : NAMES_ARRAY;
      step.section = s;
      step.dict = d;
      if (ok && (s < 0 || s >= static_cast<int>(specs.size()) || d < 0 ||
                 d >= static_cast<int>(specs[s].dicts.size()))) {
        PyErr_SetString(PyExc_ValueError, "a plan step names no dictionary");
        ok = false;
      }
    } else if (!std::strcmp(kind, "section")) {
      int s, n = -1;
      ok = PyArg_ParseTuple(item, "si|i", &kind, &s, &n);
      step.kind = SECTION;
      step.section = s;
      step.columns = n;
      if (ok && (s < 0 || s >= static_cast<int>(specs.size()))) {
        PyErr_SetString(PyExc_ValueError, "a plan step names no section");
        ok = false;
      } else if (ok && (n == 0 || n > static_cast<int>(specs[s].cols.size()))) {
        PyErr_SetString(PyExc_ValueError, "a plan step writes more columns than its section has");
        ok = false;
      }
    } else {
      PyErr_Format(PyExc_ValueError, "unknown plan step %s", kind);
      ok = false;
    }
    if (ok) steps_.push_back(step);
  }
  Py_DECREF(seq);
  dicts_.resize(specs.size());
  for (size_t s = 0; s < specs.size(); ++s) dicts_[s].resize(specs[s].dicts.size());
  return ok;
}

void Encoder::dictionaries(const std::vector<Take>& takes) {
  for (size_t s = 0; s < specs_->size(); ++s) {
    const SectionSpec& spec = (*specs_)[s];
    bool one_block = takes[s].segments.size() <= 1;  // a block's dictionary has each name once
    for (size_t d = 0; d < spec.dicts.size(); ++d) {
      BatchDict& out = dicts_[s][d];
      out.codes.clear();
      out.names.clear();
      seen_.clear();
      int col = spec.dicts[d].column;
      for (const Segment& seg : takes[s].segments) {
        // the block's codes of rows [0, to) are below `to`: they were given in row order
        remap_.assign(static_cast<size_t>(seg.to), -1);
        const Dictionary& dict = seg.block->dicts[d];
        const char* codes = seg.block->cols[col];
        for (int64_t r = seg.from; r < seg.to; ++r) {
          int32_t c;
          std::memcpy(&c, codes + r * 4, 4);
          int32_t& mapped = remap_[c];
          if (mapped < 0) {
            const StrRef& name = dict.entries[c];
            auto next = static_cast<int32_t>(out.names.size());
            if (one_block) {
              mapped = next;
            } else {  // the same name in another block of the batch keeps its first code
              mapped = seen_.emplace(std::string_view(name.data, static_cast<size_t>(name.size)), next).first->second;
            }
            if (mapped == next) out.names.push_back(name);
          }
          out.codes.push_back(mapped);
        }
      }
    }
  }
}

size_t Encoder::columns(int s) const {
  for (const Step& step : steps_)
    if (step.kind == SECTION && step.section == s && step.columns > 0) return static_cast<size_t>(step.columns);
  return (*specs_)[s].cols.size();
}

bool Encoder::writes(int s) const {
  for (const Step& step : steps_)
    if (step.kind == SECTION && step.section == s) return true;
  return false;
}

void Encoder::section(int s, size_t columns, const Take& take, Buffer& out) {
  const SectionSpec& spec = (*specs_)[s];
  out.put_long(take.count);
  for (size_t c = 0; c < columns; ++c) {
    const ColumnSpec& col = spec.cols[c];
    out.put_long(take.count * col.width);
    if (col.dict >= 0) {
      const std::vector<int32_t>& codes = dicts_[s][col.dict].codes;
      out.put(codes.data(), codes.size() * 4);
      continue;
    }
    for (const Segment& seg : take.segments)
      out.put(seg.block->cols[c] + seg.from * col.width, static_cast<size_t>(seg.to - seg.from) * col.width);
  }
}

void Encoder::encode(const Header& h, const std::vector<Take>& takes, Buffer& out) {
  dictionaries(takes);
  for (const Step& step : steps_) {
    switch (step.kind) {
      case RAW:
        out.put(step.raw.data(), step.raw.size());
        break;
      case LONG:
        out.put_long(field_value(h, step.field));
        break;
      case OPTIONAL_LONG: {
        int64_t v = field_value(h, step.field);
        if (v == INT64_MIN) {
          out.put_long(step.null_branch);
        } else {
          out.put_long(step.value_branch);
          out.put_long(v);
        }
        break;
      }
      case DOUBLE:
        out.put(&h.fill_ratio, 8);
        break;
      case NAMES_BLOB: {
        const std::vector<StrRef>& names = dicts_[step.section][step.dict].names;
        int64_t total = 0;
        for (const StrRef& n : names) total += n.size + 1;
        out.put_long(total);
        out.reserve(out.size() + static_cast<size_t>(total));
        for (const StrRef& n : names) {
          out.put(n.data, static_cast<size_t>(n.size));
          out.put("", 1);
        }
        break;
      }
      case NAMES_ARRAY: {
        const std::vector<StrRef>& names = dicts_[step.section][step.dict].names;
        if (!names.empty()) {
          out.put_long(static_cast<int64_t>(names.size()));
          for (const StrRef& n : names) {
            out.put_long(n.size);
            out.put(n.data, static_cast<size_t>(n.size));
          }
        }
        out.put_long(0);
        break;
      }
      case SECTION:
        section(step.section, step.columns > 0 ? static_cast<size_t>(step.columns) : (*specs_)[step.section].cols.size(),
                takes[step.section], out);
        break;
    }
  }
}

}  // namespace ps
