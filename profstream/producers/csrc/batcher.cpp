// The Batcher: the Monitor's sender thread in native code. It builds EventBatch messages
// from the Recorder's columns and hands them to librdkafka, and in the steady state it
// waits, builds, sends and hears deliveries without the GIL, for as many cycles as
// nothing needs Python (profstream.producers.native_sender drives it: connecting,
// flush, close and log lines stay in Python). Same rules as the Python Sender
// (producers/sender.py): at most one cycle per batch interval unless woken; seq numbers
// given when a batch is built and kept when librdkafka cannot take it yet; a batch over
// the message limit sends half its ops and gives the rest back; the watermark read before
// the rows, and held back while ops of the batch's steps are still buffered.
// While the Monitor spools (producers/spool_sending.py: Kafka away, or records wait on
// disk), Python builds, writes and reads back the batches; the Batcher then only sends
// what Python hands it from the spool and hears the broker, and keeps the bytes of its
// own batches that a close purges ("rescued"), for Python to put in front of the spool.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "encoder.h"
#include "host.h"
#include "kafka.h"
#include "recorder.h"

namespace ps {

namespace {

using Clock = std::chrono::steady_clock;

int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct Event {
  std::string kind;
  int64_t a = 0, b = 0;
  std::string text;
};

struct Pending {
  char* data;
  size_t size;
  int64_t ops;
  int64_t samples;
  bool spooled;
};

struct Rescued {
  std::string data;
  int64_t ops;
  int64_t samples;
};

bool purged(int err) { return err == ERR_PURGE_QUEUE || err == ERR_PURGE_INFLIGHT; }

// Whether row `row` of a column holds the column's fill value.
bool holds_fill(const ColumnSpec& col, const char* data, int64_t row) {
  if (col.type == F64) return std::memcmp(data + row * 8, &col.fill_float, 8) == 0;
  int64_t v = 0;
  if (col.width == 1) {
    v = static_cast<uint8_t>(data[row]);
  } else if (col.width == 4) {
    int32_t x;
    std::memcpy(&x, data + row * 4, 4);
    v = x;
  } else {
    std::memcpy(&v, data + row * 8, 8);
  }
  return v == col.fill_int;
}

}  // namespace

class Core : public DeliverySink {
 public:
  Recording* rec = nullptr;
  Encoder encoder;  // the plain version (schema.batch's for a batch of ops and samples alone)
  // the version a batch needs whose rows say more than the plain one's columns hold (a step
  // mark that lost events, an end mark on a signal): EventBatch v7 (native.marked_version)
  Encoder marked;
  bool has_marked = false;
  int64_t max_message_bytes = 1000000;
  int64_t inflight_limit = 0;
  Clock::duration interval{};
  Clock::duration host_interval{};
  Clock::duration idle_interval{};  // the longest a cycle waits for a step to end
  int host_section = -1;
  int host_cols[7] = {-1, -1, -1, -1, -1, -1, -1};
  bool host_native = false;
  HostSampler host;
  Clock::time_point next_host{};
  Clock::time_point last_cycle{};
  ProducerObject* producer = nullptr;  // attached while connected (a strong reference in the Batcher)

  // sender-thread state
  int64_t seq = 0;
  int64_t sent_watermark = NO_WATERMARK;
  int64_t reported_dropped_ops = 0, reported_dropped_samples = 0, reported_bad_ops = 0, reported_bad_samples = 0;
  int64_t ops_limit = int64_t(1) << 30;
  std::deque<Pending> pending;
  std::vector<Take> takes;
  Buffer out;
  bool warned_bad_ops = false, warned_bad_samples = false, warned_unknown = false;

