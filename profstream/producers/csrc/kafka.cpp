// The Producer type: one librdkafka producer handle whose deliveries are heard natively.
#include "kafka.h"

#include <dlfcn.h>

#include <cstring>

namespace ps {

RdKafka rdk;

namespace {

template <typename F>
bool sym(void* lib, const char* name, F* out, std::string* error) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    *error = std::string("librdkafka lacks ") + name;
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

constexpr size_t MAX_LOG_LINES = 200;

ProducerObject* from_rk(const rd_kafka_t* rk) { return static_cast<ProducerObject*>(rdk.opaque(rk)); }

void on_delivery(rd_kafka_t*, const rd_kafka_message_t* msg, void* opaque) {
  auto* self = static_cast<ProducerObject*>(opaque);
  auto* info = static_cast<MsgInfo*>(msg->_private);
  if (info == nullptr) return;
  if (self->sink != nullptr)
    self->sink->delivered(msg->err, msg->err ? rdk.err2str(msg->err) : "", info, msg->payload, msg->len);
  delete info;
}

void on_error(rd_kafka_t*, int err, const char* reason, void* opaque) {
  auto* self = static_cast<ProducerObject*>(opaque);
  if (self->sink != nullptr) self->sink->client_error(err, reason ? reason : "");
}

void on_log(const rd_kafka_t* rk, int level, const char* fac, const char* buf) {
  ProducerObject* self = from_rk(rk);
  if (self == nullptr) return;
  std::lock_guard<std::mutex> g(*self->log_mu);
  if (self->logs->size() >= MAX_LOG_LINES) self->logs->pop_front();
  self->logs->push_back(std::to_string(level) + " " + (fac ? fac : "") + " " + (buf ? buf : ""));
}

void destroy_handle(ProducerObject* self) {
  if (self->rkt != nullptr) rdk.topic_destroy(self->rkt);
  if (self->rk != nullptr) rdk.destroy(self->rk);
  self->rkt = nullptr;
  self->rk = nullptr;
}

}  // namespace

bool load_rdkafka(const char* path, std::string* error) {
  if (rdk.loaded) return true;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    *error = why ? why : "dlopen failed";
    return false;
  }
  bool ok = sym(lib, "rd_kafka_conf_new", &rdk.conf_new, error) &&
            sym(lib, "rd_kafka_conf_destroy", &rdk.conf_destroy, error) &&
            sym(lib, "rd_kafka_conf_set", &rdk.conf_set, error) &&
            sym(lib, "rd_kafka_conf_set_dr_msg_cb", &rdk.conf_set_dr_msg_cb, error) &&
            sym(lib, "rd_kafka_conf_set_error_cb", &rdk.conf_set_error_cb, error) &&
            sym(lib, "rd_kafka_conf_set_log_cb", &rdk.conf_set_log_cb, error) &&
            sym(lib, "rd_kafka_conf_set_opaque", &rdk.conf_set_opaque, error) &&
            sym(lib, "rd_kafka_new", &rdk.kafka_new, error) && sym(lib, "rd_kafka_destroy", &rdk.destroy, error) &&
            sym(lib, "rd_kafka_opaque", &rdk.opaque, error) && sym(lib, "rd_kafka_poll", &rdk.poll, error) &&
            sym(lib, "rd_kafka_flush", &rdk.flush, error) && sym(lib, "rd_kafka_purge", &rdk.purge, error) &&
            sym(lib, "rd_kafka_outq_len", &rdk.outq_len, error) &&
            sym(lib, "rd_kafka_topic_new", &rdk.topic_new, error) &&
            sym(lib, "rd_kafka_topic_destroy", &rdk.topic_destroy, error) &&
            sym(lib, "rd_kafka_produce", &rdk.produce, error) &&
            sym(lib, "rd_kafka_last_error", &rdk.last_error, error) &&
            sym(lib, "rd_kafka_err2str", &rdk.err2str, error) && sym(lib, "rd_kafka_metadata", &rdk.metadata, error) &&
            sym(lib, "rd_kafka_metadata_destroy", &rdk.metadata_destroy, error) &&
            sym(lib, "rd_kafka_version_str", &rdk.version_str, error);
  if (!ok) return false;  // the library stays open: dlclose of a library in use is not worth it
  rdk.path = path;
  rdk.loaded = true;
  return true;
}

