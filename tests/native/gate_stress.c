/* The native reader's gate under ThreadSanitizer (.ci/sanitize): gated reads opened or
 * cancelled from another thread at random moments while the caller finishes them (and
 * polls mlxs_staged); then an engine freed while a read is still gated. Each read is staged
 * before its gate opens; each record lands in its slot only once its gate opens, and never
 * once cancelled. Exit status 1 on any wrong outcome. */
#include <assert.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../mlx_streaming/core/io/engine.h"

enum { EXPERTS = 16, STRIDE = 1 << 16, SLOTS = 8, READS = 4, ROUNDS = 500 };

typedef struct {
  Engine *e;
  int go, delay_us;
} Opener;

static uint64_t no_hash(const void *d, size_t n) {
  (void)d, (void)n;
  return 0;
}

static void pause_us(int us) {
  struct timespec ts = {0, (long)us * 1000};
  nanosleep(&ts, NULL);
}

static void *open_later(void *arg) {
  Opener *o = arg;
  pause_us(o->delay_us);
  for (int k = 0; k < 20; k++) mlxs_staged(o->e); /* beside the workers: ThreadSanitizer */
  mlxs_open(o->e, o->go);
  return NULL;
}

static int write_file(const char *path) {
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  char *rec = malloc(STRIDE);
  for (int e = 0; fd >= 0 && e < EXPERTS; e++) {
    memset(rec, e + 1, STRIDE);
    if (write(fd, rec, STRIDE) != STRIDE) fd = -1;
  }
  free(rec);
  return fd;
}

/* Slot ``s`` holds ``want`` in every byte. */
static int holds(const char *dst, int s, char want) {
  for (int k = 0; k < STRIDE; k++)
    if (dst[(size_t)s * STRIDE + k] != want) return 0;
  return 1;
}

static int round_trip(Engine *e, char *dst, int it) {
  int32_t experts[READS], slots[READS], status[READS];
  char err[256];
  memset(dst, 0, (size_t)SLOTS * STRIDE);
  for (int i = 0; i < READS; i++) experts[i] = (it + 3 * i) % EXPERTS, slots[i] = 2 * i;
  Opener o = {e, rand() % 2, rand() % 200};
  if (mlxs_start(e, 0, READS, experts, slots, 0, 1, err, sizeof err)) {
    fprintf(stderr, "start: %s\n", err);
    return 1;
  }
  pause_us(rand() % 100);
  int bad = 0;
  /* every other round: staged (every piece read, copies held) within 10 s, then opened;
   * else opened or cancelled while the workers may still read */
  for (int k = 0; it % 2 && !mlxs_staged(e) && k < 1000000; k++) pause_us(10);
  bad += it % 2 && !mlxs_staged(e);
  for (int s = 0; s < SLOTS; s++) bad += !holds(dst, s, 0); /* nothing copied yet */
  pthread_t t;
  pthread_create(&t, NULL, open_later, &o);
  int rc = mlxs_finish(e, status, NULL, err, sizeof err);
  pthread_join(t, NULL);
  bad += o.go ? rc != ST_OK : rc != ST_GATE;
  for (int i = 0; i < READS; i++) bad += !holds(dst, slots[i], o.go ? (char)(experts[i] + 1) : 0);
  if (bad) fprintf(stderr, "round %d (open %d): rc %d, %d wrong\n", it, o.go, rc, bad);
  return bad;
}

int main(void) {
  char path[] = "/tmp/mlxs-gate-stress-XXXXXX", err[256];
  int tmp = mkstemp(path);
  int fd = tmp < 0 ? -1 : write_file(path);
  assert(fd >= 0);
  char *staging = aligned_alloc(4096, (size_t)READS * STRIDE);
  char *dst = calloc(SLOTS, STRIDE);
  Engine *e = mlxs_new(1, 3, READS, STRIDE, STRIDE / 4, staging, NULL, NULL, NULL, (void *)no_hash,
                       err, sizeof err);
  assert(e);
  int64_t off = 0, nbytes = STRIDE, row = STRIDE;
  char *part[1] = {dst};
  int rc = mlxs_layer(e, 0, fd, STRIDE, STRIDE, EXPERTS, SLOTS, 1, &off, &nbytes, part, &row, NULL,
                      NULL, err, sizeof err);
  assert(rc == 0);
  int bad = 0;
  for (int it = 0; it < ROUNDS; it++) bad += round_trip(e, dst, it);
  int32_t experts[READS] = {1, 2, 3, 4}, slots[READS] = {0, 2, 4, 6};
  memset(dst, 0, (size_t)SLOTS * STRIDE);
  rc = mlxs_start(e, 0, READS, experts, slots, 0, 1, err, sizeof err);
  mlxs_free(e); /* still gated: cancelled, then joined */
  for (int s = 0; s < SLOTS; s++) bad += !holds(dst, s, 0);
  printf("gate stress: %d rounds, %d wrong\n", ROUNDS, bad + (rc != 0));
  close(fd), unlink(path), free(staging), free(dst);
  return bad || rc != 0;
}