  // read from any thread
  std::atomic<int64_t> pending_count{0}, inflight{0}, acked{0}, failed{0}, latency{-1}, batches_sent{0},
      bytes_sent{0}, undelivered_ops{0}, undelivered_samples{0}, cycles{0}, returns{0};
  std::atomic<bool> down{false};
  std::atomic<bool> spooling{false};      // Python builds and spools; cycles only send what it hands over
  std::atomic<bool> rescue{false};        // a spool is there: keep purged batches' bytes for it
  std::atomic<int64_t> spool_settled{0};  // spooled messages acknowledged or refused for good, in order
  std::mutex rescued_mu;
  std::vector<Rescued> rescued;
  std::mutex events_mu;
  std::vector<Event> events;
  std::atomic<bool> has_events{false};

  ~Core() override {
    for (Pending& p : pending) std::free(p.data);
  }

  void event(const char* kind, int64_t a = 0, int64_t b = 0, std::string text = "") {
    std::lock_guard<std::mutex> g(events_mu);
    events.push_back(Event{kind, a, b, std::move(text)});
    has_events.store(true);
  }

  // -- DeliverySink: on this thread, in poll/flush ------------------------------------

  void delivered(int err, const char* reason, MsgInfo* info, const void* payload, size_t len) override {
    inflight.fetch_sub(info->size);
    if (err == 0) {
      acked.fetch_add(1);
      if (info->spooled) spool_settled.fetch_add(1);
      latency.store(monotonic_ns() - info->sent_at_ns);
      if (down.exchange(false)) event("up");
      return;
    }
    failed.fetch_add(1);
    if (purged(err) && info->spooled) return;  // still in the spool: sent by the next Monitor or a publish
    if (purged(err) && rescue.load()) {        // for the spool, in front of what it holds
      std::lock_guard<std::mutex> g(rescued_mu);
      rescued.push_back(Rescued{std::string(static_cast<const char*>(payload), len), info->ops, info->samples});
      return;
    }
    if (info->spooled) spool_settled.fetch_add(1);  // refused for good: off the spool, counted
    undelivered_ops.fetch_add(info->ops);
    undelivered_samples.fetch_add(info->samples);
    event("undelivered", info->ops, info->samples, reason);
  }

  void client_error(int err, const char* reason) override {
    if (err == ERR_ALL_BROKERS_DOWN) event("client_error", err, 0, reason);
  }

  // -- batches ---------------------------------------------------------------------------

  int64_t counted_samples(const std::vector<Take>& t) const {
    int64_t n = 0;
    for (size_t s = 0; s < t.size(); ++s)
      if (static_cast<int>(s) != rec->ops && static_cast<int>(s) != host_section) n += t[s].count;
    return n;
  }

  static void truncate(Take& t, int64_t keep) {
    int64_t n = 0;
    size_t i = 0;
    for (; i < t.segments.size() && n < keep; ++i) {
      Segment& seg = t.segments[i];
      if (n + (seg.to - seg.from) > keep) seg.to = seg.from + (keep - n);
      n += seg.to - seg.from;
    }
    t.segments.resize(i);
    t.count = n;
  }

  // The encoder for `t`: the marked one when a row holds a value other than its column's
  // fill in a column the plain version does not have, or the batch has rows of a section
  // the plain version has not (the data loader's readings): the Python encoder's choice, too.
  Encoder& encoder_for(const std::vector<Take>& t) {
    if (!has_marked) return encoder;
    for (size_t s = 0; s < t.size(); ++s) {
      const SectionSpec& spec = rec->specs[s];
      if (t[s].count && !encoder.writes(static_cast<int>(s))) return marked;
      for (size_t c = encoder.columns(static_cast<int>(s)); c < spec.cols.size(); ++c)
        for (const Segment& seg : t[s].segments)
          for (int64_t r = seg.from; r < seg.to; ++r)
            if (!holds_fill(spec.cols[c], seg.block->cols[c], r)) return marked;
    }
    return encoder;
  }

