// Recorder and Wake: the Python types of the recording side (see recorder.h).
#include "recorder.h"

#include <cstring>

namespace ps {

namespace {

bool parse_type(const char* s, ColType* t) {
  if (!std::strcmp(s, "i4")) *t = I32;
  else if (!std::strcmp(s, "i8")) *t = I64;
  else if (!std::strcmp(s, "u1")) *t = U8;
  else if (!std::strcmp(s, "f8")) *t = F64;
  else return false;
  return true;
}

// layout: [(section, block_rows, max_rows, [(column, type, dict, fill, value_names, unknown_name)],
//           [(dict field, column index, blob)])]
bool parse_layout(PyObject* layout, Recording* rec) {
  PyObject* seq = PySequence_Fast(layout, "layout must be a sequence");
  if (seq == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name;
    long long block_rows, max_rows;
    PyObject *cols, *dicts;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sLLOO", &name, &block_rows, &max_rows, &cols, &dicts)) {
      ok = false;
      break;
    }
    SectionSpec spec;
    spec.name = name;
    spec.block_rows = block_rows > 0 ? block_rows : 1;
    spec.max_rows = max_rows;
    PyObject* cseq = PySequence_Fast(cols, "columns must be a sequence");
    if (cseq == nullptr) {
      ok = false;
      break;
    }
    for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(cseq); ++j) {
      const char *cname, *ctype;
      int dict;
      PyObject *fill, *names;
      long long unknown;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(cseq, j), "ssiOOL", &cname, &ctype, &dict, &fill, &names,
                            &unknown)) {
        ok = false;
        break;
      }
      ColumnSpec c;
      c.name = cname;
      if (!parse_type(ctype, &c.type)) {
        PyErr_Format(PyExc_ValueError, "column %s.%s: unknown type %s", name, cname, ctype);
        ok = false;
        break;
      }
      c.width = width_of(c.type);
      c.dict = dict;
      if (fill != Py_None) {
        c.has_fill = true;
        if (c.type == F64) ok = to_double(fill, &c.fill_float);
        else ok = to_int64(fill, &c.fill_int);
        if (!ok) PyErr_Format(PyExc_ValueError, "column %s.%s: bad fill value", name, cname);
      }
      if (names != Py_None) {
        if (!PyDict_Check(names)) {
          PyErr_SetString(PyExc_TypeError, "value names must be a dict");
          ok = false;
          break;
        }
        Py_INCREF(names);
        c.value_names = names;  // kept for the life of the process's recorders (tiny)
      }
      c.unknown_name = unknown;
      spec.cols.push_back(c);
    }
    Py_DECREF(cseq);
    if (!ok) break;
    PyObject* dseq = PySequence_Fast(dicts, "dictionaries must be a sequence");
    if (dseq == nullptr) {
      ok = false;
      break;
    }
    for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(dseq); ++j) {
      const char* field;
      int column, blob;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(dseq, j), "sip", &field, &column, &blob)) {
        ok = false;
        break;
      }
      if (column < 0 || column >= static_cast<int>(spec.cols.size())) {
        PyErr_Format(PyExc_ValueError, "dictionary %s: no column %d", field, column);
        ok = false;
        break;
      }
      spec.dicts.push_back(DictSpec{field, column, blob != 0});
    }
    Py_DECREF(dseq);
    if (ok && spec.cols.size() > MAX_COLUMNS) {
      PyErr_Format(PyExc_ValueError, "section %s has %zu columns, more than the %zu a section may have", name,
                   spec.cols.size(), MAX_COLUMNS);
      ok = false;
    }
    for (const ColumnSpec& c : spec.cols) {
      if (ok && (c.dict >= static_cast<int>(spec.dicts.size()) || (c.dict >= 0 && c.type != I32))) {
        PyErr_Format(PyExc_ValueError, "column %s.%s: bad dictionary", name, c.name.c_str());
        ok = false;
      }
    }
    if (ok) rec->specs.push_back(spec);
  }
  Py_DECREF(seq);
  return ok;
}

