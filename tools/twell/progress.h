// A progress bar for the CLI's long loops, on stderr so that stdout stays the command's output
// (tables, CSV, generated text). Drawn only when stderr is a terminal: logs and pipes get no
// carriage-return noise.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace twell::cli {

class Progress {
 public:
  // `unit` names what is counted ("tokens", "steps"); `total` > 0.
  Progress(std::string label, int64_t total, std::string unit);
  ~Progress();  // ends the bar's line if one was drawn
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Sets the count done so far; redraws at most every 100 ms, and always at the end.
  void update(int64_t done);

 private:
  std::string label_, unit_;
  int64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace twell::cli