  // Build one batch into `pending`; false when there is nothing to send.
  bool build() {
    Recording* r = rec;
    int64_t watermark = r->watermark.load(std::memory_order_acquire);  // before the rows
    // rows the Python encoder sends have not gone yet: the watermark waits for them
    if (r->foreign_waiting()) watermark = sent_watermark;
    size_t ns = r->stores.size();
    takes.resize(ns);
    int64_t rows = 0;
    for (size_t s = 0; s < ns; ++s) {
      takes[s].segments.clear();
      int64_t limit = static_cast<int>(s) == r->ops ? std::min(r->batch_max_ops, ops_limit) : INT64_MAX;
      takes[s].count = r->stores[s]->collect(limit, takes[s].segments);
      rows += takes[s].count;
    }
    Store& ops = *r->stores[r->ops];
    int64_t left = ops.buffered() - takes[r->ops].count;
    // what never reached Kafka is reported downstream with what the buffer dropped
    int64_t dropped_ops = r->dropped_ops.load() + undelivered_ops.load();
    int64_t dropped_samples = r->dropped_samples.load() + r->foreign_dropped.load() + undelivered_samples.load();
    int64_t bad_ops = r->bad_ops.load(), bad_samples = r->bad_samples.load();
    Header h;
    h.dropped_ops = dropped_ops - reported_dropped_ops + bad_ops - reported_bad_ops;
    h.dropped_samples = dropped_samples - reported_dropped_samples + bad_samples - reported_bad_samples;
    if (!rows && !h.dropped_ops && !h.dropped_samples && watermark == sent_watermark) return false;
    h.seq = seq;
    h.sent_ns = realtime_ns();
    h.fill_ratio = ops.spec.max_rows > 0 ? static_cast<double>(left) / static_cast<double>(ops.spec.max_rows) : 0.0;
    h.send_latency_ns = latency.load();
    // ops beyond this batch stay buffered: the watermark waits for the last of them
    h.complete_through = left > 0 ? sent_watermark : watermark;
    std::vector<int64_t> consumed(ns);
    for (size_t s = 0; s < ns; ++s) consumed[s] = takes[s].count;
    int64_t samples = counted_samples(takes);
    out.clear();
    encoder_for(takes).encode(h, takes, out);
    while (static_cast<int64_t>(out.size()) > max_message_bytes) {
      int64_t n = takes[r->ops].count, size = static_cast<int64_t>(out.size());
      if (n > 1) {  // send the first half now, the rest stays buffered
        int64_t keep = n / 2;
        truncate(takes[r->ops], keep);
        consumed[r->ops] = keep;
        h.complete_through = sent_watermark;
        if (keep < ops_limit) {
          ops_limit = keep;
          event("oversize", n, size, std::to_string(keep));
        }
      } else {  // one op, or samples alone: it cannot shrink; dropped and counted
        undelivered_ops.fetch_add(n);
        undelivered_samples.fetch_add(samples);
        char why[160];
        std::snprintf(why, sizeof why, "a batch of %" PRId64 " bytes is over Kafka's message limit", size);
        event("undelivered", n, samples, why);
        for (size_t s = 0; s < ns; ++s) {
          if (static_cast<int>(s) != host_section) {
            takes[s].segments.clear();
            takes[s].count = 0;
          }
        }
        samples = 0;
      }
      out.clear();
      encoder_for(takes).encode(h, takes, out);
    }
    for (size_t s = 0; s < ns; ++s)
      if (consumed[s]) r->stores[s]->consume(consumed[s]);
    reported_dropped_ops = dropped_ops;
    reported_dropped_samples = dropped_samples;
    reported_bad_ops = bad_ops;
    reported_bad_samples = bad_samples;
    sent_watermark = h.complete_through;
    ++seq;
    size_t size;
    char* data = out.release(&size);
    pending.push_back(Pending{data, size, takes[r->ops].count, samples, false});
    pending_count.fetch_add(1);
    return true;
  }

