// The processors' hottest figure arithmetic, compiled (processors/kernels.py loads it): at
// 50 ops a step each figure was a dozen numpy calls of ~0.5 us on arrays of a few values.
// Integer nanoseconds in, integers out, so the figures are the numpy path's to the bit.
// Columns come as buffers (numpy arrays, no numpy headers needed); a column of another
// type or layout gives None, and the caller runs its numpy path.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <string>
#include <vector>

#include "encoder.h"

namespace ps {

namespace {

// A 1-D contiguous buffer of one-letter items, held while the object lives.
struct Buffer1D {
  Py_buffer view{};
  bool held = false;

  ~Buffer1D() {
    if (held) PyBuffer_Release(&view);
  }
  // the item's struct letter (its byte order mark skipped), or 0 (no error set) where obj
  // is not such a buffer
  char letter(PyObject* obj) {
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      PyErr_Clear();
      return 0;
    }
    held = true;
    if (view.ndim != 1 || view.format == nullptr) return 0;
    const char* f = view.format;
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    return f[0] != '\0' && f[1] == '\0' ? f[0] : 0;
  }
  // whether obj is a bytes object of whole items of itemsize bytes: a column as the wire
  // has it (schema/wire_columns.py), little-endian as this machine (module.cpp checks)
  bool wire(PyObject* obj, Py_ssize_t itemsize) {
    if (!PyBytes_CheckExact(obj) || PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
      PyErr_Clear();
      return false;
    }
    held = true;
    return view.len % itemsize == 0;
  }
};

// A 1-D contiguous column of integers, read as int64 whatever its width.
struct Column : Buffer1D {
  int width = 0;  // item size in bytes: 1 (unsigned), 4 or 8 (signed)
  Py_ssize_t n = 0;

  // false (no error set) where obj is not such a column
  bool take(PyObject* obj) {
    const char f = letter(obj);
    if (f == 0) return false;
    if (view.itemsize == 8 && (f == 'l' || f == 'q')) width = 8;
    else if (view.itemsize == 4 && (f == 'i' || f == 'l')) width = 4;
    else if (view.itemsize == 1 && f == 'B') width = 1;
    else return false;
    n = view.len / view.itemsize;
    return true;
  }
  // a wire column of signed items of w bytes (4 or 8): false where obj is not one
  bool take_wire(PyObject* obj, int w) {
    if (!wire(obj, w)) return false;
    width = w;
    n = view.len / w;
    return true;
  }
  int64_t operator[](Py_ssize_t i) const {
    const char* p = static_cast<const char*>(view.buf) + i * width;
    if (width == 8) {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    if (width == 4) {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    return static_cast<uint8_t>(*p);
  }
};

using Intervals = std::vector<std::pair<int64_t, int64_t>>;

void clip_into(Intervals& out, int64_t start, int64_t end, int64_t lo, int64_t hi) {
  start = std::max(start, lo);
  end = std::min(end, hi);
  if (end > start) out.emplace_back(start, end);
}

// the union of out, sorted and disjoint, in place; its length
int64_t merge(Intervals& iv) {
  if (iv.empty()) return 0;
  std::sort(iv.begin(), iv.end());
  size_t w = 0;
  for (size_t i = 1; i < iv.size(); ++i) {
    if (iv[i].first > iv[w].second) iv[++w] = iv[i];
    else iv[w].second = std::max(iv[w].second, iv[i].second);
  }
  iv.resize(w + 1);
  int64_t total = 0;
  for (const auto& p : iv) total += p.second - p.first;
  return total;
}

int64_t intersection(const Intervals& a, const Intervals& b) {
  int64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    int64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    if (a[i].second < b[j].second) ++i;
    else ++j;
  }
  return total;
}

// The intervals of two op kinds, from args (kind, start, dur, ..., a, b, a_start, a_end,
// b_start, b_end: the kinds at args[kinds_at], the extra intervals in the last four):
// A holds the ops of kind a, [start, start + dur), and [a_start, a_end); B likewise with
// kind b; each interval as clip(out, start, end) adds it. 1: done, 0: a column it does not
// take (no error set), -1: an error.
template <typename Clip>
int two_kinds(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t kinds_at, Clip clip, Intervals& a, Intervals& b) {
  Column kind, start, dur, as, ae, bs, be;
  if (!kind.take(args[0]) || !start.take(args[1]) || !dur.take(args[2]) || !as.take(args[nargs - 4]) ||
      !ae.take(args[nargs - 3]) || !bs.take(args[nargs - 2]) || !be.take(args[nargs - 1]))
    return 0;
  if (start.width != 8 || dur.width != 8 || kind.n != start.n || dur.n != start.n || as.n != ae.n || bs.n != be.n)
    return 0;
  long ka = PyLong_AsLong(args[kinds_at]), kb = PyLong_AsLong(args[kinds_at + 1]);
  if (PyErr_Occurred()) return -1;
  for (Py_ssize_t i = 0; i < start.n; ++i) {
    int64_t k = kind[i];
    if (k == ka) clip(a, start[i], start[i] + dur[i]);
    else if (k == kb) clip(b, start[i], start[i] + dur[i]);
  }
  for (Py_ssize_t i = 0; i < as.n; ++i) clip(a, as[i], ae[i]);
  for (Py_ssize_t i = 0; i < bs.n; ++i) clip(b, bs[i], be[i]);
  return 1;
}

// kind_overlap(kind, start, dur, lo, hi, a, b, a_start, a_end, b_start, b_end)
//   -> (|A|, |B|, |A ∩ B|) or None, A and B (two_kinds) clipped to [lo, hi] (empty ones
// left out): utilization's compute and communication
PyObject* kind_overlap(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "kind_overlap takes 11 arguments");
    return nullptr;
  }
  int64_t lo = PyLong_AsLongLong(args[3]), hi = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  Intervals a, b;
  int got = two_kinds(args, nargs, 5, [&](Intervals& out, int64_t s, int64_t e) { clip_into(out, s, e, lo, hi); },
                      a, b);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  int64_t a_ns = merge(a), b_ns = merge(b);
  return Py_BuildValue("(LLL)", static_cast<long long>(a_ns), static_cast<long long>(b_ns),
                       static_cast<long long>(intersection(a, b)));
}

