/* Thread-local error slot: native calls return a code and leave a message here for the binding. */
#include <stdarg.h>
#include <stdio.h>

#include "msv.h"

static __thread char g_msg[512];
static __thread int g_code;

int msv_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_msg, sizeof g_msg, fmt, ap);
  va_end(ap);
  g_code = code;
  return code;
}

const char *msv_last_error(void) { return g_msg; }
int msv_last_error_code(void) { return g_code; }
