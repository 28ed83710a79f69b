#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

namespace twell::cli {

Progress::Progress(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(std::max<int64_t>(total, 1)),
      enabled_(isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() {
  if (drawn_) std::fputc('\n', stderr);
}

void Progress::update(int64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  done = std::clamp<int64_t>(done, 0, total_);
  if (done < total_ && drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  drawn_ = true;
  constexpr int kWidth = 30;
  const double fraction = static_cast<double>(done) / static_cast<double>(total_);
  const int filled = static_cast<int>(fraction * kWidth);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  std::string bar(filled, '#');
  bar.resize(kWidth, ' ');
  std::fprintf(stderr, "\r%s [%s] %3d%% %lld/%lld %s, %.1f s", label_.c_str(), bar.c_str(),
               static_cast<int>(fraction * 100), static_cast<long long>(done), static_cast<long long>(total_),
               unit_.c_str(), elapsed);
  if (done > 0 && done < total_) std::fprintf(stderr, ", %.0f s left  ", elapsed * (1 - fraction) / fraction);
  else std::fprintf(stderr, "            ");
  std::fflush(stderr);
}

}  // namespace twell::cli