// sums_by_code(code, start, dur, lo, hi) -> [(code, summed dur, count)] by code, or None:
// the rows whose start lies in [lo, hi)
PyObject* sums_by_code(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "sums_by_code takes 5 arguments");
    return nullptr;
  }
  Column code, start, dur;
  if (!code.take(args[0]) || !start.take(args[1]) || !dur.take(args[2])) Py_RETURN_NONE;
  if (start.width != 8 || dur.width != 8 || code.n != start.n || dur.n != start.n) Py_RETURN_NONE;
  int64_t lo = PyLong_AsLongLong(args[3]), hi = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  std::map<int64_t, std::pair<int64_t, int64_t>> by_code;
  for (Py_ssize_t i = 0; i < start.n; ++i) {
    int64_t s = start[i];
    if (s < lo || s >= hi) continue;
    auto& slot = by_code[code[i]];
    slot.first += dur[i];
    slot.second += 1;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(by_code.size()));
  if (out == nullptr) return nullptr;
  Py_ssize_t i = 0;
  for (const auto& [c, sums] : by_code) {
    PyObject* row = Py_BuildValue("(LLL)", static_cast<long long>(c), static_cast<long long>(sums.first),
                                  static_cast<long long>(sums.second));
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i++, row);
  }
  return out;
}

PyObject* packed(const Intervals& iv, bool ends) {
  std::vector<int64_t> values;
  values.reserve(iv.size());
  for (const auto& p : iv) values.push_back(ends ? p.second : p.first);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()),
                                   static_cast<Py_ssize_t>(values.size() * sizeof(int64_t)));
}

// past_end(kind, start, dur, end, a, b, a_start, a_end, b_start, b_end)
//   -> (A starts, A ends, B starts, B ends) as int64 bytes, or None: the unions of the parts
// after ``end`` of A and B (two_kinds; window.carry_past_end: what a host step carries
// into the next)
PyObject* past_end(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "past_end takes 10 arguments");
    return nullptr;
  }
  int64_t end = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  Intervals a, b;
  int got = two_kinds(
      args, nargs, 4,
      [&](Intervals& out, int64_t s, int64_t e) {
        if (e > end) clip_into(out, s, e, end, INT64_MAX);
      },
      a, b);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  merge(a);
  merge(b);
  PyObject* parts[4] = {packed(a, false), packed(a, true), packed(b, false), packed(b, true)};
  PyObject* out = (parts[0] && parts[1] && parts[2] && parts[3]) ? PyTuple_Pack(4, parts[0], parts[1], parts[2], parts[3])
                                                                  : nullptr;
  for (PyObject* p : parts) Py_XDECREF(p);
  return out;
}

// queue_sizes(queue, ts, size, lo, hi) -> [(queue, min, sum, count, last, at_start, zeros)] by
// queue code, or None: queues.queue_figures' figures of each queue with samples in [lo, hi],
// samples taken by time, then as received; at_start: the size of the last sample at or
// before lo (None: none). None also where a sum might not be exact in a double (a size of
// 2**31 or more), so that sum / count is numpy's mean to the bit.
PyObject* queue_sizes(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "queue_sizes takes 5 arguments");
    return nullptr;
  }
  Column queue, ts, size;
  if (!queue.take(args[0]) || !ts.take(args[1]) || !size.take(args[2])) Py_RETURN_NONE;
  if (ts.width != 8 || size.width != 8 || queue.n != ts.n || size.n != ts.n || ts.n >= (1 << 20)) Py_RETURN_NONE;
  int64_t lo = PyLong_AsLongLong(args[3]), hi = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  std::vector<Py_ssize_t> order(static_cast<size_t>(ts.n));
  for (Py_ssize_t i = 0; i < ts.n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](Py_ssize_t a, Py_ssize_t b) { return ts[a] < ts[b]; });
  struct Figures {
    int64_t min = 0, sum = 0, count = 0, last = 0, at_start = 0, zeros = 0;
    bool started = false;
  };
  std::map<int64_t, Figures> by_queue;  // every queue seen, with or without samples inside
  for (Py_ssize_t i : order) {
    int64_t v = size[i], t = ts[i];
    if (v >= (int64_t{1} << 31) || v <= -(int64_t{1} << 31)) Py_RETURN_NONE;
    auto& f = by_queue[queue[i]];
    if (t <= lo) {
      f.at_start = v;
      f.started = true;
    }
    if (t < lo || t > hi) continue;
    f.min = f.count ? std::min(f.min, v) : v;
    f.sum += v;
    f.count += 1;
    f.last = v;
    f.zeros += v == 0;
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const auto& [code, f] : by_queue) {
    if (!f.count) continue;
    PyObject* at_start = f.started ? PyLong_FromLongLong(f.at_start) : Py_NewRef(Py_None);
    PyObject* row = at_start == nullptr ? nullptr
                                        : Py_BuildValue("(LLLLLNL)", static_cast<long long>(code),
                                                        static_cast<long long>(f.min), static_cast<long long>(f.sum),
                                                        static_cast<long long>(f.count), static_cast<long long>(f.last),
                                                        at_start, static_cast<long long>(f.zeros));
    if (row == nullptr || PyList_Append(out, row) < 0) {
      Py_XDECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(row);
  }
  return out;
}

