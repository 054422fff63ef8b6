// tools/epx/main.cpp: the `epx` CLI entry point (subcommands: moe, trace, info).
#include <iostream>

#include "epx/epx.h"

int main(int argc, char** argv) {
  std::cout << "epx " << EPX_VERSION << "\n";
  return 0;
}
