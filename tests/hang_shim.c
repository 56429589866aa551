/* The native half of tests/hungmount.py's hung mount: pread() of a file under $TEST_HANG_UNDER waits
 * while $TEST_HANG_UNDER/HANG exists, as os.preadv does through the mount's sitecustomize, so that the
 * reads the native layer makes itself (the start-up staging: native/filestream.c) hang too. Loaded
 * into the worker process with LD_PRELOAD; built by tests/hungmount.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);

static void wait_while_hung(int fd) {
  const char *root = getenv("TEST_HANG_UNDER");
  const char *seen = getenv("TEST_HANG_SEEN");
  char link[64], path[4096], gate[4096], mark[4096];
  if (root == NULL || *root == '\0') return;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return;
  path[n] = '\0';
  if (strncmp(path, root, strlen(root)) != 0) return;
  snprintf(gate, sizeof gate, "%s/HANG", root);
  if (access(gate, F_OK) != 0) return;
  if (seen != NULL) {
    snprintf(mark, sizeof mark, "%s/hung", seen);
    int m = open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (m >= 0) close(m);
  }
  struct timespec tick = {0, 20 * 1000 * 1000};
  while (access(gate, F_OK) == 0) nanosleep(&tick, NULL);
}

ssize_t pread(int fd, void *buf, size_t count, off_t offset) {
  static pread_fn real;
  if (real == NULL) real = (pread_fn)dlsym(RTLD_NEXT, "pread");
  wait_while_hung(fd);
  return real(fd, buf, count, offset);
}

ssize_t pread64(int fd, void *buf, size_t count, off_t offset) {
  static pread_fn real;
  if (real == NULL) real = (pread_fn)dlsym(RTLD_NEXT, "pread64");
  wait_while_hung(fd);
  return real(fd, buf, count, offset);
}