void write_fill(Block* b, const ColumnSpec& c, int i, int64_t row) {
  if (c.type == F64) std::memcpy(b->cols[i] + row * 8, &c.fill_float, 8);
  else write_int(b->cols[i], c.width, row, c.fill_int);
}

}  // namespace

// -- Wake ---------------------------------------------------------------------------------

struct WakeObject {
  PyObject_HEAD
  std::shared_ptr<Wakeup>* shared;
  Wakeup* wake;
};

static void Wake_dealloc(WakeObject* self) {
  delete self->shared;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static PyObject* Wake_set(WakeObject* self, PyObject*) {
  self->wake->set();
  Py_RETURN_NONE;
}

static PyObject* Wake_clear(WakeObject* self, PyObject*) {
  self->wake->clear();
  Py_RETURN_NONE;
}

static PyObject* Wake_is_set(WakeObject* self, PyObject*) { return PyBool_FromLong(self->wake->is_set()); }

static PyObject* Wake_wait(WakeObject* self, PyObject* args) {
  PyObject* timeout = Py_None;
  if (!PyArg_ParseTuple(args, "|O", &timeout)) return nullptr;
  double seconds = timeout == Py_None ? 1e9 : PyFloat_AsDouble(timeout);
  if (seconds == -1.0 && PyErr_Occurred()) return nullptr;
  bool set;
  Py_BEGIN_ALLOW_THREADS set = self->wake->wait(seconds);
  Py_END_ALLOW_THREADS return PyBool_FromLong(set);
}

static PyMethodDef Wake_methods[] = {
    {"set", reinterpret_cast<PyCFunction>(Wake_set), METH_NOARGS, "Wake the sender."},
    {"clear", reinterpret_cast<PyCFunction>(Wake_clear), METH_NOARGS, nullptr},
    {"is_set", reinterpret_cast<PyCFunction>(Wake_is_set), METH_NOARGS, nullptr},
    {"wait", reinterpret_cast<PyCFunction>(Wake_wait), METH_VARARGS, "Wait until set or timeout (GIL released)."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject WakeType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -- Recorder -----------------------------------------------------------------------------

static int Recorder_init(RecorderObject* self, PyObject* args, PyObject* kwds) {
  static const char* kw[] = {"layout", "ops_section", "batch_max_ops", nullptr};
  PyObject* layout;
  const char* ops_name = "ops";
  long long batch_max_ops = 8192;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|sL", const_cast<char**>(kw), &layout, &ops_name, &batch_max_ops))
    return -1;
  if (self->rec != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Recorder is already initialized");
    return -1;
  }
  auto* rec = new Recording();
  rec->batch_max_ops = batch_max_ops;
  if (!parse_layout(layout, rec)) {
    delete rec;
    return -1;
  }
  for (size_t i = 0; i < rec->specs.size(); ++i)
    if (rec->specs[i].name == ops_name) rec->ops = static_cast<int>(i);
  if (rec->ops < 0) {
    PyErr_Format(PyExc_ValueError, "no section %s in the layout", ops_name);
    delete rec;
    return -1;
  }
  const SectionSpec& ops = rec->specs[rec->ops];
  rec->c_name = column_index(ops, "name_idx");
  rec->c_type = column_index(ops, "type_idx");
  rec->c_kind = column_index(ops, "kind");
  rec->c_stream = column_index(ops, "stream");
  rec->c_step = column_index(ops, "step");
  rec->c_start = column_index(ops, "start_ns");
  rec->c_dur = column_index(ops, "dur_ns");
  int roles[] = {rec->c_name, rec->c_type, rec->c_kind, rec->c_stream, rec->c_step, rec->c_start, rec->c_dur};
  for (int r : roles) {
    if (r < 0) {
      PyErr_SetString(PyExc_ValueError, "the ops section lacks a column op() sets");
      delete rec;
      return -1;
    }
  }
  if (ops.cols[rec->c_name].dict < 0 || ops.cols[rec->c_type].dict < 0) {
    PyErr_SetString(PyExc_ValueError, "op names and types must be dictionary columns");
    delete rec;
    return -1;
  }
  for (size_t i = 0; i < ops.cols.size(); ++i) {
    bool set_by_op = false;
    for (int r : roles) set_by_op = set_by_op || r == static_cast<int>(i);
    if (!set_by_op && !ops.cols[i].has_fill) {
      PyErr_Format(PyExc_ValueError, "ops column %s has no fill value for op()", ops.cols[i].name.c_str());
      delete rec;
      return -1;
    }
  }
  try {
    for (const SectionSpec& s : rec->specs) rec->stores.emplace_back(new Store(s));
  } catch (const std::bad_alloc&) {
    delete rec;
    PyErr_NoMemory();
    return -1;
  }
  auto* wake = PyObject_New(WakeObject, &WakeType);
  if (wake == nullptr) {
    delete rec;
    return -1;
  }
  wake->shared = new std::shared_ptr<Wakeup>(rec->wake);
  wake->wake = rec->wake.get();
  self->rec = rec;
  self->wake = reinterpret_cast<PyObject*>(wake);
  return 0;
}

static void Recorder_dealloc(RecorderObject* self) {
  Py_CLEAR(self->wake);
  delete self->rec;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static void bad_op(Recording* r, PyObject* const* a) {
  bump(r->bad_ops);
  if (r->first_bad_op == nullptr) {
    PyObject* row = PyTuple_New(7);
    if (row == nullptr) {
      PyErr_Clear();
      return;
    }
    int order[] = {0, 4, 3, 5, 6, 1, 2};  // (name, op_type, kind, stream, step, start_ns, dur_ns)
    for (int i = 0; i < 7; ++i) {
      PyObject* v = a[order[i]] ? a[order[i]] : Py_None;
      Py_INCREF(v);
      PyTuple_SET_ITEM(row, i, v);
    }
    r->first_bad_op = row;
  }
}

// op(name, start_ns, dur_ns, kind=0, op_type=None, stream=0, step=None): the hot path.
static PyObject* Recorder_op(RecorderObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* names[] = {"name", "start_ns", "dur_ns", "kind", "op_type", "stream", "step"};
  Recording* r = self->rec;
  if (!r->capturing) Py_RETURN_NONE;
  PyObject* a[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (nargs > 7) {
    PyErr_SetString(PyExc_TypeError, "op() takes at most 7 arguments");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) a[i] = args[i];
  if (kwnames != nullptr) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      int at = -1;
      for (int j = 0; j < 7 && at < 0; ++j)
        if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) at = j;
      if (at < 0 || a[at] != nullptr) {
        PyErr_Format(PyExc_TypeError, "op() got an unexpected or repeated keyword argument %R", key);
        return nullptr;
      }
      a[at] = args[nargs + k];
    }
  }
  if (a[0] == nullptr || a[1] == nullptr || a[2] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "op() needs name, start_ns and dur_ns");
    return nullptr;
  }
  Store& s = *r->stores[r->ops];
  if (s.full()) {
    bump(r->dropped_ops);
    Py_RETURN_NONE;
  }
  const SectionSpec& spec = s.spec;
  int64_t start, dur, kind = 0, stream = 0, step = r->step;
  bool unknown = false;
  bool ok = to_int64(a[1], &start) && to_int64(a[2], &dur) &&
            (a[3] == nullptr || to_column_int(spec.cols[r->c_kind], a[3], &kind, &unknown)) &&
            (a[5] == nullptr || to_column_int(spec.cols[r->c_stream], a[5], &stream, &unknown)) &&
            (a[6] == nullptr || a[6] == Py_None || to_int64(a[6], &step));
  if (!ok) {
    bad_op(r, a);
    Py_RETURN_NONE;
  }
  int64_t row;
  Block* b = s.slot(&row);
  if (b == nullptr) {
    bump(r->dropped_ops);
    Py_RETURN_NONE;
  }
  int32_t name = s.cached_code(b, spec.cols[r->c_name].dict, a[0]);
  int32_t type = name < 0 ? -1 : s.cached_code(b, spec.cols[r->c_type].dict, a[4] && a[4] != Py_None ? a[4] : a[0]);
  if (type < 0) {
    PyErr_Clear();
    bad_op(r, a);
    Py_RETURN_NONE;
  }
  if (unknown) bump(r->unknown_kinds);
  for (size_t i = 0; i < spec.cols.size(); ++i) {
    int c = static_cast<int>(i);
    char* col = b->cols[i];
    if (c == r->c_name) write_int(col, 4, row, name);
    else if (c == r->c_type) write_int(col, 4, row, type);
    else if (c == r->c_kind) write_int(col, 1, row, kind);
    else if (c == r->c_stream) write_int(col, 4, row, stream);
    else if (c == r->c_step) write_int(col, 8, row, step);
    else if (c == r->c_start) write_int(col, 8, row, start);
    else if (c == r->c_dur) write_int(col, 8, row, dur);
    else write_fill(b, spec.cols[i], c, row);
  }
  s.publish(b, row);
  if (s.buffered() == r->batch_max_ops) r->wake->set();
  Py_RETURN_NONE;
}

// add_rows(section, n, columns, fallback=None): columns.cpp.
static PyObject* Recorder_add_rows(RecorderObject* self, PyObject* args) {
  int section;
  Py_ssize_t n;
  PyObject* columns;
  PyObject* fallback = Py_None;
  if (!PyArg_ParseTuple(args, "inO!|O", &section, &n, &PyDict_Type, &columns, &fallback)) return nullptr;
  return add_rows(self->rec, section, n, columns, fallback);
}

// add_sample(section, row): one row of a sample section, values in column order.
static PyObject* Recorder_add_sample(RecorderObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyLong_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "add_sample(section: int, row: tuple)");
    return nullptr;
  }
  Recording* r = self->rec;
  long section = PyLong_AsLong(args[0]);
  if (section < 0 || section >= static_cast<long>(r->stores.size()) || section == r->ops) {
    PyErr_SetString(PyExc_IndexError, "no such sample section");
    return nullptr;
  }
  Store& s = *r->stores[section];
  if (s.full()) {
    bump(r->dropped_samples);
    Py_RETURN_NONE;
  }
  const SectionSpec& spec = s.spec;
  PyObject* row = args[1];
  Py_ssize_t given = PyTuple_GET_SIZE(row);
  size_t ncols = spec.cols.size();
  int64_t ints[MAX_COLUMNS];
  double floats[MAX_COLUMNS];
  bool ok = ncols <= MAX_COLUMNS;
  bool unknown = false;
  for (size_t i = 0; ok && i < ncols; ++i) {
    const ColumnSpec& c = spec.cols[i];
    if (static_cast<Py_ssize_t>(i) >= given) {
      ok = c.has_fill;
      ints[i] = c.fill_int;
      floats[i] = c.fill_float;
    } else if (c.dict < 0) {
      PyObject* v = PyTuple_GET_ITEM(row, i);
      ok = c.type == F64 ? to_double(v, &floats[i]) : to_column_int(c, v, &ints[i], &unknown);
    }
  }
  int64_t at = 0;
  Block* b = ok ? s.slot(&at) : nullptr;
  if (ok && b == nullptr) {
    bump(r->dropped_samples);
    Py_RETURN_NONE;
  }
  for (size_t i = 0; ok && i < ncols; ++i) {
    if (spec.cols[i].dict >= 0) {
      int32_t code = static_cast<Py_ssize_t>(i) < given ? s.code(b, spec.cols[i].dict, PyTuple_GET_ITEM(row, i)) : -1;
      if (code < 0) {
        PyErr_Clear();
        ok = false;
      }
      ints[i] = code;
    }
  }
  if (!ok) {
    bump(r->bad_samples);
    note_first(&r->first_bad_sample, row);
    Py_RETURN_NONE;
  }
  for (size_t i = 0; i < ncols; ++i) {
    const ColumnSpec& c = spec.cols[i];
    if (c.type == F64) std::memcpy(b->cols[i] + at * 8, &floats[i], 8);
    else write_int(b->cols[i], c.width, at, ints[i]);
  }
  s.publish(b, at);
  Py_RETURN_NONE;
}