  void send_pending() {
    while (!pending.empty()) {
      Pending& p = pending.front();
      auto* info = new MsgInfo{static_cast<int64_t>(p.size), p.ops, p.samples, monotonic_ns(), p.spooled};
      int err = produce(producer, p.data, p.size, info);
      if (err != 0) {
        delete info;
        if (err == ERR_QUEUE_FULL) return;  // a long outage: keep it, retry later
        if (err != ERR_MSG_SIZE_TOO_LARGE) {  // keep the batch, report the outage once
          event("produce_error", err, 0, rdk.err2str(err));
          return;
        }
        char why[160];
        std::snprintf(why, sizeof why, "a batch of %zu bytes is over the message limit", p.size);
        undelivered_ops.fetch_add(p.ops);
        undelivered_samples.fetch_add(p.samples);
        if (p.spooled) spool_settled.fetch_add(1);
        event("undelivered", p.ops, p.samples, why);
        std::free(p.data);
      } else {  // librdkafka owns the bytes now
        inflight.fetch_add(static_cast<int64_t>(p.size));
        batches_sent.fetch_add(1);
        bytes_sent.fetch_add(static_cast<int64_t>(p.size));
      }
      pending.pop_front();
      pending_count.fetch_sub(1);
    }
  }

  void sample_host() {
    HostSample h;
    if (!host.sample(&h)) return;
    Store& s = *rec->stores[host_section];
    if (s.full()) return;
    int64_t row;
    Block* b = s.slot(&row);
    if (b == nullptr) return;
    double values[] = {0, h.cpu_user, h.cpu_system, h.cpu_idle, h.cpu_iowait, h.process_cpu, 0};
    const SectionSpec& spec = s.spec;
    for (size_t i = 0; i < spec.cols.size(); ++i) {
      const ColumnSpec& c = spec.cols[i];
      int role = -1;
      for (int k = 0; k < 7; ++k)
        if (host_cols[k] == static_cast<int>(i)) role = k;
      if (role == 0 || role == 6) write_int(b->cols[i], c.width, row, role == 0 ? h.ts_ns : h.rss_bytes);
      else if (role > 0 && c.type == F64) std::memcpy(b->cols[i] + row * 8, &values[role], 8);
      else if (c.type == F64) std::memcpy(b->cols[i] + row * 8, &c.fill_float, 8);
      else write_int(b->cols[i], c.width, row, c.fill_int);
    }
    s.publish(b, row);
  }

  void check_recorder() {
    if (!warned_bad_ops && rec->bad_ops.load()) {
      warned_bad_ops = true;
      event("bad_ops");
    }
    if (!warned_bad_samples && rec->bad_samples.load()) {
      warned_bad_samples = true;
      event("bad_samples");
    }
    if (!warned_unknown && rec->unknown_kinds.load()) {
      warned_unknown = true;
      event("unknown_kinds");
    }
  }

  // One cycle: host sample when due, delivery reports, what waits, then new batches while
  // the in-flight share allows.
  void cycle() {
    rec->wake->clear();  // before the rows are taken: a step that ends during the cycle rings again
    Clock::time_point now = Clock::now();
    last_cycle = now;
    if (host_interval.count() > 0 && now >= next_host) {
      next_host = now + host_interval;
      if (host_native) sample_host();
      else event("host_due");
    }
    check_recorder();
    if (producer != nullptr) {
      rdk.poll(producer->rk, 0);
      send_pending();
      if (!spooling.load())
        while (pending.empty() && inflight.load() < inflight_limit && build()) send_pending();
    }
    cycles.fetch_add(1);
  }

  // Whether a cycle now would only send steps still running: nothing built waits, no
  // acknowledgement is due (a cycle hears them), and no completed step (watermark) waits.
  bool nothing_complete() const {
    return pending.empty() && inflight.load() == 0 && rec->watermark.load(std::memory_order_acquire) == sent_watermark;
  }

