#include "epx/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "epx/error.h"

namespace epx::log {
static std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto lg = spdlog::stderr_color_mt("epx");
    lg->set_pattern("[epx %L %H:%M:%S.%e] %v");
    lg->set_level(spdlog::level::warn);
    return lg;
  }();
  return l;
}
void set_level(const std::string& level) {
  auto lv = spdlog::level::from_str(level);
  require_arg("log.set_level", "level", level, lv != spdlog::level::off || level == "off",
              "must be one of trace, debug, info, warn, error, off");
  logger()->set_level(lv);
}
void debug(const std::string& m) { logger()->debug(m); }
void info(const std::string& m) { logger()->info(m); }
void warn(const std::string& m) { logger()->warn(m); }
void error(const std::string& m) { logger()->error(m); }
}  // namespace epx::log