// memory_at(ts, peak, allocated, reserved, lo, hi) -> (peak, allocated, reserved), False
// (no sample in [lo, hi]) or None (columns it does not take): memory.memory_figures
PyObject* memory_at(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "memory_at takes 6 arguments");
    return nullptr;
  }
  Column ts, peak, allocated, reserved;
  if (!ts.take(args[0]) || !peak.take(args[1]) || !allocated.take(args[2]) || !reserved.take(args[3])) Py_RETURN_NONE;
  if (ts.width != 8 || peak.width != 8 || allocated.width != 8 || reserved.width != 8 || peak.n != ts.n ||
      allocated.n != ts.n || reserved.n != ts.n)
    Py_RETURN_NONE;
  int64_t lo = PyLong_AsLongLong(args[4]), hi = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  Py_ssize_t last = -1;
  bool reported = false;
  int64_t max_reported = 0, max_allocated = 0;
  for (Py_ssize_t i = 0; i < ts.n; ++i) {
    int64_t t = ts[i];
    if (t < lo || t > hi) continue;
    int64_t p = peak[i], a = allocated[i];
    if (p >= 0) {
      max_reported = reported ? std::max(max_reported, p) : p;
      reported = true;
    }
    max_allocated = last < 0 ? a : std::max(max_allocated, a);
    if (last < 0 || t >= ts[last]) last = i;  // the greatest ts; of equal ones the last received
  }
  if (last < 0) Py_RETURN_FALSE;
  return Py_BuildValue("(LLL)", static_cast<long long>(reported ? max_reported : max_allocated),
                       static_cast<long long>(allocated[last]), static_cast<long long>(reserved[last]));
}

// uniform(column) -> its one value where every row holds it, else None (None for no rows
// too, and for a column of another type): the assembler's "a batch within one step"
PyObject* uniform(PyObject*, PyObject* arg) {
  Column col;
  if (!col.take(arg) || col.n == 0) Py_RETURN_NONE;
  int64_t first = col[0];
  for (Py_ssize_t i = 1; i < col.n; ++i)
    if (col[i] != first) Py_RETURN_NONE;
  return PyLong_FromLongLong(first);
}

// below(column, n) -> whether every value, read as unsigned, is below n (a dictionary index
// column against its dictionary's size: a negative index is a large unsigned one); None
// for a column of another type
PyObject* below(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "below takes 2 arguments");
    return nullptr;
  }
  Column col;
  if (!col.take(args[0])) Py_RETURN_NONE;
  long long n = PyLong_AsLongLong(args[1]);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  if (n <= 0) return PyBool_FromLong(col.n == 0);
  uint64_t limit = static_cast<uint64_t>(n);
  for (Py_ssize_t i = 0; i < col.n; ++i) {
    int64_t v = col[i];
    uint64_t u = col.width == 4 ? static_cast<uint32_t>(static_cast<int32_t>(v)) : static_cast<uint64_t>(v);
    if (u >= limit) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// any_launched(launch) -> whether a value is >= 0 (an op that carries its launch time:
// a device window), or None for a column of another type
PyObject* any_launched(PyObject*, PyObject* arg) {
  Column col;
  if (!col.take(arg) || col.width != 8) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < col.n; ++i)
    if (col[i] >= 0) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// rolling_sums(step_time, data_wait, count, ranks) -> (sum of step_time, sum of data_wait,
// [the values of step_time at each rank of its sorted order]) of the first count rows, or
// None (a column of another type, or values whose sums a double might not hold exactly)
PyObject* rolling_sums(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "rolling_sums takes 4 arguments");
    return nullptr;
  }
  Column step_time, data_wait;
  if (!step_time.take(args[0]) || !data_wait.take(args[1]) || step_time.width != 8 || data_wait.width != 8)
    Py_RETURN_NONE;
  Py_ssize_t count = PyLong_AsSsize_t(args[2]);
  if (count == -1 && PyErr_Occurred()) return nullptr;
  if (count < 1 || count > step_time.n || count > data_wait.n || count > 1024 || !PyTuple_Check(args[3]))
    Py_RETURN_NONE;
  const int64_t bound = int64_t{1} << 42;  // 1024 values below 2**42: every partial sum below 2**52
  std::vector<int64_t> sorted(static_cast<size_t>(count));
  int64_t step_sum = 0, wait_sum = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    int64_t t = step_time[i], w = data_wait[i];
    if (t >= bound || t <= -bound || w >= bound || w <= -bound) Py_RETURN_NONE;
    sorted[i] = t;
    step_sum += t;
    wait_sum += w;
  }
  std::sort(sorted.begin(), sorted.end());
  PyObject* ranks = args[3];
  PyObject* at = PyTuple_New(PyTuple_GET_SIZE(ranks));
  if (at == nullptr) return nullptr;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(ranks); ++k) {
    Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(ranks, k));
    if (r < 0 || r >= count) {
      Py_DECREF(at);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "rolling_sums: rank outside the window");
      return nullptr;
    }
    PyTuple_SET_ITEM(at, k, PyLong_FromLongLong(sorted[r]));
  }
  PyObject* out = Py_BuildValue("(LLN)", static_cast<long long>(step_sum), static_cast<long long>(wait_sum), at);
  return out;
}

