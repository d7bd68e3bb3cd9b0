// Recorder.add_rows: many rows of a section from the caller's columns, converted a chunk
// at a time (numeric columns one column at a time, names through the store's cache by
// str object) and written column by column. What a column of a call can be: Source.
#include <cstring>

#include "recorder.h"

namespace ps {

namespace {

// add_rows converts the numeric columns of this many rows at a time (recorder.h: scratch).
constexpr Py_ssize_t CHUNK_ROWS = 256;

// An exact int's value; false when it does not fit 64 bits. On CPython 3.11 ints of up to
// three 30-bit digits under 2^63 (timestamps in ns are three) are read without a call.
inline bool exact_int(PyObject* v, int64_t* out) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
  Py_ssize_t size = Py_SIZE(v);
  const digit* d = reinterpret_cast<PyLongObject*>(v)->ob_digit;
  Py_ssize_t digits = size < 0 ? -size : size;
  if (digits <= 3 && (digits < 3 || d[2] < 8)) {
    int64_t m = digits == 0 ? 0 : static_cast<int64_t>(d[0]);
    if (digits >= 2) m |= static_cast<int64_t>(d[1]) << 30;
    if (digits == 3) m |= static_cast<int64_t>(d[2]) << 60;
    *out = size < 0 ? -m : m;
    return true;
  }
#endif
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v, &overflow);  // an exact int: no error but overflow
  return !overflow;
}

// -- a column's values in one add_rows call ---------------------------------------------

struct Source {
  enum Kind { NONE, SCALAR, ITEMS, BUFFER } kind = NONE;
  PyObject* scalar = nullptr;   // borrowed
  PyObject* fast = nullptr;     // owned list/tuple for ITEMS
  PyObject** items = nullptr;
  Py_ssize_t len = 0;
  Py_buffer view{};
  bool has_view = false;
  char fmt = 0;
  uint64_t code_epoch = 0;  // a scalar's dictionary code, for the block of that epoch
  int32_t code = -1;

  ~Source() {
    Py_XDECREF(fast);
    if (has_view) PyBuffer_Release(&view);
  }

  // SCALAR for None/str/int/float, BUFFER for a numeric 1-d buffer, else ITEMS.
  bool open(PyObject* v, bool numeric) {
    if (v == Py_None || PyUnicode_Check(v) || PyLong_Check(v) || PyFloat_Check(v)) {
      kind = SCALAR;
      scalar = v;
      return true;
    }
    if (numeric && PyObject_CheckBuffer(v) && PyObject_GetBuffer(v, &view, PyBUF_FORMAT | PyBUF_STRIDES) == 0) {
      has_view = true;
      const char* f = view.format ? view.format : "B";
      if (*f == '<' || *f == '@' || *f == '=') ++f;
      if (view.ndim == 1 && f[0] && !f[1] && std::strchr("bBhHiIlLqQ?fd", f[0])) {
        kind = BUFFER;
        fmt = f[0];
        len = view.shape[0];
        return true;
      }
      PyBuffer_Release(&view);
      has_view = false;
    }
    PyErr_Clear();
    fast = PySequence_Fast(v, "a column must be a sequence or a scalar");
    if (fast == nullptr) {  // not a sequence: treated as a scalar (then found invalid)
      PyErr_Clear();
      kind = SCALAR;
      scalar = v;
      return true;
    }
    kind = ITEMS;
    items = PySequence_Fast_ITEMS(fast);
    len = PySequence_Fast_GET_SIZE(fast);
    return true;
  }

  // The value of row i as an object (new reference), for dictionary columns and messages.
  PyObject* object(Py_ssize_t i) const {
    if (kind == SCALAR) {
      Py_INCREF(scalar);
      return scalar;
    }
    if (kind == ITEMS) {
      if (i >= len) return nullptr;
      Py_INCREF(items[i]);
      return items[i];
    }
    if (kind == BUFFER) {
      if (i >= len) return nullptr;
      double d;
      int64_t x;
      if (fmt == 'f' || fmt == 'd') {
        read_double(i, &d);
        return PyFloat_FromDouble(d);
      }
      read_int(i, &x);
      return PyLong_FromLongLong(x);
    }
    return nullptr;
  }

  // The value of row i as a borrowed object: SCALAR and ITEMS only (nullptr otherwise).
  PyObject* borrowed(Py_ssize_t i) const {
    if (kind == SCALAR) return scalar;
    if (kind == ITEMS && i < len) return items[i];
    return nullptr;
  }

