// Timing of host code for the CPU benchmarks (device code times itself with events).
#pragma once

#include <time.h>

#include <chrono>

namespace twell::cli {

// Milliseconds that fn() took, on the monotonic clock.
template <typename Fn>
double wall_ms(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// CPU time of the calling thread spent in fn(), in milliseconds. Equal to the wall time on an idle
// machine when all the work runs on this thread (one thread); on a shared machine it leaves out
// the time the thread waited for a core.
template <typename Fn>
double thread_cpu_ms(Fn&& fn) {
  auto now_ms = [] {
    timespec time;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &time);
    return static_cast<double>(time.tv_sec) * 1e3 + static_cast<double>(time.tv_nsec) * 1e-6;
  };
  const double start = now_ms();
  fn();
  return now_ms() - start;
}

}  // namespace twell::cli