  // Cycles until something needs Python (an event, an interrupt: flush or stop) or
  // `deadline`. Called without the GIL. At most one cycle per interval, as each message
  // costs librdkafka's threads ~0.2-0.35 ms of CPU; after the interval, a cycle as soon
  // as a step has ended, a batch has filled or a completed step waits, and otherwise
  // (a long step) at the latest `idle_interval` after the last cycle: what a step records
  // is sent when it ends, and the sender thread wakes once per message, not once per step.
  void run(Clock::time_point deadline) {
    Wakeup& w = *rec->wake;
    for (;;) {
      if (w.interrupt.load() || has_events.load() || rec->foreign_waiting()) return;
      // with a spool, librdkafka holding the whole in-flight share is Python's to handle: it spools
      if (rescue.load() && !spooling.load() && inflight.load() >= inflight_limit) return;
      if (w.sleep_until(last_cycle + interval)) return;  // only a flush or stop cuts it short
      if (!w.is_set() && nothing_complete()) {
        Clock::time_point until = std::min(deadline, last_cycle + idle_interval);
        if (host_interval.count() > 0) until = std::min(until, next_host);
        w.wait_until(until, true);
        if (w.interrupt.load()) return;
      }
      if (spooling.load()) return;  // a cycle is due: Python's, which spools
      cycle();
      if (Clock::now() >= deadline || rec->foreign_waiting()) return;
    }
  }
};

// -- the Python type ----------------------------------------------------------------------

struct BatcherObject {
  PyObject_HEAD
  PyObject* recorder;  // RecorderObject, strong
  PyObject* producer;  // ProducerObject or None
  Core* core;
};

extern PyTypeObject BatcherType;

DeliverySink* batcher_sink(PyObject* obj) {
  if (!PyObject_TypeCheck(obj, &BatcherType) || reinterpret_cast<BatcherObject*>(obj)->core == nullptr) {
    PyErr_SetString(PyExc_TypeError, "the sink must be a Batcher");
    return nullptr;
  }
  return reinterpret_cast<BatcherObject*>(obj)->core;
}

// Batcher(recorder, plan, max_message_bytes, inflight_limit_bytes, interval_s, idle_interval_s, host_interval_s,
//         host_section[, marked_plan])
static int Batcher_init(BatcherObject* self, PyObject* args, PyObject*) {
  PyObject *recorder, *plan, *marked_plan = Py_None;
  long long max_message, inflight;
  double interval, idle_interval, host_interval;
  int host_section;
  if (!PyArg_ParseTuple(args, "O!OLLdddi|O", &RecorderType, &recorder, &plan, &max_message, &inflight, &interval,
                        &idle_interval, &host_interval, &host_section, &marked_plan))
    return -1;
  if (self->core != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Batcher is already initialized");
    return -1;
  }
  auto* core = new Core();
  core->rec = reinterpret_cast<RecorderObject*>(recorder)->rec;
  if (!core->encoder.parse(plan, core->rec->specs) ||
      (marked_plan != Py_None && !core->marked.parse(marked_plan, core->rec->specs))) {
    delete core;
    return -1;
  }
  core->has_marked = marked_plan != Py_None;
  core->max_message_bytes = max_message;
  core->inflight_limit = inflight;
  core->interval = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval));
  core->idle_interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::max(idle_interval, interval)));
  core->host_interval = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(host_interval));
  if (host_section >= static_cast<int>(core->rec->specs.size()) || host_section == core->rec->ops) {
    PyErr_SetString(PyExc_ValueError, "bad host section");
    delete core;
    return -1;
  }
  core->host_section = host_section;
  if (host_section >= 0) {
    static const char* roles[7] = {"ts_ns", "cpu_user", "cpu_system", "cpu_idle", "cpu_iowait", "process_cpu",
                                   "rss_bytes"};
    const SectionSpec& spec = core->rec->specs[host_section];
    for (int k = 0; k < 7; ++k)
      for (size_t i = 0; i < spec.cols.size(); ++i)
        if (spec.cols[i].name == roles[k]) core->host_cols[k] = static_cast<int>(i);
    core->host_native = core->host.start() && spec.dicts.empty();
  }
  core->last_cycle = Clock::now() - core->interval;
  Py_INCREF(recorder);
  self->recorder = recorder;
  Py_INCREF(Py_None);
  self->producer = Py_None;
  self->core = core;
  return 0;
}