// A 1-D contiguous column of doubles (float64).
struct Doubles : Buffer1D {
  Py_ssize_t n = 0;

  // false (no error set) where obj is not such a column
  bool take(PyObject* obj) {
    if (letter(obj) != 'd' || view.itemsize != 8) return false;
    n = view.len / 8;
    return true;
  }
  bool take_wire(PyObject* obj) {  // a wire column of doubles
    if (!wire(obj, 8)) return false;
    n = view.len / 8;
    return true;
  }
  double operator[](Py_ssize_t i) const {
    double v;
    std::memcpy(&v, static_cast<const char*>(view.buf) + i * 8, 8);
    return v;
  }
};

// Python's sum(values) / len(values) over the values that are not NaN, added left to right
// as sum() adds floats (from 0: 0 + -0.0 is 0.0); null without one
struct Mean {
  double sum = 0.0;
  Py_ssize_t n = 0;
  void add(double v) {
    if (v != v) return;
    sum += v;
    ++n;
  }
  PyObject* value() const { return n ? PyFloat_FromDouble(sum / static_cast<double>(n)) : Py_NewRef(Py_None); }
};

// Python's max(values) over the values that are not NaN (the first of equal ones); null without one
struct Max {
  double max = 0.0;
  bool any = false;
  void add(double v) {
    if (v != v) return;
    if (!any || v > max) max = v;
    any = true;
  }
  PyObject* value() const { return any ? PyFloat_FromDouble(max) : Py_NewRef(Py_None); }
};

PyObject* number_or_none(bool known, double v) { return known ? PyFloat_FromDouble(v) : Py_NewRef(Py_None); }

// The keys of host_figures' dicts (processors/host.py), interned once and kept: a lookup
// by the key's name (PyDict_SetItemString, then a std::map by the literal) cost more than
// the figures themselves.
enum Key {
  K_READINGS, K_CPU_USER, K_CPU_SYSTEM, K_CPU_IOWAIT, K_CPU_IDLE, K_PROCESS_CPU, K_RSS_BYTES, K_LOADER_READINGS,
  K_WORKERS, K_WORKER_CPU_MEAN, K_WORKER_CPU_MAX, K_WORKER_RUNNABLE_MEAN, K_WORKER_RUNNABLE_MAX, K_WORKER_BATCHES,
  K_WORKER_S_PER_BATCH, K_WORKER_CPU_S_PER_BATCH, K_PER_WORKER, K_CTX_SWITCHES_PER_S, K_CPU_COUNT,
  K_WORKER, K_BATCHES, K_S_PER_BATCH, K_CPU_S_PER_BATCH, K_KEYS
};
const char* const KEY_NAMES[K_KEYS] = {
    "readings", "cpu_user", "cpu_system", "cpu_iowait", "cpu_idle", "process_cpu", "rss_bytes", "loader_readings",
    "workers", "worker_cpu_mean", "worker_cpu_max", "worker_runnable_mean", "worker_runnable_max", "worker_batches",
    "worker_s_per_batch", "worker_cpu_s_per_batch", "per_worker", "ctx_switches_per_s", "cpu_count",
    "worker", "batches", "s_per_batch", "cpu_s_per_batch"};
PyObject* keys[K_KEYS];  // under the GIL; null until the first host_figures

bool intern_keys() {
  if (keys[K_KEYS - 1] != nullptr) return true;
  for (int k = 0; k < K_KEYS; ++k) {
    if (keys[k] == nullptr && (keys[k] = PyUnicode_InternFromString(KEY_NAMES[k])) == nullptr) return false;
  }
  return true;
}

// Sets d[key] = value and drops the reference to value; false on an error (value null too).
bool put(PyObject* d, Key key, PyObject* value) {
  if (value == nullptr) return false;
  int rc = PyDict_SetItem(d, keys[key], value);
  Py_DECREF(value);
  return rc == 0;
}

