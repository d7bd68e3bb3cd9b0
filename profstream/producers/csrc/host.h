// Host samples (CPU shares of the machine and of this process, RSS) read from /proc, so
// that the sender takes them without the GIL; psutil's figures, without psutil.
#pragma once

#include <cstdint>

namespace ps {

struct HostSample {
  int64_t ts_ns;
  double cpu_user, cpu_system, cpu_idle, cpu_iowait;  // shares of all cores since the last sample
  double process_cpu;                                 // this process's CPU per second of wall, since the last
  int64_t rss_bytes;
};

class HostSampler {
 public:
  bool start();  // false where /proc/stat cannot be read (the sender then samples with psutil)
  bool sample(HostSample* out);

 private:
  bool read_cpu(uint64_t t[10]);
  uint64_t last_[10] = {};
  double last_wall_ = 0, last_proc_ = 0;
  bool have_proc_ = false;
};

}  // namespace ps