// foreign_recorded(): one row of a section recorded in Python (any thread; GIL held).
static PyObject* Recorder_foreign_recorded(RecorderObject* self, PyObject*) {
  self->rec->foreign_recorded.fetch_add(1, std::memory_order_release);
  Py_RETURN_NONE;
}

// foreign_taken(recorded, dropped): the Python sender took every row recorded up to the
// count `recorded` (read before it took them), and the buffer has dropped `dropped` in all.
static PyObject* Recorder_foreign_taken(RecorderObject* self, PyObject* args) {
  long long recorded, dropped;
  if (!PyArg_ParseTuple(args, "LL", &recorded, &dropped)) return nullptr;
  self->rec->foreign_dropped.store(dropped, std::memory_order_relaxed);
  self->rec->foreign_taken.store(recorded, std::memory_order_release);
  Py_RETURN_NONE;
}

static PyObject* Recorder_set_state(RecorderObject* self, PyObject* args) {
  long long step;
  int capturing;
  if (!PyArg_ParseTuple(args, "Lp", &step, &capturing)) return nullptr;
  self->rec->step = step;
  self->rec->capturing = capturing != 0;
  Py_RETURN_NONE;
}

static PyObject* Recorder_buffered(RecorderObject* self, PyObject* args) {
  int section = -1;
  if (!PyArg_ParseTuple(args, "|i", &section)) return nullptr;
  Recording* r = self->rec;
  if (section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  return PyLong_FromLongLong(r->stores[section < 0 ? r->ops : section]->buffered());
}

// recorded_rows(section): rows the section has taken since the recorder began.
static PyObject* Recorder_recorded(RecorderObject* self, PyObject* args) {
  int section;
  if (!PyArg_ParseTuple(args, "i", &section)) return nullptr;
  Recording* r = self->rec;
  if (section < 0 || section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  return PyLong_FromLongLong(r->stores[section]->written());
}

static PyObject* Recorder_take_first_bad(RecorderObject* self, PyObject*) {
  Recording* r = self->rec;
  PyObject* out = Py_BuildValue("(OO)", r->first_bad_op ? r->first_bad_op : Py_None,
                                r->first_bad_sample ? r->first_bad_sample : Py_None);
  return out;
}

static PyMethodDef Recorder_methods[] = {
    {"op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Recorder_op)), METH_FASTCALL | METH_KEYWORDS,
     "op(name, start_ns, dur_ns, kind=0, op_type=None, stream=0, step=None)\n--\n\n"
     "Record one op (kernel, collective, copy...) that ran for dur_ns from start_ns: Monitor.op, compiled."},
    {"add_rows", reinterpret_cast<PyCFunction>(Recorder_add_rows), METH_VARARGS, nullptr},
    {"add_sample", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Recorder_add_sample)), METH_FASTCALL,
     nullptr},
    {"set_state", reinterpret_cast<PyCFunction>(Recorder_set_state), METH_VARARGS, nullptr},
    {"foreign_recorded", reinterpret_cast<PyCFunction>(Recorder_foreign_recorded), METH_NOARGS, nullptr},
    {"foreign_taken", reinterpret_cast<PyCFunction>(Recorder_foreign_taken), METH_VARARGS, nullptr},
    {"buffered_rows", reinterpret_cast<PyCFunction>(Recorder_buffered), METH_VARARGS, nullptr},
    {"recorded_rows", reinterpret_cast<PyCFunction>(Recorder_recorded), METH_VARARGS, nullptr},
    {"first_bad", reinterpret_cast<PyCFunction>(Recorder_take_first_bad), METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

#define COUNTER_GETTER(field)                                              \
  static PyObject* Recorder_get_##field(RecorderObject* self, void*) {    \
    return PyLong_FromLongLong(self->rec->field.load(std::memory_order_relaxed)); \
  }
COUNTER_GETTER(dropped_ops)
COUNTER_GETTER(dropped_samples)
COUNTER_GETTER(bad_ops)
COUNTER_GETTER(bad_samples)
COUNTER_GETTER(unknown_kinds)
COUNTER_GETTER(foreign_recorded)

static int Recorder_set_dropped_ops(RecorderObject* self, PyObject* v, void*) {
  int64_t x;
  if (v == nullptr || !to_int64(v, &x)) {
    PyErr_SetString(PyExc_TypeError, "dropped_ops must be an int");
    return -1;
  }
  self->rec->dropped_ops.store(x);
  return 0;
}

static PyObject* Recorder_get_watermark(RecorderObject* self, void*) {
  int64_t w = self->rec->watermark.load(std::memory_order_acquire);
  if (w == NO_WATERMARK) Py_RETURN_NONE;
  return PyLong_FromLongLong(w);
}

static int Recorder_set_watermark(RecorderObject* self, PyObject* v, void*) {
  int64_t x = NO_WATERMARK;
  if (v != nullptr && v != Py_None && !to_int64(v, &x)) {
    PyErr_SetString(PyExc_TypeError, "watermark must be an int or None");
    return -1;
  }
  self->rec->watermark.store(x, std::memory_order_release);
  return 0;
}

static PyObject* Recorder_get_wake(RecorderObject* self, void*) {
  Py_INCREF(self->wake);
  return self->wake;
}

static PyObject* Recorder_get_batch_max_ops(RecorderObject* self, void*) {
  return PyLong_FromLongLong(self->rec->batch_max_ops);
}

static PyObject* Recorder_get_capturing(RecorderObject* self, void*) { return PyBool_FromLong(self->rec->capturing); }

static PyGetSetDef Recorder_getset[] = {
    {"dropped_ops", reinterpret_cast<getter>(Recorder_get_dropped_ops), reinterpret_cast<setter>(Recorder_set_dropped_ops),
     nullptr, nullptr},
    {"dropped_samples", reinterpret_cast<getter>(Recorder_get_dropped_samples), nullptr, nullptr, nullptr},
    {"bad_ops", reinterpret_cast<getter>(Recorder_get_bad_ops), nullptr, nullptr, nullptr},
    {"bad_samples", reinterpret_cast<getter>(Recorder_get_bad_samples), nullptr, nullptr, nullptr},
    {"unknown_kinds", reinterpret_cast<getter>(Recorder_get_unknown_kinds), nullptr, nullptr, nullptr},
    {"foreign_recorded_count", reinterpret_cast<getter>(Recorder_get_foreign_recorded), nullptr, nullptr, nullptr},
    {"watermark", reinterpret_cast<getter>(Recorder_get_watermark), reinterpret_cast<setter>(Recorder_set_watermark),
     nullptr, nullptr},
    {"wake", reinterpret_cast<getter>(Recorder_get_wake), nullptr, nullptr, nullptr},
    {"batch_max_ops", reinterpret_cast<getter>(Recorder_get_batch_max_ops), nullptr, nullptr, nullptr},
    {"capturing", reinterpret_cast<getter>(Recorder_get_capturing), nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject RecorderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool init_recorder_types(PyObject* module) {
  WakeType.tp_name = "profstream.producers._native.Wake";
  WakeType.tp_basicsize = sizeof(WakeObject);
  WakeType.tp_flags = Py_TPFLAGS_DEFAULT;
  WakeType.tp_dealloc = reinterpret_cast<destructor>(Wake_dealloc);
  WakeType.tp_methods = Wake_methods;
  WakeType.tp_doc = "What wakes the Monitor's sender (threading.Event's set/clear/is_set/wait).";
  if (PyType_Ready(&WakeType) < 0) return false;

  RecorderType.tp_name = "profstream.producers._native.Recorder";
  RecorderType.tp_basicsize = sizeof(RecorderObject);
  RecorderType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  RecorderType.tp_new = PyType_GenericNew;
  RecorderType.tp_init = reinterpret_cast<initproc>(Recorder_init);
  RecorderType.tp_dealloc = reinterpret_cast<destructor>(Recorder_dealloc);
  RecorderType.tp_methods = Recorder_methods;
  RecorderType.tp_getset = Recorder_getset;
  RecorderType.tp_doc = "A Monitor's events in native columns, one store per EventBatch section.";
  if (PyType_Ready(&RecorderType) < 0) return false;
  Py_INCREF(&RecorderType);
  Py_INCREF(&WakeType);
  return PyModule_AddObject(module, "Recorder", reinterpret_cast<PyObject*>(&RecorderType)) == 0 &&
         PyModule_AddObject(module, "Wake", reinterpret_cast<PyObject*>(&WakeType)) == 0;
}

}  // namespace ps