// host_figures(h_cpu_user, h_cpu_system, h_cpu_iowait, h_cpu_idle, h_process_cpu, h_rss,
//              worker, cpu, runnable, interval_s, batches, ctx_switches_per_s, cpu_count)
//   -> the StepMetrics resources dict of processors/host.py's host_figures, its floats
// summed in the same order (the same values to the bit), or None for a column it does not
// take; the caller has checked that the step has a reading. A 14th argument True: the
// columns are the wire's bytes in the schema's types (schema/batch.py HOST_COLUMNS,
// LOADER_COLUMNS: rss int64, worker, batches and cpu_count int32, the rest doubles).
PyObject* host_figures(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13 && nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "host_figures takes 13 arguments (and wire=True)");
    return nullptr;
  }
  const bool wire = nargs == 14 && args[13] == Py_True;
  auto doubles = [wire](Doubles& d, PyObject* obj) { return wire ? d.take_wire(obj) : d.take(obj); };
  auto ints = [wire](Column& c, PyObject* obj, int w) { return wire ? c.take_wire(obj, w) : c.take(obj); };
  Doubles user, system, iowait, idle, process, cpu, runnable, interval, ctx;
  Column rss, worker, batches, count;
  if (!doubles(user, args[0]) || !doubles(system, args[1]) || !doubles(iowait, args[2]) ||
      !doubles(idle, args[3]) || !doubles(process, args[4]) || !ints(rss, args[5], 8) ||
      !ints(worker, args[6], 4) || !doubles(cpu, args[7]) || !doubles(runnable, args[8]) ||
      !doubles(interval, args[9]) || !ints(batches, args[10], 4) || !doubles(ctx, args[11]) ||
      !ints(count, args[12], 4))
    Py_RETURN_NONE;
  const Py_ssize_t h = user.n, lo = worker.n;
  if (rss.width != 8 || worker.width != 4 || batches.width != 4 || count.width != 4 || system.n != h ||
      iowait.n != h || idle.n != h || process.n != h || rss.n != h || cpu.n != lo || runnable.n != lo ||
      interval.n != lo || batches.n != lo || ctx.n != lo || count.n != lo)
    Py_RETURN_NONE;
  Mean m_user, m_system, m_iowait, m_idle, m_process, m_cpu, m_runnable, m_ctx;
  Max x_cpu, x_runnable;
  int64_t rss_max = 0;
  bool rss_any = false;
  for (Py_ssize_t i = 0; i < h; ++i) {
    m_user.add(user[i]);
    m_system.add(system[i]);
    m_iowait.add(iowait[i]);
    m_idle.add(idle[i]);
    m_process.add(process[i]);
    int64_t r = rss[i];
    if (r > 0 && (!rss_any || r > rss_max)) rss_max = r;
    rss_any = rss_any || r > 0;
  }
  struct Worker {
    int64_t readings = 0, batches = -1;
    double seconds = 0.0, cpu_s = 0.0;
  };
  std::map<int64_t, Worker> each;
  int64_t count_max = -1, total = 0, counted = 0, loader_readings = 0;
  bool any_count = false;
  double busy_s = 0.0, cpu_sum = 0.0;
  bool any_cpu_s = false;
  for (Py_ssize_t i = 0; i < lo; ++i) {
    int64_t w = worker[i];
    if (w == -1) {  // the machine's row (schema/batch.py MACHINE)
      m_ctx.add(ctx[i]);
      int64_t c = count[i];
      count_max = any_count ? std::max(count_max, c) : c;
      any_count = true;
      continue;
    }
    Worker& own = each[w];
    own.readings += 1;
    double c = cpu[i];
    m_cpu.add(c);
    x_cpu.add(c);
    m_runnable.add(runnable[i]);
    x_runnable.add(runnable[i]);
    ++loader_readings;
    int64_t b = batches[i];
    if (b >= 0) {
      double iv = interval[i];
      counted += 1;
      total += b;
      busy_s += iv;
      own.batches = std::max<int64_t>(own.batches, 0) + b;
      own.seconds += iv;
      double s = c * iv;
      own.cpu_s += s;  // NaN once a reading's CPU time is unknown
      if (s == s) {
        cpu_sum += s;
        any_cpu_s = true;
      }
    }
  }
  const bool produced = counted && total > 0;
  if (!intern_keys()) return nullptr;
  PyObject* per_worker = PyList_New(static_cast<Py_ssize_t>(each.size()));
  if (per_worker == nullptr) return nullptr;
  Py_ssize_t at = 0;
  for (const auto& [w, own] : each) {
    PyObject* d = _PyDict_NewPresized(5);  // sized for its keys: no resize on the way
    bool made = own.batches > 0;
    if (d == nullptr || !put(d, K_WORKER, PyLong_FromLongLong(w)) ||
        !put(d, K_READINGS, PyLong_FromLongLong(own.readings)) ||
        !put(d, K_BATCHES, own.batches >= 0 ? PyLong_FromLongLong(own.batches) : Py_NewRef(Py_None)) ||
        !put(d, K_S_PER_BATCH, number_or_none(made, own.seconds / static_cast<double>(own.batches))) ||
        !put(d, K_CPU_S_PER_BATCH,
             number_or_none(made && own.cpu_s == own.cpu_s, own.cpu_s / static_cast<double>(own.batches)))) {
      Py_XDECREF(d);
      Py_DECREF(per_worker);
      return nullptr;
    }
    PyList_SET_ITEM(per_worker, at++, d);  // steals d
  }
  PyObject* out = _PyDict_NewPresized(K_PER_WORKER + 3);  // its 19 keys: no resize on the way
  if (out == nullptr) {
    Py_DECREF(per_worker);
    return nullptr;
  }
  const double t = static_cast<double>(total);
  if (!put(out, K_READINGS, PyLong_FromSsize_t(h)) || !put(out, K_CPU_USER, m_user.value()) ||
      !put(out, K_CPU_SYSTEM, m_system.value()) || !put(out, K_CPU_IOWAIT, m_iowait.value()) ||
      !put(out, K_CPU_IDLE, m_idle.value()) || !put(out, K_PROCESS_CPU, m_process.value()) ||
      !put(out, K_RSS_BYTES, rss_any ? PyLong_FromLongLong(rss_max) : Py_NewRef(Py_None)) ||
      !put(out, K_LOADER_READINGS, PyLong_FromLongLong(loader_readings)) ||
      !put(out, K_WORKERS, PyLong_FromSize_t(each.size())) || !put(out, K_WORKER_CPU_MEAN, m_cpu.value()) ||
      !put(out, K_WORKER_CPU_MAX, x_cpu.value()) || !put(out, K_WORKER_RUNNABLE_MEAN, m_runnable.value()) ||
      !put(out, K_WORKER_RUNNABLE_MAX, x_runnable.value()) ||
      !put(out, K_WORKER_BATCHES, counted ? PyLong_FromLongLong(total) : Py_NewRef(Py_None)) ||
      !put(out, K_WORKER_S_PER_BATCH, number_or_none(produced, busy_s / t)) ||
      !put(out, K_WORKER_CPU_S_PER_BATCH, number_or_none(produced && any_cpu_s, cpu_sum / t)) ||
      !put(out, K_PER_WORKER, Py_NewRef(per_worker)) || !put(out, K_CTX_SWITCHES_PER_S, m_ctx.value()) ||
      !put(out, K_CPU_COUNT, count_max > 0 ? PyLong_FromLongLong(count_max) : Py_NewRef(Py_None))) {
    Py_DECREF(out);
    Py_DECREF(per_worker);
    return nullptr;
  }
  Py_DECREF(per_worker);  // out holds it
  return out;
}

