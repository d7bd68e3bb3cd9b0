// Columns of one EventBatch section, recorded on the training thread and read by the
// sender without the GIL.
//
// A Store is a chain of preallocated blocks of rows, one writer (the thread that holds
// the GIL and records) and one reader (the sender, GIL released). The writer fills a
// row's columns and then publishes it with a release store of the block's row count; the
// reader takes the rows it sees with an acquire load, so it never reads a half-written
// row and never takes a lock per row. Blocks the reader has finished go to a free list
// (a mutex: once per block) and the writer reuses them.
//
// Dictionary columns (op names, op types, queue names) hold codes into the block's own
// dictionary: the writer maps each str to a code with a Python dict (GIL held) and keeps
// the UTF-8 bytes of each new string (a pointer into the str object, which the dict keeps
// alive) in `entries`; the reader reads those bytes without the GIL. The encoder gives
// each batch its own codes, in order of first appearance (as schema.batch does).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace ps {

enum ColType : uint8_t { I32 = 0, I64 = 1, U8 = 2, F64 = 3 };

constexpr size_t MAX_COLUMNS = 16;  // of one section

inline int width_of(ColType t) { return t == I32 ? 4 : t == U8 ? 1 : 8; }

struct StrRef {
  const char* data;
  Py_ssize_t size;
};

struct ColumnSpec {
  std::string name;
  ColType type = I64;
  int width = 8;
  int dict = -1;            // index of the section's dictionary this column codes into, -1: none
  bool has_fill = false;    // a row that gives no value gets `fill`
  int64_t fill_int = 0;
  double fill_float = 0.0;
  PyObject* value_names = nullptr;  // {str: int} for a column that also takes names (op kinds)
  int64_t unknown_name = 0;         // the value of a name not in value_names
};

struct DictSpec {
  std::string field;  // the header field that carries it (op_names, op_types, queue_names)
  int column = -1;
  bool blob = false;  // wire form: NUL-terminated names in one bytes value (else array<string>)
};

struct SectionSpec {
  std::string name;
  std::vector<ColumnSpec> cols;
  std::vector<DictSpec> dicts;
  int64_t block_rows = 1024;
  int64_t max_rows = 0;  // bound on buffered rows: more are dropped and counted
};

struct Dictionary {
  PyObject* map = nullptr;   // str -> int (writer only, GIL held)
  PyObject* keep = nullptr;  // list of bytes objects that entries point into (converted names)
  StrRef* entries = nullptr; // capacity entries, published with the rows that use them
  int32_t size = 0;          // writer side
};

struct Block {
  int64_t capacity = 0;
  uint32_t epoch = 0;  // unique per store and per use of the block (writer): what IdEntry checks
  std::atomic<int64_t> count{0};
  std::atomic<Block*> next{nullptr};
  std::vector<char*> cols;
  std::vector<Dictionary> dicts;
};

// The last code given to a str object, by object identity: a hit skips the dictionary's
// hash lookup (and the compare of an equal string that is another object). Two-way set
// associative, the way replaced is the older one; each entry holds a reference to its
// str, so the address cannot be reused by another object while the entry stands. Writer
// only (GIL held).
struct IdEntry {
  PyObject* obj = nullptr;
  uint32_t epoch = 0;  // of the block the code belongs to
  int32_t code = -1;
};
constexpr size_t ID_SLOTS = 4096;  // per dictionary, in sets of two ways

// One run of rows of one block: [from, to).
struct Segment {
  Block* block;
  int64_t from;
  int64_t to;
};

class Store {
 public:
  // GIL held (construction and destruction).
  Store(const SectionSpec& spec);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const SectionSpec& spec;

  // -- writer (GIL held) ------------------------------------------------------------
  bool full() const { return written_.load(std::memory_order_relaxed) - consumed_.load(std::memory_order_acquire) >= spec.max_rows; }
  int64_t room() const { return spec.max_rows - buffered(); }
  // The block the next row goes into, and its index there; nullptr when out of memory.
  Block* slot(int64_t* row);
  // The code of `value` (a str) in the block's dictionary `d`, added when new; -1 and a
  // Python error set when it cannot be encoded.
  int32_t code(Block* b, int d, PyObject* value);
  // code(), through the identity cache for exact str objects.
  int32_t cached_code(Block* b, int d, PyObject* value) {
    if (!PyUnicode_CheckExact(value)) return code(b, d, value);
    IdEntry* set = id_set(d, value);  // two ways: set[0], set[1]
    for (int w = 0; w < 2; ++w)
      if (set[w].obj == value && set[w].epoch == b->epoch) return set[w].code;
    int32_t c = code(b, d, value);
    if (c >= 0) remember(set, b, value, c);
    return c;
  }
  // Where cached_code will look for `value` (a row or two ahead: add_rows prefetches it).
  IdEntry* id_set(int d, PyObject* value) {
    uintptr_t h = (reinterpret_cast<uintptr_t>(value) >> 4) * 0x9E3779B97F4A7C15ull;
    return &ids_[d][(h >> 40) & (ID_SLOTS - 2)];
  }
  void publish(Block* b, int64_t row) { publish_rows(b, row + 1, 1); }
  // Rows up to `count` of block `b` are written, `added` of them since the last publish.
  void publish_rows(Block* b, int64_t count, int64_t added) {
    b->count.store(count, std::memory_order_release);
    written_.store(written_.load(std::memory_order_relaxed) + added, std::memory_order_release);
  }

  // -- reader (no GIL) ----------------------------------------------------------------
  // Up to `limit` rows not yet consumed, oldest first, as segments; returns the count.
  int64_t collect(int64_t limit, std::vector<Segment>& out) const;
  // The first `n` rows (no more than collect() returned) are sent: hand their blocks back.
  void consume(int64_t n);

  // -- either -------------------------------------------------------------------------
  int64_t buffered() const { return written_.load(std::memory_order_acquire) - consumed_.load(std::memory_order_acquire); }
  int64_t written() const { return written_.load(std::memory_order_acquire); }

 private:
  Block* allocate();
  void reset(Block* b);  // GIL held
  void remember(IdEntry* set, Block* b, PyObject* value, int32_t code);
  uint32_t next_epoch();

  Block* tail_ = nullptr;  // writer
  Block* head_ = nullptr;  // reader
  int64_t read_pos_ = 0;   // reader
  std::atomic<int64_t> written_{0};
  std::atomic<int64_t> consumed_{0};
  std::mutex free_mu_;
  std::vector<Block*> free_;
  std::vector<Block*> all_;
  bool blob_nul_check_ = false;
  uint32_t epochs_ = 0;                    // writer
  std::vector<std::vector<IdEntry>> ids_;  // per dictionary (writer)
};

// Value conversion of one Python value for a column; false (no Python error left set)
// when it is not a valid value of the column's type.
bool to_int64(PyObject* v, int64_t* out);
bool to_column_int(const ColumnSpec& c, PyObject* v, int64_t* out, bool* unknown_name);
bool to_double(PyObject* v, double* out);
inline void write_int(char* col, int width, int64_t row, int64_t value) {
  switch (width) {
    case 1: {
      uint8_t x = static_cast<uint8_t>(value);
      std::memcpy(col + row, &x, 1);
      break;
    }
    case 4: {
      int32_t x = static_cast<int32_t>(value);
      std::memcpy(col + row * 4, &x, 4);
      break;
    }
    default:
      std::memcpy(col + row * 8, &value, 8);
  }
}

}  // namespace ps
