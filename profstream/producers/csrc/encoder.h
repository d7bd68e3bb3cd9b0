// EventBatch messages (Avro single-object encoding) from recorded columns, without the GIL.
//
// The encoder knows no schema: profstream.producers.native turns the current EventBatch
// schema and schema.batch.SECTIONS into a plan, a list of steps in the schema's field
// order: constant bytes (the single-object header and the fields that never change for a
// Monitor, encoded once in Python by fastavro), the header fields that change per batch
// (by name), the dictionaries (op names as one NUL-terminated blob or an array of strings,
// as the schema says) and the sections (count, then each column's packed little-endian
// values as Avro bytes; the first n columns where the version written has only those). A
// new column or section in SECTIONS needs no change here.
#pragma once

#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <cstdlib>
#include <cstring>

#include "store.h"

namespace ps {

// An Avro long (zigzag varint) into out (at most 10 bytes); returns how many it took.
inline size_t zigzag_varint(int64_t v, char out[10]) {
  uint64_t z = (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
  size_t n = 0;
  while (z >= 0x80) {
    out[n++] = static_cast<char>((z & 0x7F) | 0x80);
    z >>= 7;
  }
  out[n++] = static_cast<char>(z);
  return n;
}

enum HeaderField { SEQ, SENT_NS, DROPPED_OPS, DROPPED_SAMPLES, COMPLETE_THROUGH, FILL_RATIO, SEND_LATENCY, N_FIELDS };

struct Header {
  int64_t seq = 0;
  int64_t sent_ns = 0;
  int64_t dropped_ops = 0;
  int64_t dropped_samples = 0;
  int64_t complete_through = INT64_MIN;  // INT64_MIN: null
  double fill_ratio = 0.0;
  int64_t send_latency_ns = -1;
};

// The rows of one section a batch takes.
struct Take {
  std::vector<Segment> segments;
  int64_t count = 0;
};

class Buffer {  // malloc'ed, so that librdkafka can free() what it is handed
 public:
  ~Buffer() { std::free(data_); }
  void clear() { size_ = 0; }
  void reserve(size_t n);
  void put(const void* p, size_t n) {
    reserve(size_ + n);
    std::memcpy(data_ + size_, p, n);
    size_ += n;
  }
  void put_long(int64_t v);
  char* release(size_t* size);  // the bytes, now the caller's
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t cap_ = 0;
};

class Encoder {
 public:
  // plan: [("raw", bytes) | ("long", field) | ("optional_long", field, null_branch, value_branch)
  //        | ("double", field) | ("names_blob" | "names_array", section, dictionary)
  //        | ("section", section[, columns])]
  bool parse(PyObject* plan, const std::vector<SectionSpec>& specs);  // a Python error set when false
  // One message of `takes` (one per section) and `h`, appended to `out`.
  void encode(const Header& h, const std::vector<Take>& takes, Buffer& out);
  // The columns of section `s` a message holds (all of them, unless its step says fewer).
  size_t columns(int s) const;
  // Whether its version has section `s` at all (a batch with rows of one it has not takes another plan).
  bool writes(int s) const;

 private:
  enum Kind { RAW, LONG, OPTIONAL_LONG, DOUBLE, NAMES_BLOB, NAMES_ARRAY, SECTION };
  struct Step {
    Kind kind;
    std::string raw;
    int field = -1;
    int section = -1;
    int dict = -1;
    int columns = -1;  // of a section: the first n columns (-1: all)
    int64_t null_branch = 0, value_branch = 1;
  };
  struct BatchDict {  // one dictionary of one batch: codes in order of first appearance
    std::vector<int32_t> codes;
    std::vector<StrRef> names;
  };
  void dictionaries(const std::vector<Take>& takes);
  void section(int s, size_t columns, const Take& take, Buffer& out);

  const std::vector<SectionSpec>* specs_ = nullptr;
  std::vector<Step> steps_;
  std::vector<std::vector<BatchDict>> dicts_;  // [section][dictionary]
  std::vector<int32_t> remap_;
  std::unordered_map<std::string_view, int32_t> seen_;
};

}  // namespace ps
