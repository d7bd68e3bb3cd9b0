#include "host.h"

#include <time.h>
#include <unistd.h>

#include <cstdio>

namespace ps {

namespace {

double seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

bool HostSampler::read_cpu(uint64_t t[10]) {
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return false;
  for (int i = 0; i < 10; ++i) t[i] = 0;
  // "cpu  user nice system idle iowait irq softirq steal guest guest_nice" (older kernels: fewer)
  int got = std::fscanf(f, "cpu %lu %lu %lu %lu %lu %lu %lu %lu %lu %lu", &t[0], &t[1], &t[2], &t[3], &t[4], &t[5],
                        &t[6], &t[7], &t[8], &t[9]);
  std::fclose(f);
  return got >= 4;
}

bool HostSampler::start() { return read_cpu(last_); }

bool HostSampler::sample(HostSample* out) {
  uint64_t now[10];
  if (!read_cpu(now)) return false;
  // as psutil.cpu_times_percent: guest times are already in user and nice
  auto total = [](const uint64_t* t) {
    uint64_t s = 0;
    for (int i = 0; i < 8; ++i) s += t[i];
    return s;
  };
  double all = static_cast<double>(total(now)) - static_cast<double>(total(last_));
  auto share = [&](int i) {
    double d = static_cast<double>(now[i]) - static_cast<double>(last_[i]);
    double r = all > 0 ? d / all : 0.0;
    return r < 0 ? 0.0 : r > 1 ? 1.0 : r;
  };
  out->cpu_user = share(0);
  out->cpu_system = share(2);
  out->cpu_idle = share(3);
  out->cpu_iowait = share(4);
  for (int i = 0; i < 10; ++i) last_[i] = now[i];
  // as psutil.Process.cpu_percent(interval=None): 0 the first time
  double wall = seconds(CLOCK_MONOTONIC), proc = seconds(CLOCK_PROCESS_CPUTIME_ID);
  out->process_cpu = have_proc_ && wall > last_wall_ ? (proc - last_proc_) / (wall - last_wall_) : 0.0;
  last_wall_ = wall;
  last_proc_ = proc;
  have_proc_ = true;
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  out->rss_bytes = static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  out->ts_ns = static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
  return true;
}

}  // namespace ps