  // The values of rows [from, to) of numeric column c into out[0, to - from) (a double's
  // bits for F64); a row without a valid value is marked in bad, one that gave a name
  // the column does not know (an unknown op kind) in unknown.
  void convert(const ColumnSpec& c, Py_ssize_t from, Py_ssize_t to, int64_t* out, uint8_t* bad,
               uint8_t* unknown) const {
    Py_ssize_t n = to - from;
    if (kind == NONE || kind == SCALAR) {
      int64_t x = c.fill_int;
      double d = c.fill_float;
      bool unk = false;
      bool ok = kind == NONE ? c.has_fill : c.type == F64 ? to_double(scalar, &d) : to_column_int(c, scalar, &x, &unk);
      if (c.type == F64) std::memcpy(&x, &d, 8);
      for (Py_ssize_t k = 0; k < n; ++k) {
        out[k] = x;
        bad[k] |= !ok;
        unknown[k] |= unk;
      }
      return;
    }
    if (kind == BUFFER && c.type != F64 && integer_buffer(c, from, n, out, bad)) return;
    for (Py_ssize_t k = 0; k < n; ++k) {
      Py_ssize_t i = from + k;
      if (kind == ITEMS && i + 8 < len) __builtin_prefetch(items[i + 8]);  // the objects, not just their pointers
      int64_t x = 0;
      double d = 0;
      bool unk = false, ok;
      if (kind == ITEMS && i < len && c.type != F64 && PyLong_CheckExact(items[i])) {
        ok = exact_int(items[i], &x) &&
             (c.type == I64 || (c.type == I32 ? x >= INT32_MIN && x <= INT32_MAX : x >= 0 && x <= 255));
      } else {
        ok = number(c, i, &x, &d, &unk);
      }
      if (c.type == F64) std::memcpy(&x, &d, 8);
      out[k] = x;
      bad[k] |= !ok;
      unknown[k] |= unk;
    }
  }

  // An integer buffer into an integer column: one tight loop per element type, no
  // per-value dispatch (op capture's int64 times, uint8 kinds, int64 streams). False for
  // a format it does not take (floats, unsigned 64-bit), which the generic loop reads.
  bool integer_buffer(const ColumnSpec& c, Py_ssize_t from, Py_ssize_t n, int64_t* out, uint8_t* bad) const {
    switch (fmt) {
      case 'b': return ints<int8_t>(c, from, n, out, bad);
      case 'B': case '?': return ints<uint8_t>(c, from, n, out, bad);
      case 'h': return ints<int16_t>(c, from, n, out, bad);
      case 'H': return ints<uint16_t>(c, from, n, out, bad);
      case 'i': return ints<int32_t>(c, from, n, out, bad);
      case 'I': return ints<uint32_t>(c, from, n, out, bad);
      case 'l': case 'q': return view.itemsize == 4 ? ints<int32_t>(c, from, n, out, bad)
                                                    : ints<int64_t>(c, from, n, out, bad);
      default: return false;
    }
  }

  template <typename T>
  bool ints(const ColumnSpec& c, Py_ssize_t from, Py_ssize_t n, int64_t* out, uint8_t* bad) const {
    if (view.itemsize != static_cast<Py_ssize_t>(sizeof(T))) return false;
    const char* p = static_cast<const char*>(view.buf);
    Py_ssize_t stride = view.strides[0];
    int64_t lo = c.type == U8 ? 0 : c.type == I32 ? INT32_MIN : INT64_MIN;
    int64_t hi = c.type == U8 ? 255 : c.type == I32 ? INT32_MAX : INT64_MAX;
    Py_ssize_t avail = len - from < n ? (len - from > 0 ? len - from : 0) : n;
    for (Py_ssize_t k = 0; k < avail; ++k) {
      T x;
      std::memcpy(&x, p + (from + k) * stride, sizeof(T));
      int64_t v = static_cast<int64_t>(x);
      out[k] = v;
      bad[k] |= v < lo || v > hi;
    }
    for (Py_ssize_t k = avail; k < n; ++k) bad[k] = 1;
    return true;
  }