// The kinds of a record plan's fields (schema/writer.py FIELD_KINDS, in that order)
enum FieldKind { F_LONG, F_INT, F_DOUBLE, F_BOOLEAN, F_STRING, F_RECORDS, F_DOUBLES, F_NULLABLE = 8 };
// bytes and arrays of strings (StepMetrics v5's packed collective calls), after NULLABLE's bit
enum MoreFieldKinds { F_BYTES = 16, F_STRINGS = 32 };

void put_long(std::string& out, int64_t v) {
  char buf[10];
  out.append(buf, zigzag_varint(v, buf));
}

// A double as struct.pack("<d") writes it (an int taken too); false with an exception set
bool put_double(std::string& out, PyObject* v) {
  if (!PyFloat_CheckExact(v) && !PyLong_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "write_record: not a float");
    return false;
  }
  double x = PyFloat_AsDouble(v);
  if (x == -1.0 && PyErr_Occurred()) return false;
  char buf[8];
  std::memcpy(buf, &x, 8);  // little-endian: module.cpp refuses another machine
  out.append(buf, 8);
  return true;
}

// A str as its UTF-8 bytes with their length; false with an exception set
bool put_string(std::string& out, PyObject* v) {
  Py_ssize_t size = 0;
  const char* s = PyUnicode_CheckExact(v) ? PyUnicode_AsUTF8AndSize(v, &size) : nullptr;
  if (s == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "write_record: not a str");
    return false;
  }
  put_long(out, size);
  out.append(s, static_cast<size_t>(size));
  return true;
}

// bytes as they are, after their length; false with an exception set
bool put_bytes(std::string& out, PyObject* v) {
  if (!PyBytes_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "write_record: not bytes");
    return false;
  }
  put_long(out, PyBytes_GET_SIZE(v));
  out.append(PyBytes_AS_STRING(v), static_cast<size_t>(PyBytes_GET_SIZE(v)));
  return true;
}

// an array of strings (a list or a tuple); false with an exception set
bool put_strings(std::string& out, PyObject* v) {
  if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "write_record: not a list");
    return false;
  }
  const Py_ssize_t items = PySequence_Fast_GET_SIZE(v);
  if (items) {
    put_long(out, items);
    for (Py_ssize_t k = 0; k < items; ++k)
      if (!put_string(out, PySequence_Fast_GET_ITEM(v, k))) return false;
  }
  out.push_back('\0');
  return true;
}

bool write_planned(std::string& out, PyObject* record, PyObject* plan, int depth);