int produce(ProducerObject* p, char* payload, size_t len, MsgInfo* info) {
  if (p->rkt == nullptr) return -172;  // _STATE: closed
  if (rdk.produce(p->rkt, RDK_PARTITION_UA, RDK_MSG_F_FREE, payload, len, p->key->data(), p->key->size(), info) == -1)
    return rdk.last_error();
  return 0;
}

// Producer(config: dict[str, str], topic: str, key: bytes, sink: Batcher, connect_timeout_ms: int)
// Raises ConnectionError when no broker answers a metadata request within the timeout.
DeliverySink* batcher_sink(PyObject* obj);  // batcher.cpp

static int Producer_init(ProducerObject* self, PyObject* args, PyObject*) {
  PyObject *config, *sink;
  const char* topic;
  const char* key;
  Py_ssize_t key_len;
  int timeout_ms;
  if (!PyArg_ParseTuple(args, "O!sy#Oi", &PyDict_Type, &config, &topic, &key, &key_len, &sink, &timeout_ms))
    return -1;
  if (!rdk.loaded) {
    PyErr_SetString(PyExc_RuntimeError, "librdkafka is not loaded");
    return -1;
  }
  DeliverySink* target = batcher_sink(sink);
  if (target == nullptr) return -1;
  if (self->rk != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Producer is already initialized");
    return -1;
  }
  rd_kafka_conf_t* conf = rdk.conf_new();
  char err[512];
  PyObject *name, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(config, &pos, &name, &value)) {
    const char* n = PyUnicode_AsUTF8(name);
    const char* v = PyUnicode_AsUTF8(value);
    if (n == nullptr || v == nullptr) {
      rdk.conf_destroy(conf);
      return -1;
    }
    if (rdk.conf_set(conf, n, v, err, sizeof err) != RDK_CONF_OK) {
      rdk.conf_destroy(conf);
      PyErr_Format(PyExc_ValueError, "librdkafka setting %s=%s: %s", n, v, err);
      return -1;
    }
  }
  self->key = new std::string(key, key_len);
  self->log_mu = new std::mutex();
  self->logs = new std::deque<std::string>();
  Py_INCREF(sink);
  self->sink_owner = sink;
  self->sink = target;
  rdk.conf_set_dr_msg_cb(conf, on_delivery);
  rdk.conf_set_error_cb(conf, on_error);
  rdk.conf_set_log_cb(conf, on_log);
  rdk.conf_set_opaque(conf, self);
  rd_kafka_t* rk = rdk.kafka_new(RDK_PRODUCER, conf, err, sizeof err);  // takes conf, also on failure
  if (rk == nullptr) {
    PyErr_Format(PyExc_ValueError, "librdkafka producer: %s", err);
    return -1;
  }
  self->rk = rk;
  self->rkt = rdk.topic_new(rk, topic, nullptr);
  if (self->rkt == nullptr) {
    destroy_handle(self);
    PyErr_Format(PyExc_ValueError, "librdkafka topic %s: %s", topic, rdk.err2str(rdk.last_error()));
    return -1;
  }
  int got;
  const struct rd_kafka_metadata* md = nullptr;
  Py_BEGIN_ALLOW_THREADS got = rdk.metadata(rk, 0, nullptr, &md, timeout_ms);
  if (md != nullptr) rdk.metadata_destroy(md);
  Py_END_ALLOW_THREADS if (got != 0) {
    const char* why = rdk.err2str(got);
    Py_BEGIN_ALLOW_THREADS rdk.purge(rk, RDK_PURGE_QUEUE | RDK_PURGE_INFLIGHT);
    destroy_handle(self);
    Py_END_ALLOW_THREADS PyErr_Format(PyExc_ConnectionError, "no Kafka broker answered: %s", why);
    return -1;
  }
  return 0;
}

