/* The request ring under ThreadSanitizer (.ci/sanitize): poster threads ask for records of
 * two layers through their own entries (some requests bad) while the engine's ordinary
 * reads run beside them; each answer must carry the record asked for, or ST_ARGS for a
 * bad one, within 10 s (each record read in pieces by several readers). Then rings started
 * and stopped with requests in flight, and an engine freed with its ring running. Exit
 * status 1 on any wrong outcome. */
#include <assert.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../mlx_streaming/core/io/engine.h"

enum { EXPERTS = 16, STRIDE = 1 << 14, SLOTS = 4, POSTERS = 3, PER = 2, ROUNDS = 400 };

typedef struct {
  int32_t *words;
  char *staging;
  int first, bad;
  unsigned seed;
} Poster;

static uint64_t no_hash(const void *d, size_t n) {
  (void)d, (void)n;
  return 0;
}

static char fill(int layer, int e) { return (char)(layer * 32 + e + 1); }

static int write_file(const char *path, int layer) {
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  char *rec = malloc(STRIDE);
  for (int e = 0; fd >= 0 && e < EXPERTS; e++) {
    memset(rec, fill(layer, e), STRIDE);
    if (write(fd, rec, STRIDE) != STRIDE) fd = -1;
  }
  free(rec);
  return fd;
}

static int32_t *at(int32_t *words, int k, int w) { return &words[k * RING_WORDS + w]; }

/* Ask entry k for (layer, expert) and wait for the answer (at most 10 s): its status, or
 * -1 on no answer. */
static int ask(int32_t *words, int k, int layer, int expert) {
  int32_t seq = __atomic_load_n(at(words, k, R_SEQ), __ATOMIC_RELAXED) + 1;
  __atomic_store_n(at(words, k, R_LAYER), layer, __ATOMIC_RELAXED);
  __atomic_store_n(at(words, k, R_EXPERT), expert, __ATOMIC_RELAXED);
  __atomic_store_n(at(words, k, R_SEQ), seq, __ATOMIC_RELEASE);
  for (long i = 0; i < 10000000; i++) {
    if (__atomic_load_n(at(words, k, R_DONE), __ATOMIC_ACQUIRE) == seq)
      return __atomic_load_n(at(words, k, R_STATUS), __ATOMIC_RELAXED);
    struct timespec ts = {0, 1000};
    nanosleep(&ts, NULL);
  }
  return -1;
}

static void *post(void *arg) {
  Poster *p = arg;
  for (int it = 0; it < ROUNDS; it++) {
    int k = p->first + it % PER, layer = rand_r(&p->seed) % 2;
    int expert = rand_r(&p->seed) % (EXPERTS + 1) - (it % 50 == 0); /* -1 and 16: bad */
    int st = ask(p->words, k, layer, expert);
    int ok_expert = expert >= 0 && expert < EXPERTS;
    if (st != (ok_expert ? ST_OK : ST_ARGS)) {
      fprintf(stderr, "entry %d: layer %d expert %d answered %d\n", k, layer, expert, st);
      p->bad++;
      continue;
    }
    const char *rec = p->staging + (size_t)k * STRIDE;
    for (int b = 0; ok_expert && b < STRIDE; b++)
      if (rec[b] != fill(layer, expert)) {
        fprintf(stderr, "entry %d: byte %d of layer %d expert %d is wrong\n", k, b, layer, expert);
        p->bad++;
        break;
      }
  }
  return NULL;
}

static Engine *engine(int fds[2], char *staging, char *dst, char *err) {
  Engine *e = mlxs_new(2, 2, SLOTS, STRIDE, STRIDE / 4, staging, NULL, NULL, NULL, (void *)no_hash,
                       err, 256);
  assert(e);
  int64_t off = 0, nbytes = STRIDE, row = STRIDE;
  for (int l = 0; l < 2; l++) {
    char *part[1] = {dst + (size_t)l * SLOTS * STRIDE};
    int rc = mlxs_layer(e, l, fds[l], STRIDE, STRIDE, EXPERTS, SLOTS, 1, &off, &nbytes, part, &row,
                        NULL, NULL, err, 256);
    assert(rc == 0);
  }
  return e;
}

int main(void) {
  char paths[2][32] = {"/tmp/mlxs-ring-stress-XXXXXX", "/tmp/mlxs-ring-stress-XXXXXX"}, err[256];
  int fds[2];
  for (int l = 0; l < 2; l++) {
    int tmp = mkstemp(paths[l]);
    fds[l] = tmp < 0 ? -1 : write_file(paths[l], l);
    assert(fds[l] >= 0);
  }
  char *staging = aligned_alloc(4096, (size_t)SLOTS * STRIDE);
  char *ring_staging = aligned_alloc(4096, (size_t)POSTERS * PER * STRIDE);
  char *dst = calloc(2 * SLOTS, STRIDE);
  int32_t *words = calloc(POSTERS * PER * RING_WORDS, sizeof(int32_t));
  Engine *e = engine(fds, staging, dst, err);
  int rc = mlxs_ring_start(e, words, POSTERS * PER, ring_staging, STRIDE, 3, 3, err, sizeof err);
  assert(rc == 0);
  Poster ps[POSTERS];
  pthread_t t[POSTERS];
  for (int i = 0; i < POSTERS; i++) {
    ps[i] = (Poster){words, ring_staging, i * PER, 0, 17u * (unsigned)i + 1};
    pthread_create(&t[i], NULL, post, &ps[i]);
  }
  int bad = 0;
  for (int it = 0; it < ROUNDS; it++) { /* the engine's ordinary reads meanwhile */
    int32_t experts[SLOTS] = {it % EXPERTS, (it + 5) % EXPERTS, (it + 9) % EXPERTS, 15};
    int32_t slots[SLOTS] = {0, 1, 2, 3}, status[SLOTS];
    bad += mlxs_start(e, it % 2, SLOTS, experts, slots, 0, err, sizeof err) != ST_OK;
    bad += mlxs_finish(e, status, NULL, err, sizeof err) != ST_OK;
  }
  for (int i = 0; i < POSTERS; i++) pthread_join(t[i], NULL), bad += ps[i].bad;
  int64_t c[8];
  bad += mlxs_ring_counters(e, c, 8) != 0 || c[0] != POSTERS * ROUNDS;
  for (int it = 0; it < 20; it++) { /* stopped with a request in flight, started again */
    int32_t seq = __atomic_load_n(at(words, 0, R_SEQ), __ATOMIC_RELAXED) + 1;
    __atomic_store_n(at(words, 0, R_EXPERT), it % EXPERTS, __ATOMIC_RELAXED);
    __atomic_store_n(at(words, 0, R_SEQ), seq, __ATOMIC_RELEASE);
    mlxs_ring_stop(e);
    bad +=
        mlxs_ring_start(e, words, POSTERS * PER, ring_staging, STRIDE, 2, 2, err, sizeof err) != 0;
  }
  bad += ask(words, 1, 1, 3) != ST_OK;
  __atomic_store_n(at(words, 2, R_SEQ), 99, __ATOMIC_RELEASE);
  mlxs_free(e); /* its ring still running, a request in flight: stopped, then joined */
  printf("ring stress: %d posters x %d requests, %d wrong\n", POSTERS, ROUNDS, bad);
  for (int l = 0; l < 2; l++) close(fds[l]), unlink(paths[l]);
  free(staging), free(ring_staging), free(dst), free(words);
  return bad != 0;
}