// concat_columns(parts, names) -> [a bytearray of each named column, its parts' items one
// after the other (writable, as np.concatenate's result is)], or None where a part lacks a
// column, or a column's parts are not 1-D contiguous buffers of one item letter and size (the caller then runs np.concatenate):
// the assembler's closing of a step whose events came in several batches, one call
// instead of one np.concatenate a column
PyObject* concat_columns(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "concat_columns takes a list of dicts and a tuple of names");
    return nullptr;
  }
  PyObject* parts = args[0];
  PyObject* names = args[1];
  const Py_ssize_t n_parts = PyList_GET_SIZE(parts), n_names = PyTuple_GET_SIZE(names);
  PyObject* out = PyList_New(n_names);
  if (out == nullptr) return nullptr;
  std::vector<Buffer1D> views(static_cast<size_t>(n_parts));
  for (Py_ssize_t c = 0; c < n_names; ++c) {
    PyObject* name = PyTuple_GET_ITEM(names, c);
    char letter = 0;
    Py_ssize_t itemsize = 0, total = 0;
    for (Py_ssize_t p = 0; p < n_parts; ++p) {
      PyObject* part = PyList_GET_ITEM(parts, p);
      PyObject* column = PyDict_CheckExact(part) ? PyDict_GetItemWithError(part, name) : nullptr;
      Buffer1D& view = views[static_cast<size_t>(p)];
      if (view.held) {
        PyBuffer_Release(&view.view);
        view.held = false;
      }
      const char f = column != nullptr ? view.letter(column) : 0;
      if (f == 0 || (p > 0 && (f != letter || view.view.itemsize != itemsize))) {
        Py_DECREF(out);
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_NONE;
      }
      letter = f;
      itemsize = view.view.itemsize;
      total += view.view.len;
    }
    PyObject* blob = PyByteArray_FromStringAndSize(nullptr, total);
    if (blob == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    char* at = PyByteArray_AS_STRING(blob);
    for (Py_ssize_t p = 0; p < n_parts; ++p) {
      const Py_buffer& v = views[static_cast<size_t>(p)].view;
      std::memcpy(at, v.buf, static_cast<size_t>(v.len));
      at += v.len;
    }
    PyList_SET_ITEM(out, c, blob);
  }
  return out;
}

// The kinds a plan's field may also have (schema/writer.py FIELD_KINDS): an enum (its
// sub-plan a dict symbol -> index), a record (its sub-plan the record's plan), a map of
// longs; numbered apart from F_NULLABLE's bit so that a nullable one is F_RECORD | F_NULLABLE
enum PlanFieldKinds { F_ENUM = 7, F_RECORD = 17, F_LONGS = 18 };

// A long as the generated function writes it (a plain int in range); false with an exception set
bool put_int64(std::string& out, PyObject* v) {
  if (!PyLong_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "write_record: not an int");
    return false;
  }
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow) {
    PyErr_SetString(PyExc_OverflowError, "write_record: out of range");
    return false;
  }
  if (x == -1 && PyErr_Occurred()) return false;
  put_long(out, x);
  return true;
}

// A map of strings to values, in the dict's order, each value written by ``put``; false
// with an exception set
bool put_map(std::string& out, PyObject* v, bool (*put)(std::string&, PyObject*)) {
  if (!PyDict_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "write_record: not a dict");
    return false;
  }
  if (PyDict_GET_SIZE(v)) {
    put_long(out, PyDict_GET_SIZE(v));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(v, &pos, &key, &value))
      if (!put_string(out, key) || !put(out, value)) return false;
  }
  out.push_back('\0');
  return true;
}

// Appends a field of one of PlanFieldKinds as the generated function writes it, with its
// checks; false with an exception set for a value it does not take or a kind it does not know
bool write_more(std::string& out, PyObject* v, PyObject* field, long kind, int depth) {
  switch (kind) {
    case F_ENUM: {
      PyObject* index = PyUnicode_CheckExact(v) ? PyDict_GetItemWithError(PyTuple_GET_ITEM(field, 2), v) : nullptr;
      if (index == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "write_record: not a symbol of the enum");
        return false;
      }
      put_long(out, PyLong_AsLongLong(index));
      return true;
    }
    case F_RECORD:
      return write_planned(out, v, PyTuple_GET_ITEM(field, 2), depth + 1);
    case F_LONGS:  // a map of longs, in the dict's order
      return put_map(out, v, put_int64);
    default:
      PyErr_SetString(PyExc_ValueError, "write_record: a field kind it does not know");
      return false;
  }
}

