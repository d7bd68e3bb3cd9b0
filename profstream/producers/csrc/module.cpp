// profstream.producers._native: the Monitor's recording, batching and sending without the
// GIL (see profstream/producers/native.py, which loads it and falls back to Python).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>

namespace ps {
bool init_recorder_types(PyObject* module);
bool init_batcher_type(PyObject* module);
bool init_kafka_types(PyObject* module);
bool init_reader_type(PyObject* module);
bool init_kernels(PyObject* module);
}  // namespace ps

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The Monitor's hot path, compiled: Recorder (columns the training thread fills), Batcher (EventBatch "
    "messages built and sent without the GIL), Producer (librdkafka, opened at run time) and the processors' "
    "compiled parts: BodyReader (EventBatch bodies) and figure kernels (kind_overlap, sums_by_code).",
    -1, nullptr};

PyMODINIT_FUNC PyInit__native(void) {
  const uint16_t probe = 1;
  unsigned char first;
  std::memcpy(&first, &probe, 1);
  if (first != 1) {  // the columns are packed as they lie in memory: the wire wants little-endian
    PyErr_SetString(PyExc_ImportError, "the native Monitor needs a little-endian machine");
    return nullptr;
  }
  PyObject* m = PyModule_Create(&native_module);
  if (m == nullptr) return nullptr;
  if (!ps::init_recorder_types(m) || !ps::init_batcher_type(m) || !ps::init_kafka_types(m) ||
      !ps::init_reader_type(m) || !ps::init_kernels(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
