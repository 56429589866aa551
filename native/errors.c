/* Thread-local error slot: native calls return a code and leave a message here for the binding,
 * and, for an error about one allocation, its tag, address and size as data, so that no caller has
 * to parse them back out of the message. */
#include <stdarg.h>
#include <stdio.h>

#include "msv.h"

static __thread char g_msg[512];
static __thread int g_code;
static __thread msv_error_detail g_detail;
static __thread int g_has_detail;

static void set_message(int code, const char *fmt, va_list ap) {
  vsnprintf(g_msg, sizeof g_msg, fmt, ap);
  g_code = code;
}

int msv_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(code, fmt, ap);
  va_end(ap);
  g_has_detail = 0;
  return code;
}

int msv_fail_integrity(const char *tag, uint64_t addr, uint64_t size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(MSV_E_INTEGRITY, fmt, ap);
  va_end(ap);
  snprintf(g_detail.tag, sizeof g_detail.tag, "%s", tag);
  g_detail.addr = addr;
  g_detail.size = size;
  g_has_detail = 1;
  return MSV_E_INTEGRITY;
}

const char *msv_last_error(void) { return g_msg; }
int msv_last_error_code(void) { return g_code; }
const msv_error_detail *msv_last_error_detail(void) { return g_has_detail ? &g_detail : NULL; }