static void Producer_dealloc(ProducerObject* self) {
  if (self->rk != nullptr) {
    Py_BEGIN_ALLOW_THREADS destroy_handle(self);
    Py_END_ALLOW_THREADS
  }
  Py_XDECREF(self->sink_owner);
  delete self->key;
  delete self->log_mu;
  delete self->logs;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static PyObject* Producer_poll(ProducerObject* self, PyObject*) {
  if (self->rk != nullptr) {
    Py_BEGIN_ALLOW_THREADS rdk.poll(self->rk, 0);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static bool flush_for(ProducerObject* self, double timeout) {
  int err;
  int ms = timeout <= 0 ? 0 : static_cast<int>(timeout * 1000);
  Py_BEGIN_ALLOW_THREADS err = rdk.flush(self->rk, ms);
  if (err == 0 && rdk.outq_len(self->rk) > 0) err = 1;
  Py_END_ALLOW_THREADS return err == 0;
}

static const char* timeout_kw[] = {"timeout", nullptr};

static PyObject* Producer_flush(ProducerObject* self, PyObject* args, PyObject* kwds) {
  double timeout;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "d", const_cast<char**>(timeout_kw), &timeout)) return nullptr;
  if (self->rk == nullptr) Py_RETURN_TRUE;
  return PyBool_FromLong(flush_for(self, timeout));
}

// close(timeout): flush for up to timeout s, then purge what is left (its reports count
// it as undelivered) and stop librdkafka's threads. True if everything was delivered.
static PyObject* Producer_close(ProducerObject* self, PyObject* args, PyObject* kwds) {
  double timeout;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "d", const_cast<char**>(timeout_kw), &timeout)) return nullptr;
  if (self->rk == nullptr) Py_RETURN_TRUE;
  bool delivered = flush_for(self, timeout);
  Py_BEGIN_ALLOW_THREADS if (!delivered) {
    rdk.purge(self->rk, RDK_PURGE_QUEUE | RDK_PURGE_INFLIGHT);
    rdk.poll(self->rk, 0);
  }
  destroy_handle(self);
  Py_END_ALLOW_THREADS self->sink = nullptr;
  Py_CLEAR(self->sink_owner);
  return PyBool_FromLong(delivered);
}

static PyObject* Producer_take_logs(ProducerObject* self, PyObject*) {
  std::deque<std::string> lines;
  {
    std::lock_guard<std::mutex> g(*self->log_mu);
    lines.swap(*self->logs);
  }
  PyObject* out = PyList_New(0);
  for (const std::string& s : lines) {
    PyObject* line = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (line == nullptr || PyList_Append(out, line) < 0) {
      Py_XDECREF(line);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(line);
  }
  return out;
}

static PyObject* Producer_queued(ProducerObject* self, PyObject*) {
  return PyLong_FromLong(self->rk != nullptr ? rdk.outq_len(self->rk) : 0);
}

static PyMethodDef Producer_methods[] = {
    {"poll", reinterpret_cast<PyCFunction>(Producer_poll), METH_NOARGS,
     "Serve the delivery reports and errors that are due, without waiting."},
    {"flush", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Producer_flush)), METH_VARARGS | METH_KEYWORDS,
     "Wait up to timeout s for every queued message's report; True if none is left."},
    {"close", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Producer_close)), METH_VARARGS | METH_KEYWORDS,
     "Flush for up to timeout s, purge what is left, stop librdkafka. True if all was delivered."},
    {"take_logs", reinterpret_cast<PyCFunction>(Producer_take_logs), METH_NOARGS, nullptr},
    {"queued", reinterpret_cast<PyCFunction>(Producer_queued), METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject ProducerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

static PyObject* load_librdkafka(PyObject*, PyObject* args) {
  const char* path;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  std::string error;
  if (!load_rdkafka(path, &error)) {
    PyErr_Format(PyExc_OSError, "%s: %s", path, error.c_str());
    return nullptr;
  }
  return PyUnicode_FromString(rdk.version_str());
}

static PyMethodDef kafka_functions[] = {
    {"load_librdkafka", load_librdkafka, METH_VARARGS, "Open librdkafka at a path; returns its version."},
    {nullptr, nullptr, 0, nullptr}};

bool init_kafka_types(PyObject* module) {
  ProducerType.tp_name = "profstream.producers._native.Producer";
  ProducerType.tp_basicsize = sizeof(ProducerObject);
  ProducerType.tp_flags = Py_TPFLAGS_DEFAULT;
  ProducerType.tp_new = PyType_GenericNew;
  ProducerType.tp_init = reinterpret_cast<initproc>(Producer_init);
  ProducerType.tp_dealloc = reinterpret_cast<destructor>(Producer_dealloc);
  ProducerType.tp_methods = Producer_methods;
  ProducerType.tp_doc = "A librdkafka producer of one topic and key whose deliveries a Batcher hears natively.";
  if (PyType_Ready(&ProducerType) < 0) return false;
  Py_INCREF(&ProducerType);
  if (PyModule_AddObject(module, "Producer", reinterpret_cast<PyObject*>(&ProducerType)) < 0) return false;
  return PyModule_AddFunctions(module, kafka_functions) == 0;
}

}  // namespace ps
