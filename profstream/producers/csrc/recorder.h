// The Recorder: a Monitor's events in native columns (one Store per EventBatch section),
// written on the training thread, read by the Batcher on the sender thread without the GIL.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "store.h"

namespace ps {

constexpr int64_t NO_WATERMARK = INT64_MIN;

// What wakes the sender. set(): a step ended or a batch filled — a doorbell that rings
// (takes the mutex and notifies) only while the sender waits for it; while the sender
// sleeps out its batch interval a step end costs the training thread two atomic
// operations and no system call, and wakes no thread. interrupt: a flush or stop, which
// ends any wait.
struct Wakeup {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> woken{false};
  std::atomic<bool> waiting{false};  // a thread waits for set() (wait, wait_until)
  std::atomic<bool> interrupt{false};

  void set() {
    // sequentially consistent with the waiter's store of `waiting` and load of `woken`:
    // either the waiter sees `woken` before it sleeps or this sees `waiting` and notifies
    woken.store(true);
    if (waiting.load()) {
      std::lock_guard<std::mutex> g(mu);
      cv.notify_all();
    }
  }
  void clear() { woken.store(false); }
  bool is_set() const { return woken.load(); }
  // Until set (true) or the timeout; call without the GIL.
  bool wait(double seconds) {
    return wait_until(std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(seconds > 0 ? std::min(seconds, 1e9) : 0)),
                      false);
  }
  // Until set (true), `deadline` or, if `or_interrupt`, an interrupt; call without the GIL.
  bool wait_until(std::chrono::steady_clock::time_point deadline, bool or_interrupt) {
    std::unique_lock<std::mutex> l(mu);
    waiting.store(true);
    cv.wait_until(l, deadline, [this, or_interrupt] { return woken.load() || (or_interrupt && interrupt.load()); });
    waiting.store(false);
    return woken.load();
  }
  void raise_interrupt() {
    {
      std::lock_guard<std::mutex> g(mu);
      interrupt.store(true);
    }
    cv.notify_all();
  }
  // Sleep until `deadline` or an interrupt (set() does not end it); call without the GIL.
  // True if interrupted.
  bool sleep_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_until(l, deadline, [this] { return interrupt.load(); });
  }
};

struct Recording {
  std::vector<SectionSpec> specs;
  std::vector<std::unique_ptr<Store>> stores;
  int ops = -1;       // the section op() and add_rows() fill
  // columns of the ops section op() sets, by role
  int c_name = -1, c_type = -1, c_kind = -1, c_stream = -1, c_step = -1, c_start = -1, c_dur = -1;
  int64_t batch_max_ops = 8192;
  std::vector<int64_t> scratch;  // add_rows' converted columns (recording thread)

  // written by the recording thread only; read anywhere
  std::atomic<int64_t> dropped_ops{0};
  std::atomic<int64_t> dropped_samples{0};
  std::atomic<int64_t> bad_ops{0};       // invalid values: dropped, reported in batch headers
  std::atomic<int64_t> bad_samples{0};
  std::atomic<int64_t> unknown_kinds{0};
  std::atomic<int64_t> watermark{NO_WATERMARK};
  // Rows of sections the native encoder does not write (device samples...), recorded in
  // Python and sent by the Python encoder: recorded (any thread, GIL held) and handed to
  // it (the sender thread). While some wait, the Batcher holds the watermark back and
  // returns to Python, so that they go out before the batch that completes their steps.
  std::atomic<int64_t> foreign_recorded{0};
  std::atomic<int64_t> foreign_taken{0};
  std::atomic<int64_t> foreign_dropped{0};  // their drops, for the batch headers
  bool foreign_waiting() const {
    return foreign_recorded.load(std::memory_order_acquire) > foreign_taken.load(std::memory_order_acquire);
  }

  // recording-thread state (GIL held)
  bool capturing = true;
  int64_t step = -1;
  PyObject* first_bad_op = nullptr;      // the first invalid op row, for the one warning
  PyObject* first_bad_sample = nullptr;

  std::shared_ptr<Wakeup> wake = std::make_shared<Wakeup>();  // shared with the Wake object

  ~Recording() {
    Py_XDECREF(first_bad_op);
    Py_XDECREF(first_bad_sample);
  }
};

struct RecorderObject {
  PyObject_HEAD
  Recording* rec;
  PyObject* wake;  // the Wake object of rec->wake
};

// Shared by recorder.cpp and columns.cpp (recording thread, GIL held).
inline void bump(std::atomic<int64_t>& counter, int64_t by = 1) {  // one writer: no read-modify-write
  counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

inline int column_index(const SectionSpec& s, const char* name) {
  for (size_t i = 0; i < s.cols.size(); ++i)
    if (s.cols[i].name == name) return static_cast<int>(i);
  return -1;
}

inline void note_first(PyObject** slot, PyObject* row) {
  if (*slot == nullptr && row != nullptr) {
    Py_INCREF(row);
    *slot = row;
  }
}

// Recorder.add_rows (columns.cpp): n rows of a section from {column: values}.
PyObject* add_rows(Recording* r, int section, Py_ssize_t n, PyObject* columns, PyObject* fallback);

extern PyTypeObject RecorderType;
extern PyTypeObject WakeType;

}  // namespace ps