static void Batcher_dealloc(BatcherObject* self) {
  Py_XDECREF(self->producer);
  delete self->core;  // after the recorder's columns are no longer read
  Py_XDECREF(self->recorder);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static PyObject* Batcher_attach(BatcherObject* self, PyObject* producer) {
  if (producer != Py_None && !PyObject_TypeCheck(producer, &ProducerType)) {
    PyErr_SetString(PyExc_TypeError, "attach(Producer or None)");
    return nullptr;
  }
  Py_INCREF(producer);
  Py_SETREF(self->producer, producer);
  self->core->producer = producer == Py_None ? nullptr : reinterpret_cast<ProducerObject*>(producer);
  Py_RETURN_NONE;
}

static PyObject* Batcher_cycle(BatcherObject* self, PyObject*) {
  Py_BEGIN_ALLOW_THREADS self->core->cycle();
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject* Batcher_run(BatcherObject* self, PyObject* args) {
  double seconds;
  if (!PyArg_ParseTuple(args, "d", &seconds)) return nullptr;
  Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(seconds > 0 ? seconds : 0));
  Py_BEGIN_ALLOW_THREADS self->core->run(deadline);
  Py_END_ALLOW_THREADS self->core->returns.fetch_add(1);
  Py_RETURN_NONE;
}

static PyObject* Batcher_build(BatcherObject* self, PyObject*) {
  bool built;
  Py_BEGIN_ALLOW_THREADS built = self->core->build();
  Py_END_ALLOW_THREADS return PyBool_FromLong(built);
}

// The oldest message built here or enqueued unspooled (not one handed over from the spool).
static PyObject* Batcher_take_message(BatcherObject* self, PyObject*) {
  Core* c = self->core;
  auto it = std::find_if(c->pending.begin(), c->pending.end(), [](const Pending& p) { return !p.spooled; });
  if (it == c->pending.end()) Py_RETURN_NONE;
  Pending p = *it;
  c->pending.erase(it);
  c->pending_count.fetch_sub(1);
  PyObject* out = Py_BuildValue("(y#LL)", p.data, static_cast<Py_ssize_t>(p.size), p.ops, p.samples);
  std::free(p.data);
  return out;
}

// enqueue(message, ops, samples): a message built in Python (rows of a section the native
// encoder does not write), sent in order with the native ones. On the sender thread.
static PyObject* Batcher_enqueue(BatcherObject* self, PyObject* args) {
  Py_buffer data;
  long long ops, samples;
  int spooled = 0;
  if (!PyArg_ParseTuple(args, "y*LL|p", &data, &ops, &samples, &spooled)) return nullptr;
  char* copy = static_cast<char*>(std::malloc(data.len > 0 ? static_cast<size_t>(data.len) : 1));
  if (copy == nullptr) {
    PyBuffer_Release(&data);
    return PyErr_NoMemory();
  }
  std::memcpy(copy, data.buf, static_cast<size_t>(data.len));
  self->core->pending.push_back(Pending{copy, static_cast<size_t>(data.len), ops, samples, spooled != 0});
  self->core->pending_count.fetch_add(1);
  PyBuffer_Release(&data);
  Py_RETURN_NONE;
}

// send(): hand what waits to librdkafka now (when attached); True when nothing is left waiting.
static PyObject* Batcher_send(BatcherObject* self, PyObject*) {
  Core* c = self->core;
  if (c->producer != nullptr) {
    Py_BEGIN_ALLOW_THREADS c->send_pending();
    Py_END_ALLOW_THREADS
  }
  return PyBool_FromLong(c->pending.empty());
}

static PyObject* Batcher_set_spooling(BatcherObject* self, PyObject* value) {
  self->core->spooling.store(PyObject_IsTrue(value) == 1);
  Py_RETURN_NONE;
}

static PyObject* Batcher_set_rescue(BatcherObject* self, PyObject* value) {
  self->core->rescue.store(PyObject_IsTrue(value) == 1);
  Py_RETURN_NONE;
}

// A Python list of `build(item)` for each item (new references); nullptr on an error.
template <typename T, typename F>
PyObject* list_of(const std::vector<T>& items, F build) {
  PyObject* out = PyList_New(0);
  for (const T& x : items) {
    PyObject* item = build(x);
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return out;
}

// take_rescued(): [(bytes, ops, samples)] of the batches a close purged, in their order.
static PyObject* Batcher_take_rescued(BatcherObject* self, PyObject*) {
  std::vector<Rescued> got;
  {
    std::lock_guard<std::mutex> g(self->core->rescued_mu);
    got.swap(self->core->rescued);
  }
  return list_of(got, [](const Rescued& r) {
    return Py_BuildValue("(y#LL)", r.data.data(), static_cast<Py_ssize_t>(r.data.size()), r.ops, r.samples);
  });
}

static PyObject* Batcher_drop_pending(BatcherObject* self, PyObject*) {
  Core* c = self->core;
  int64_t ops = 0, samples = 0;
  for (Pending& p : c->pending) {
    if (!p.spooled) {  // those handed over from the spool stay there
      ops += p.ops;
      samples += p.samples;
    }
    std::free(p.data);
  }
  c->pending_count.fetch_sub(static_cast<int64_t>(c->pending.size()));
  c->pending.clear();
  return Py_BuildValue("(LL)", ops, samples);
}

// (messages, ops, samples) built and unsent, not counting those handed over from the spool.
static PyObject* Batcher_pending(BatcherObject* self, PyObject*) {
  int64_t n = 0, ops = 0, samples = 0;
  for (const Pending& p : self->core->pending) {
    if (p.spooled) continue;
    ++n;
    ops += p.ops;
    samples += p.samples;
  }
  return Py_BuildValue("(LLL)", n, ops, samples);
}

static PyObject* Batcher_take_events(BatcherObject* self, PyObject*) {
  std::vector<Event> got;
  {
    std::lock_guard<std::mutex> g(self->core->events_mu);
    got.swap(self->core->events);
    self->core->has_events.store(false);
  }
  return list_of(got, [](const Event& e) { return Py_BuildValue("(sLLs)", e.kind.c_str(), e.a, e.b, e.text.c_str()); });
}

static PyObject* Batcher_interrupt(BatcherObject* self, PyObject*) {
  self->core->rec->wake->raise_interrupt();
  Py_RETURN_NONE;
}

static PyObject* Batcher_clear_interrupt(BatcherObject* self, PyObject*) {
  self->core->rec->wake->interrupt.store(false);
  Py_RETURN_NONE;
}

static PyObject* Batcher_add_undelivered(BatcherObject* self, PyObject* args) {
  long long ops, samples;
  if (!PyArg_ParseTuple(args, "LL", &ops, &samples)) return nullptr;
  self->core->undelivered_ops.fetch_add(ops);
  self->core->undelivered_samples.fetch_add(samples);
  Py_RETURN_NONE;
}

static PyObject* Batcher_set_down(BatcherObject* self, PyObject* value) {
  self->core->down.store(PyObject_IsTrue(value) == 1);
  Py_RETURN_NONE;
}

static PyObject* Batcher_stats(BatcherObject* self, PyObject*) {
  Core* c = self->core;
  return Py_BuildValue(
      "{sLsLsLsLsLsLsLsLsLsLsLsLsL}", "batches_sent", c->batches_sent.load(), "bytes_sent", c->bytes_sent.load(),
      "batches_acked", c->acked.load(), "batches_failed", c->failed.load(), "undelivered_ops",
      c->undelivered_ops.load(), "undelivered_samples", c->undelivered_samples.load(), "inflight_bytes",
      c->inflight.load(), "send_latency_ns", c->latency.load(), "pending_batches", c->pending_count.load(), "seq",
      static_cast<long long>(c->seq), "cycles", c->cycles.load(), "python_returns", c->returns.load(), "spool_settled",
      c->spool_settled.load());
}

static PyObject* Batcher_get_inflight(BatcherObject* self, void*) {
  return PyLong_FromLongLong(self->core->inflight.load());
}

static PyObject* Batcher_get_host_native(BatcherObject* self, void*) { return PyBool_FromLong(self->core->host_native); }

static PyMethodDef Batcher_methods[] = {
    {"attach", reinterpret_cast<PyCFunction>(Batcher_attach), METH_O, "Send through this Producer (None: not connected)."},
    {"cycle", reinterpret_cast<PyCFunction>(Batcher_cycle), METH_NOARGS, "One sender cycle, GIL released."},
    {"run", reinterpret_cast<PyCFunction>(Batcher_run), METH_VARARGS,
     "Cycles, GIL released, until an event or interrupt needs Python or `seconds` have passed."},
    {"build", reinterpret_cast<PyCFunction>(Batcher_build), METH_NOARGS, "Build one batch; False if nothing to send."},
    {"take_message", reinterpret_cast<PyCFunction>(Batcher_take_message), METH_NOARGS,
     "The oldest built message, unsent: (bytes, ops, samples), or None."},
    {"enqueue", reinterpret_cast<PyCFunction>(Batcher_enqueue), METH_VARARGS,
     "Send this message (bytes, ops, samples[, spooled]) after those built before it."},
    {"send", reinterpret_cast<PyCFunction>(Batcher_send), METH_NOARGS,
     "Hand what waits to librdkafka now; True when nothing is left waiting."},
    {"set_spooling", reinterpret_cast<PyCFunction>(Batcher_set_spooling), METH_O,
     "True: cycles send only what is handed over, and run() returns when a cycle is due."},
    {"set_rescue", reinterpret_cast<PyCFunction>(Batcher_set_rescue), METH_O,
     "True: keep the bytes of batches a close purges (take_rescued)."},
    {"take_rescued", reinterpret_cast<PyCFunction>(Batcher_take_rescued), METH_NOARGS,
     "[(bytes, ops, samples)] of the batches a close purged."},
    {"drop_pending", reinterpret_cast<PyCFunction>(Batcher_drop_pending), METH_NOARGS,
     "Forget the built, unsent messages; returns their (ops, samples)."},
    {"pending", reinterpret_cast<PyCFunction>(Batcher_pending), METH_NOARGS, "(messages, ops, samples) built, unsent."},
    {"take_events", reinterpret_cast<PyCFunction>(Batcher_take_events), METH_NOARGS, nullptr},
    {"interrupt", reinterpret_cast<PyCFunction>(Batcher_interrupt), METH_NOARGS, "Make run() return soon."},
    {"clear_interrupt", reinterpret_cast<PyCFunction>(Batcher_clear_interrupt), METH_NOARGS, nullptr},
    {"add_undelivered", reinterpret_cast<PyCFunction>(Batcher_add_undelivered), METH_VARARGS, nullptr},
    {"set_down", reinterpret_cast<PyCFunction>(Batcher_set_down), METH_O, nullptr},
    {"stats", reinterpret_cast<PyCFunction>(Batcher_stats), METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

static PyGetSetDef Batcher_getset[] = {
    {"inflight_bytes", reinterpret_cast<getter>(Batcher_get_inflight), nullptr, nullptr, nullptr},
    {"host_native", reinterpret_cast<getter>(Batcher_get_host_native), nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject BatcherType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool init_batcher_type(PyObject* module) {
  BatcherType.tp_name = "profstream.producers._native.Batcher";
  BatcherType.tp_basicsize = sizeof(BatcherObject);
  BatcherType.tp_flags = Py_TPFLAGS_DEFAULT;
  BatcherType.tp_new = PyType_GenericNew;
  BatcherType.tp_init = reinterpret_cast<initproc>(Batcher_init);
  BatcherType.tp_dealloc = reinterpret_cast<destructor>(Batcher_dealloc);
  BatcherType.tp_methods = Batcher_methods;
  BatcherType.tp_getset = Batcher_getset;
  BatcherType.tp_doc = "Builds and sends the EventBatch messages of one Recorder without the GIL.";
  if (PyType_Ready(&BatcherType) < 0) return false;
  Py_INCREF(&BatcherType);
  return PyModule_AddObject(module, "Batcher", reinterpret_cast<PyObject*>(&BatcherType)) == 0;
}

}  // namespace ps