  bool read_int(Py_ssize_t i, int64_t* out) const {
    const char* p = static_cast<const char*>(view.buf) + i * view.strides[0];
    switch (fmt) {
      case 'b': *out = *reinterpret_cast<const int8_t*>(p); return true;
      case 'B': case '?': *out = *reinterpret_cast<const uint8_t*>(p); return true;
      case 'h': { int16_t x; std::memcpy(&x, p, 2); *out = x; return true; }
      case 'H': { uint16_t x; std::memcpy(&x, p, 2); *out = x; return true; }
      case 'i': { int32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
      case 'I': { uint32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
      case 'l': case 'q': {
        if (view.itemsize == 4) { int32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
        std::memcpy(out, p, 8);
        return true;
      }
      case 'L': case 'Q': {
        if (view.itemsize == 4) { uint32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
        uint64_t x;
        std::memcpy(&x, p, 8);
        if (x > static_cast<uint64_t>(INT64_MAX)) return false;
        *out = static_cast<int64_t>(x);
        return true;
      }
      default: {
        double d;
        read_double(i, &d);
        if (!(d < 9.2233720368547758e18 && d >= -9.2233720368547758e18)) return false;
        *out = static_cast<int64_t>(d);
        return true;
      }
    }
  }

  void read_double(Py_ssize_t i, double* out) const {
    const char* p = static_cast<const char*>(view.buf) + i * view.strides[0];
    if (fmt == 'd') std::memcpy(out, p, 8);
    else if (fmt == 'f') { float x; std::memcpy(&x, p, 4); *out = x; }
    else { int64_t x = 0; read_int(i, &x); *out = static_cast<double>(x); }
  }

  // A numeric column's value of row i; false when invalid or missing.
  bool number(const ColumnSpec& c, Py_ssize_t i, int64_t* x, double* d, bool* unknown) const {
    if (kind == BUFFER) {
      if (i >= len) return false;
      if (c.type == F64) {
        read_double(i, d);
        return true;
      }
      if (!read_int(i, x)) return false;
      if (c.type == U8) return *x >= 0 && *x <= 255;
      if (c.type == I32) return *x >= INT32_MIN && *x <= INT32_MAX;
      return true;
    }
    PyObject* v = kind == SCALAR ? scalar : (kind == ITEMS && i < len ? items[i] : nullptr);
    if (v == nullptr) return false;
    if (c.type == F64) return to_double(v, d);
    return to_column_int(c, v, x, unknown);
  }
};

}  // namespace

// add_rows(section, n, columns, fallback=None): n rows of a section from {column: values}
// (a sequence, a numeric buffer or one scalar for all rows). Columns not given take their
// fill value; a None in a dictionary column takes the value of fallback[column] at that row.
// What does not fit is dropped and counted; rows with invalid values are counted as bad.
//
// Column by column where it can: the numeric columns of CHUNK_ROWS rows are converted one
// column at a time (a tight loop each), then each row takes its dictionary codes (through
// the store's identity cache: one compare for a str object seen before) and is written;
// the rows of a block are published at once.
PyObject* add_rows(Recording* r, int section, Py_ssize_t n, PyObject* columns, PyObject* fallback) {
  if (section < 0 || section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  Store& s = *r->stores[section];
  const SectionSpec& spec = s.spec;
  bool is_ops = section == r->ops;
  std::atomic<int64_t>& dropped = is_ops ? r->dropped_ops : r->dropped_samples;
  std::atomic<int64_t>& bad = is_ops ? r->bad_ops : r->bad_samples;
  PyObject** first_bad = is_ops ? &r->first_bad_op : &r->first_bad_sample;
  int64_t room = s.room();
  if (n > room) {
    if (room < 0) room = 0;
    bump(dropped, n - room);
    n = room;
  }
  if (n <= 0) Py_RETURN_NONE;
  size_t ncols = spec.cols.size();
  std::vector<Source> src(ncols);
  std::vector<int> fall(ncols, -1);
  for (size_t i = 0; i < ncols; ++i) {
    PyObject* v = PyDict_GetItemString(columns, spec.cols[i].name.c_str());
    if (v != nullptr) src[i].open(v, spec.cols[i].dict < 0);
    if (fallback != Py_None && PyDict_Check(fallback)) {
      PyObject* f = PyDict_GetItemString(fallback, spec.cols[i].name.c_str());
      if (f != nullptr && PyUnicode_Check(f)) fall[i] = column_index(spec, PyUnicode_AsUTF8(f));
    }
  }
  int dict_cols[MAX_COLUMNS], ndict = 0;
  for (size_t i = 0; i < ncols; ++i)
    if (spec.cols[i].dict >= 0) dict_cols[ndict++] = static_cast<int>(i);
  std::vector<int64_t>& values = r->scratch;  // [column][row of the chunk]; a double's bits for F64
  values.resize(ncols * CHUNK_ROWS);
  uint8_t bad_rows[CHUNK_ROWS], unknown_rows[CHUNK_ROWS];
  int32_t codes[MAX_COLUMNS];
  Block* b = nullptr;
  int64_t pos = 0;  // the next row of b
  // the chunk's valid rows that go to b from row pos - nkeep on, written column by column
  // (one tight loop per column) when the chunk ends or b is full, then published
  uint16_t keep[CHUNK_ROWS];
  int nkeep = 0;
  auto write_kept = [&]() {
    if (nkeep == 0) return;
    int64_t at = pos - nkeep;
    for (size_t i = 0; i < ncols; ++i) {
      const int64_t* v = &values[i * CHUNK_ROWS];
      char* col = b->cols[i];
      switch (spec.cols[i].width) {
        case 1:
          for (int t = 0; t < nkeep; ++t) col[at + t] = static_cast<char>(v[keep[t]]);
          break;
        case 4:
          for (int t = 0; t < nkeep; ++t) {
            int32_t x = static_cast<int32_t>(v[keep[t]]);
            std::memcpy(col + (at + t) * 4, &x, 4);
          }
          break;
        default:
          for (int t = 0; t < nkeep; ++t) std::memcpy(col + (at + t) * 8, &v[keep[t]], 8);
      }
    }
    s.publish_rows(b, pos, nkeep);
    nkeep = 0;
  };
  for (Py_ssize_t from = 0; from < n; from += CHUNK_ROWS) {
    Py_ssize_t to = n - from < CHUNK_ROWS ? n : from + CHUNK_ROWS;
    std::memset(bad_rows, 0, static_cast<size_t>(to - from));
    std::memset(unknown_rows, 0, static_cast<size_t>(to - from));
    for (size_t i = 0; i < ncols; ++i)
      if (spec.cols[i].dict < 0) src[i].convert(spec.cols[i], from, to, &values[i * CHUNK_ROWS], bad_rows, unknown_rows);
    for (Py_ssize_t row_i = from; row_i < to; ++row_i) {
      Py_ssize_t k = row_i - from;
      for (int j = 0; j < ndict; ++j)  // a later row's name and its cache entry: random in memory
        if (PyObject* ahead = src[dict_cols[j]].borrowed(row_i + 8)) {
          __builtin_prefetch(ahead);
          __builtin_prefetch(s.id_set(spec.cols[dict_cols[j]].dict, ahead));
        }
      bool ok = !bad_rows[k];
      if (ok && (b == nullptr || pos == b->capacity)) {
        if (b != nullptr) write_kept();
        b = s.slot(&pos);
        if (b == nullptr) {
          bump(dropped);
          continue;
        }
      }
      for (int j = 0; ok && j < ndict; ++j) {
        int i = dict_cols[j];
        const ColumnSpec& c = spec.cols[i];
        Source& col = src[i];
        if (col.kind == Source::SCALAR && col.scalar != Py_None && col.code_epoch == b->epoch) {
          codes[i] = col.code;
          continue;
        }
        PyObject* v = col.borrowed(row_i);
        PyObject* owned = nullptr;
        if ((v == nullptr || v == Py_None) && fall[i] >= 0) v = owned = src[fall[i]].object(row_i);
        if (v == nullptr || v == Py_None) {
          Py_XDECREF(owned);
          ok = false;
          break;
        }
        codes[i] = s.cached_code(b, c.dict, v);
        Py_XDECREF(owned);
        if (codes[i] < 0) {
          PyErr_Clear();
          ok = false;
        } else if (col.kind == Source::SCALAR) {
          col.code_epoch = b->epoch;
          col.code = codes[i];
        }
      }
      if (!ok) {
        bump(bad);
        if (*first_bad == nullptr) {
          PyObject* rowobj = PyTuple_New(static_cast<Py_ssize_t>(ncols));
          for (size_t i = 0; rowobj && i < ncols; ++i) {
            PyObject* v = src[i].object(row_i);
            PyTuple_SET_ITEM(rowobj, i, v ? v : (Py_INCREF(Py_None), Py_None));
          }
          note_first(first_bad, rowobj);
          Py_XDECREF(rowobj);
          PyErr_Clear();
        }
        continue;
      }
      if (unknown_rows[k] && is_ops) bump(r->unknown_kinds);
      for (int j = 0; j < ndict; ++j) values[dict_cols[j] * CHUNK_ROWS + k] = codes[dict_cols[j]];
      keep[nkeep++] = static_cast<uint16_t>(k);
      ++pos;
    }
    if (b != nullptr) write_kept();
  }
  if (is_ops && s.buffered() >= r->batch_max_ops) r->wake->set();
  Py_RETURN_NONE;
}

}  // namespace ps
