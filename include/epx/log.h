// epx/log.h: logging through spdlog, with the level from Config::log_level (EPX_LOG_LEVEL).
#pragma once

#include <string>

namespace epx::log {
void set_level(const std::string& level);  ///< trace|debug|info|warn|error|off; throws InvalidArgument
void debug(const std::string& msg);
void info(const std::string& msg);
void warn(const std::string& msg);
void error(const std::string& msg);
}  // namespace epx::log
