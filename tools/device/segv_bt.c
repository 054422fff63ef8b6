// tools/device/segv_bt.c: LD_PRELOAD helper that prints the native stack of a fatal signal (the
// device image has no gdb). Each frame as file+offset (and the nearest exported symbol), so that
// `addr2line -f -C -i -e <file> <offset>` names the source line of a RelWithDebInfo build.
//   cc -shared -fPIC -O1 -o /tmp/segv_bt.so tools/device/segv_bt.c -ldl
//   LD_PRELOAD=/tmp/segv_bt.so python3 ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void report(const char* tag, void* pc) {
  Dl_info i;
  char buf[768];
  int n;
  if (dladdr(pc, &i) && i.dli_fname) {
    n = snprintf(buf, sizeof buf, "segv_bt %s %p %s +0x%lx %s+0x%lx\n", tag, pc, i.dli_fname,
                 (unsigned long)((char*)pc - (char*)i.dli_fbase), i.dli_sname ? i.dli_sname : "?",
                 i.dli_saddr ? (unsigned long)((char*)pc - (char*)i.dli_saddr) : 0UL);
  } else {
    n = snprintf(buf, sizeof buf, "segv_bt %s %p ?\n", tag, pc);
  }
  if (n > 0) (void)!write(2, buf, (size_t)(n < (int)sizeof buf ? n : (int)sizeof buf - 1));
}

static void handler(int sig, siginfo_t* si, void* ctx) {
  ucontext_t* uc = (ucontext_t*)ctx;
  char buf[256];
  int n = snprintf(buf, sizeof buf, "segv_bt === signal %d at address %p in pid %d\n", sig, si->si_addr, (int)getpid());
  (void)!write(2, buf, (size_t)n);
  report("pc", (void*)uc->uc_mcontext.gregs[REG_RIP]);
  void* frames[64];
  int k = backtrace(frames, 64);
  for (int j = 0; j < k; ++j) report("frame", frames[j]);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void segv_bt_init(void) {
  static char alt[1 << 16];
  stack_t ss;
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  ss.ss_flags = 0;
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGILL, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
}
