#include "store.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ps {

Store::Store(const SectionSpec& s) : spec(s) {
  for (const DictSpec& d : spec.dicts) blob_nul_check_ = blob_nul_check_ || d.blob;
  ids_.assign(spec.dicts.size(), std::vector<IdEntry>(ID_SLOTS));
  tail_ = head_ = allocate();
  tail_->epoch = next_epoch();
}

Store::~Store() {
  for (std::vector<IdEntry>& table : ids_)
    for (IdEntry& e : table) Py_XDECREF(e.obj);
  for (Block* b : all_) {
    for (char* c : b->cols) std::free(c);
    for (Dictionary& d : b->dicts) {
      Py_XDECREF(d.map);
      Py_XDECREF(d.keep);
      std::free(d.entries);
    }
    delete b;
  }
}

Block* Store::allocate() {
  Block* b = new Block();
  b->capacity = spec.block_rows;
  for (const ColumnSpec& c : spec.cols) {
    char* col = static_cast<char*>(std::malloc(static_cast<size_t>(b->capacity) * c.width));
    if (col == nullptr) throw std::bad_alloc();
    b->cols.push_back(col);
  }
  b->dicts.resize(spec.dicts.size());
  for (Dictionary& d : b->dicts) {
    d.map = PyDict_New();
    d.keep = PyList_New(0);
    d.entries = static_cast<StrRef*>(std::malloc(static_cast<size_t>(b->capacity) * sizeof(StrRef)));
    if (d.map == nullptr || d.keep == nullptr || d.entries == nullptr) throw std::bad_alloc();
  }
  std::lock_guard<std::mutex> g(free_mu_);
  all_.push_back(b);
  return b;
}

void Store::remember(IdEntry* set, Block* b, PyObject* value, int32_t code) {
  // The way that holds this object already (with an older block's code) is updated; else
  // the object goes into way 0, way 0's entry moves to way 1 and way 1's is let go.
  IdEntry* e = set[0].obj == value ? &set[0] : set[1].obj == value ? &set[1] : nullptr;
  PyObject* evicted = nullptr;
  if (e == nullptr) {
    evicted = set[1].obj;
    set[1] = set[0];
    Py_INCREF(value);
    set[0].obj = value;
    e = &set[0];
  }
  e->epoch = b->epoch;
  e->code = code;
  Py_XDECREF(evicted);  // an exact str: its deallocation runs no Python code
}

uint32_t Store::next_epoch() {
  if (++epochs_ == 0) {  // wrapped (after 2^32 blocks): no entry may match a new block's epoch
    for (std::vector<IdEntry>& table : ids_)
      for (IdEntry& e : table) {
        Py_CLEAR(e.obj);
        e.epoch = 0;
      }
    epochs_ = 1;
  }
  return epochs_;
}

void Store::reset(Block* b) {
  b->epoch = next_epoch();
  b->count.store(0, std::memory_order_relaxed);
  b->next.store(nullptr, std::memory_order_relaxed);
  for (Dictionary& d : b->dicts) {
    PyDict_Clear(d.map);
    if (PyList_GET_SIZE(d.keep)) PyList_SetSlice(d.keep, 0, PyList_GET_SIZE(d.keep), nullptr);
    d.size = 0;
  }
}