// Appends record's fields by plan ((name, kind, sub-plan), ...): what schema/writer.py's
// generated function writes for the record, with its checks; false with an exception set
// for a value it does not take (the caller then writes the record with fastavro)
bool write_planned(std::string& out, PyObject* record, PyObject* plan, int depth) {
  if (!PyDict_CheckExact(record) || depth > 8) {
    PyErr_SetString(PyExc_TypeError, "write_record: not a dict");
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(plan);
  // The record's entries are read in its order beside the plan's: a dict built in the
  // schema's order (the host figures, an advice line, most of a StepMetrics) gives each
  // field's value by a pointer compare of the interned names, not a lookup; an entry out of
  // that order is looked up, and the walk waits at the entry for the next field.
  Py_ssize_t walk = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* field = PyTuple_GET_ITEM(plan, i);
    PyObject* name = PyTuple_GET_ITEM(field, 0);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(field, 1));
    PyObject *key, *v;
    Py_ssize_t next = walk;
    if (PyDict_Next(record, &next, &key, &v) && key == name) {
      walk = next;
    } else if ((v = PyDict_GetItemWithError(record, name)) == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name);
      return false;
    }
    if (kind & F_NULLABLE) {
      if (v == Py_None) {
        out.push_back('\0');
        continue;
      }
      out.push_back('\x02');
      kind &= ~F_NULLABLE;
    }
    switch (kind) {
      case F_LONG:
      case F_INT: {
        if (!PyLong_CheckExact(v)) {
          PyErr_SetString(PyExc_TypeError, "write_record: not an int");
          return false;
        }
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (kind == F_INT && (x < INT32_MIN || x > INT32_MAX))) {
          PyErr_SetString(PyExc_OverflowError, "write_record: out of range");
          return false;
        }
        if (x == -1 && PyErr_Occurred()) return false;
        put_long(out, x);
        break;
      }
      case F_DOUBLE:
        if (!put_double(out, v)) return false;
        break;
      case F_BOOLEAN:
        if (!PyBool_Check(v)) {
          PyErr_SetString(PyExc_TypeError, "write_record: not a bool");
          return false;
        }
        out.push_back(v == Py_True ? '\x01' : '\0');
        break;
      case F_STRING:
        if (!put_string(out, v)) return false;
        break;
      case F_RECORDS: {
        if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) {
          PyErr_SetString(PyExc_TypeError, "write_record: not a list");
          return false;
        }
        PyObject* sub = PyTuple_GET_ITEM(field, 2);
        const Py_ssize_t items = PySequence_Fast_GET_SIZE(v);
        if (items) {
          put_long(out, items);
          for (Py_ssize_t k = 0; k < items; ++k)
            if (!write_planned(out, PySequence_Fast_GET_ITEM(v, k), sub, depth + 1)) return false;
        }
        out.push_back('\0');
        break;
      }
      case F_DOUBLES:  // a map of doubles, in the dict's order
        if (!put_map(out, v, put_double)) return false;
        break;
      case F_BYTES:
        if (!put_bytes(out, v)) return false;
        break;
      case F_STRINGS:
        if (!put_strings(out, v)) return false;
        break;
      default:
        if (!write_more(out, v, field, kind, depth)) return false;
    }
  }
  return true;
}

// write_record(record, plan) -> the record's Avro body by plan (schema/writer.py
// record_plan: a tuple of (name, kind, sub-plan or None)); raises for a value it does not take
PyObject* write_record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "write_record takes a record and its plan (a tuple)");
    return nullptr;
  }
  std::string out;
  if (!write_planned(out, args[0], args[1], 0)) return nullptr;
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

PyMethodDef kernel_functions[] = {
    {"kind_overlap", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(kind_overlap)), METH_FASTCALL,
     "kind_overlap(kind, start, dur, lo, hi, a, b, a_start, a_end, b_start, b_end) -> (|A|, |B|, |A & B|) or None"},
    {"sums_by_code", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(sums_by_code)), METH_FASTCALL,
     "sums_by_code(code, start, dur, lo, hi) -> [(code, summed dur, count)] of the rows starting in [lo, hi)"},
    {"past_end", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(past_end)), METH_FASTCALL,
     "past_end(kind, start, dur, end, a, b, a_start, a_end, b_start, b_end) -> the unions past end, as int64 bytes"},
    {"queue_sizes", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(queue_sizes)), METH_FASTCALL,
     "queue_sizes(queue, ts, size, lo, hi) -> [(queue, min, sum, count, last, at_start, zeros)] or None"},
    {"memory_at", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(memory_at)), METH_FASTCALL,
     "memory_at(ts, peak, allocated, reserved, lo, hi) -> (peak, allocated, reserved), False or None"},
    {"uniform", uniform, METH_O, "uniform(column) -> the value every row holds, else None"},
    {"below", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(below)), METH_FASTCALL,
     "below(column, n) -> whether every value, read as unsigned, is below n (None: a column of another type)"},
    {"any_launched", any_launched, METH_O, "any_launched(launch) -> whether a value is >= 0 (None: another type)"},
    {"rolling_sums", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(rolling_sums)), METH_FASTCALL,
     "rolling_sums(step_time, data_wait, count, ranks) -> (step sum, wait sum, sorted step times at ranks) or None"},
    {"host_figures", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(host_figures)), METH_FASTCALL,
     "host_figures(13 host and loader columns[, wire]) -> a step's resources dict (processors/host.py) or None"},
    {"concat_columns", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(concat_columns)), METH_FASTCALL,
     "concat_columns(parts, names) -> [each named column's parts as one bytearray], or None (numpy joins them)"},
    {"write_record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(write_record)), METH_FASTCALL,
     "write_record(record, plan) -> its Avro body, written by plan (schema/writer.py record_plan)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool init_kernels(PyObject* module) { return PyModule_AddFunctions(module, kernel_functions) == 0; }

}  // namespace ps
