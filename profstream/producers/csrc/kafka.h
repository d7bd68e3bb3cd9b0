// librdkafka, called without the GIL.
//
// The library is the one confluent-kafka ships and has already loaded into the process
// (profstream.producers.native finds its path); it is opened with dlopen and the few
// functions used here are declared below from librdkafka's stable C API (rdkafka.h), so
// building profstream needs no librdkafka headers and the build never pins a version.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

namespace ps {

extern "C" {
typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_topic_s rd_kafka_topic_t;
typedef struct rd_kafka_conf_s rd_kafka_conf_t;
typedef struct rd_kafka_topic_conf_s rd_kafka_topic_conf_t;
struct rd_kafka_metadata;
typedef struct rd_kafka_message_s {  // rdkafka.h, unchanged since 0.9
  int err;
  rd_kafka_topic_t* rkt;
  int32_t partition;
  void* payload;
  size_t len;
  void* key;
  size_t key_len;
  int64_t offset;
  void* _private;
} rd_kafka_message_t;
}

constexpr int RDK_PRODUCER = 0;
constexpr int RDK_CONF_OK = 0;
constexpr int32_t RDK_PARTITION_UA = -1;
constexpr int RDK_MSG_F_FREE = 0x1;
constexpr int RDK_PURGE_QUEUE = 0x1;
constexpr int RDK_PURGE_INFLIGHT = 0x2;
constexpr int ERR_QUEUE_FULL = -184;
constexpr int ERR_ALL_BROKERS_DOWN = -187;
constexpr int ERR_MSG_SIZE_TOO_LARGE = 10;
constexpr int ERR_PURGE_QUEUE = -152;     // purged before it was sent (close)
constexpr int ERR_PURGE_INFLIGHT = -151;  // purged while in flight (close)

struct RdKafka {
  bool loaded = false;
  std::string path;
  rd_kafka_conf_t* (*conf_new)();
  void (*conf_destroy)(rd_kafka_conf_t*);
  int (*conf_set)(rd_kafka_conf_t*, const char*, const char*, char*, size_t);
  void (*conf_set_dr_msg_cb)(rd_kafka_conf_t*, void (*)(rd_kafka_t*, const rd_kafka_message_t*, void*));
  void (*conf_set_error_cb)(rd_kafka_conf_t*, void (*)(rd_kafka_t*, int, const char*, void*));
  void (*conf_set_log_cb)(rd_kafka_conf_t*, void (*)(const rd_kafka_t*, int, const char*, const char*));
  void (*conf_set_opaque)(rd_kafka_conf_t*, void*);
  rd_kafka_t* (*kafka_new)(int, rd_kafka_conf_t*, char*, size_t);
  void (*destroy)(rd_kafka_t*);
  void* (*opaque)(const rd_kafka_t*);
  int (*poll)(rd_kafka_t*, int);
  int (*flush)(rd_kafka_t*, int);
  int (*purge)(rd_kafka_t*, int);
  int (*outq_len)(rd_kafka_t*);
  rd_kafka_topic_t* (*topic_new)(rd_kafka_t*, const char*, rd_kafka_topic_conf_t*);
  void (*topic_destroy)(rd_kafka_topic_t*);
  int (*produce)(rd_kafka_topic_t*, int32_t, int, void*, size_t, const void*, size_t, void*);
  int (*last_error)();
  const char* (*err2str)(int);
  int (*metadata)(rd_kafka_t*, int, rd_kafka_topic_t*, const struct rd_kafka_metadata**, int);
  void (*metadata_destroy)(const struct rd_kafka_metadata*);
  const char* (*version_str)();
};

extern RdKafka rdk;

// Open librdkafka at `path`; false with `error` set when it cannot be used.
bool load_rdkafka(const char* path, std::string* error);

// What one message in flight carries (the message opaque).
struct MsgInfo {
  int64_t size;
  int64_t ops;
  int64_t samples;
  int64_t sent_at_ns;  // monotonic
  bool spooled;        // read back from the disk spool: it stays there until acknowledged
};

// Who hears of deliveries and client errors: the Batcher. Called on the thread that
// polls, without the GIL.
class DeliverySink {
 public:
  virtual ~DeliverySink() = default;
  // `payload`, `len`: the message's bytes, valid during the call only
  virtual void delivered(int err, const char* reason, MsgInfo* info, const void* payload, size_t len) = 0;
  virtual void client_error(int err, const char* reason) = 0;
};

struct ProducerObject {
  PyObject_HEAD
  rd_kafka_t* rk;
  rd_kafka_topic_t* rkt;
  PyObject* sink_owner;  // the Batcher (strong; dropped at close)
  DeliverySink* sink;
  std::string* key;
  std::mutex* log_mu;
  std::deque<std::string>* logs;  // librdkafka's log lines, bounded, for Python to forward
};

extern PyTypeObject ProducerType;

// Queue one message (payload malloc'ed; librdkafka frees it once accepted). 0, or the
// error code with the payload still the caller's.
int produce(ProducerObject* p, char* payload, size_t len, MsgInfo* info);

bool init_kafka_types(PyObject* module);

}  // namespace ps