Block* Store::slot(int64_t* row) {
  Block* b = tail_;
  int64_t n = b->count.load(std::memory_order_relaxed);
  if (n < b->capacity) {
    *row = n;
    return b;
  }
  Block* fresh = nullptr;
  {
    std::lock_guard<std::mutex> g(free_mu_);
    if (!free_.empty()) {
      fresh = free_.back();
      free_.pop_back();
    }
  }
  try {
    if (fresh == nullptr) fresh = allocate();
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  reset(fresh);
  b->next.store(fresh, std::memory_order_release);
  tail_ = fresh;
  *row = 0;
  return fresh;
}

int32_t Store::code(Block* b, int d, PyObject* value) {
  Dictionary& dict = b->dicts[d];
  PyObject* key = value;
  PyObject* owned = nullptr;
  if (!PyUnicode_CheckExact(value)) {  // what schema.batch does with a non-str: str(value)
    owned = PyObject_Str(value);
    if (owned == nullptr) return -1;
    key = owned;
  }
  PyObject* found = PyDict_GetItemWithError(dict.map, key);
  if (found != nullptr) {
    Py_XDECREF(owned);
    return static_cast<int32_t>(PyLong_AsLong(found));
  }
  if (PyErr_Occurred()) {
    Py_XDECREF(owned);
    return -1;
  }
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(key, &size);
  PyObject* bytes = nullptr;
  if (utf8 == nullptr) {  // lone surrogates: as names_blob writes them
    PyErr_Clear();
    bytes = PyUnicode_AsEncodedString(key, "utf-8", "surrogatepass");
  } else if (spec.dicts[d].blob && std::memchr(utf8, 0, size) != nullptr) {
    // a NUL inside a name of the NUL-separated blob becomes U+FFFD (names_blob)
    PyObject* nul = PyUnicode_FromOrdinal(0);
    PyObject* rep = PyUnicode_FromOrdinal(0xFFFD);
    PyObject* replaced = nul && rep ? PyUnicode_Replace(key, nul, rep, -1) : nullptr;
    Py_XDECREF(nul);
    Py_XDECREF(rep);
    if (replaced != nullptr) {
      bytes = PyUnicode_AsEncodedString(replaced, "utf-8", "surrogatepass");
      Py_DECREF(replaced);
    }
  }
  if (utf8 == nullptr || bytes != nullptr) {
    if (bytes == nullptr || PyList_Append(dict.keep, bytes) < 0) {
      Py_XDECREF(bytes);
      Py_XDECREF(owned);
      return -1;
    }
    utf8 = PyBytes_AS_STRING(bytes);
    size = PyBytes_GET_SIZE(bytes);
    Py_DECREF(bytes);  // the keep list holds it
  }
  int32_t c = dict.size;
  PyObject* code_obj = PyLong_FromLong(c);
  if (code_obj == nullptr || PyDict_SetItem(dict.map, key, code_obj) < 0) {
    Py_XDECREF(code_obj);
    Py_XDECREF(owned);
    return -1;
  }
  Py_DECREF(code_obj);
  Py_XDECREF(owned);  // the dict holds the key, and so the bytes utf8 points into
  dict.entries[c] = StrRef{utf8, size};
  dict.size = c + 1;
  return c;
}

int64_t Store::collect(int64_t limit, std::vector<Segment>& out) const {
  int64_t n = 0;
  Block* b = head_;
  int64_t pos = read_pos_;
  while (b != nullptr && n < limit) {
    int64_t count = b->count.load(std::memory_order_acquire);
    int64_t take = count - pos < limit - n ? count - pos : limit - n;
    if (take > 0) {
      out.push_back(Segment{b, pos, pos + take});
      n += take;
    }
    if (pos + take < count || count < b->capacity) break;  // the limit, or the writer's block
    b = b->next.load(std::memory_order_acquire);
    pos = 0;
  }
  return n;
}

void Store::consume(int64_t n) {
  for (;;) {
    int64_t count = head_->count.load(std::memory_order_acquire);
    int64_t take = count - read_pos_ < n ? count - read_pos_ : n;
    read_pos_ += take;
    n -= take;
    if (take) consumed_.fetch_add(take, std::memory_order_release);
    if (read_pos_ < head_->capacity) break;
    Block* next = head_->next.load(std::memory_order_acquire);
    if (next == nullptr) break;  // the writer has not left it yet
    {
      std::lock_guard<std::mutex> g(free_mu_);
      free_.push_back(head_);
    }
    head_ = next;
    read_pos_ = 0;
    if (n == 0 && next->count.load(std::memory_order_acquire) < next->capacity) break;
  }
}

bool to_int64(PyObject* v, int64_t* out) {
  if (PyLong_Check(v)) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    *out = x;
    return true;
  }
  double d;
  if (PyFloat_Check(v)) {
    d = PyFloat_AS_DOUBLE(v);
  } else if (PyIndex_Check(v)) {  // numpy integers
    PyObject* i = PyNumber_Index(v);
    if (i == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool ok = to_int64(i, out);
    Py_DECREF(i);
    return ok;
  } else if (PyNumber_Check(v) && !PyUnicode_Check(v) && !PyBytes_Check(v)) {  // numpy floats
    d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  if (!std::isfinite(d) || d >= 9.2233720368547758e18 || d < -9.2233720368547758e18) return false;
  *out = static_cast<int64_t>(d);  // truncated toward zero, as numpy's cast
  return true;
}

bool to_column_int(const ColumnSpec& c, PyObject* v, int64_t* out, bool* unknown_name) {
  if (c.value_names != nullptr && PyUnicode_Check(v)) {
    PyObject* code = PyDict_GetItemWithError(c.value_names, v);
    if (code == nullptr) {
      if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      *unknown_name = true;
      *out = c.unknown_name;
      return true;
    }
    v = code;
  }
  if (!to_int64(v, out)) return false;
  if (c.type == U8) return *out >= 0 && *out <= 255;
  if (c.type == I32) return *out >= INT32_MIN && *out <= INT32_MAX;
  return true;
}

bool to_double(PyObject* v, double* out) {
  if (PyFloat_Check(v)) {
    *out = PyFloat_AS_DOUBLE(v);
    return true;
  }
  if (PyUnicode_Check(v) || PyBytes_Check(v) || !PyNumber_Check(v)) return false;
  double d = PyFloat_AsDouble(v);
  if (d == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = d;
  return true;
}

}  // namespace ps
