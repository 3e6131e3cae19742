/* The native record reader's shared definitions: limits, statuses, counters, the engine
 * and its layers (engine.c: reading; engine_setup.c: set-up and teardown; engine_io.c: the
 * threads that read and copy; engine_ring.c: records asked for through a request ring). */
#ifndef MLXS_ENGINE_H
#define MLXS_ENGINE_H
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_PARTS 32
#define MAX_THREADS 64
#define MAX_WAVE 256
#define MAX_PIECES 32 /* per record */
#define EAGAIN_TRIES 1000
#define MAX_BYTES ((int64_t)1 << 40) /* bound on any size, so that no product overflows */

enum { ST_OK = 0, ST_READ = 1, ST_CHECKSUM = 2, ST_SHORT = 3, ST_ARGS = 4, ST_COPY = 5 };
/* counters per layer: read ns is pread plus copy calls, summed over threads; busy ns is
 * wall time from mlxs_start to mlxs_finish; pread, copy-call and sync ns split the
 * threads' time */
enum {
  C_CALLS,
  C_RECORDS,
  C_BYTES,
  C_READ_NS,
  C_BUSY_NS,
  C_PREAD_NS,
  C_COPY_NS,
  C_SYNC_NS,
  C_COPIES,
  N_COUNTERS
};

typedef int (*copy_fn_t)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*sync_fn_t)(void *stream);
typedef uint64_t (*hash_fn_t)(const void *data, size_t n);

typedef struct {
  int fd, num_experts, capacity, n_parts, ready;
  int64_t stride, record_bytes;
  int64_t part_off[MAX_PARTS], part_bytes[MAX_PARTS], part_row[MAX_PARTS];
  char *part_dst[MAX_PARTS];
  const uint64_t *checksums;
  uint8_t *checked; /* checked[e]: record e passed its checksum (NULL: check every read) */
} Layer;

typedef struct { /* one piece of one record */
  int layer, expert, slot, rec;
  int64_t start, end;
} Job;

struct Ring; /* engine_ring.c */
/* A request ring entry's int32 words (engine_ring.c; io.ring mirrors them), a cache line */
enum { R_SEQ, R_LAYER, R_EXPERT, R_DONE, R_STATUS, R_ERRNO, RING_WORDS = 16 };

typedef struct Engine {
  int n_layers, n_threads, wave;
  Layer *layers;
  copy_fn_t copy;
  sync_fn_t sync;
  hash_fn_t hash;
  void *streams[MAX_THREADS + 1];
  char *staging; /* wave records of max_stride bytes, page-locked when copying to a GPU */
  int64_t max_stride, piece_bytes;
  Job jobs[MAX_WAVE * MAX_PIECES];
  int n_jobs;
  int next_job, workers_done;
  int pieces_left[MAX_WAVE], rec_status[MAX_WAVE], rec_errno[MAX_WAVE];
  int64_t read_ns, pread_ns, copy_ns, sync_ns, copies;
  /* a started read (mlxs_start): 1 on the workers, 2 landed and held for mlxs_finish */
  int pending, held_n, held_layer;
  int32_t held_experts[MAX_WAVE];
  int held_status[MAX_WAVE], held_errno[MAX_WAVE];
  int64_t held_t0, held_ns[5]; /* read, pread, copy, sync ns and copies of that read */
  pthread_mutex_t call_lock;   /* one call at a time */
  pthread_mutex_t m;
  pthread_cond_t cv, done_cv;
  int64_t generation;
  int stop, n_started;
  pthread_t workers[MAX_THREADS];
  struct Ring *ring; /* a running request ring (mlxs_ring_start), or NULL */
} Engine;

/* ------------------------------------------------------------------ the API (ctypes) */
/* Raised whenever a function's arguments change: engine_lib.ABI must match it, so that a
 * library built from older sources is refused, not called with the wrong arguments. */
#define MLXS_ABI 5
int mlxs_abi(void);
Engine *mlxs_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                 char *staging, void *copy, void *sync, void **streams, void *hash, char *err,
                 int err_len);
int mlxs_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes, int num_experts,
               int capacity, int n_parts, const int64_t *part_off, const int64_t *part_bytes,
               char **part_dst, const int64_t *part_row, const uint64_t *checksums,
               uint8_t *checked, char *err, int err_len);
int mlxs_start(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots, int now,
               char *err, int err_len);
int mlxs_finish(Engine *e, int32_t *status, int64_t *counters, char *err, int err_len);
int mlxs_staged(Engine *e);
void mlxs_free(Engine *e);
int mlxs_threads(const Engine *e);
/* the request ring (engine_ring.c) */
int mlxs_ring_start(Engine *e, int32_t *words, int n, char *staging, int64_t stride, int readers,
                    int pieces, char *err, int err_len);
int mlxs_ring_counters(Engine *e, int64_t *out, int n);
void mlxs_ring_stop(Engine *e);
int32_t mlxs_ring_post(int32_t *words, int k, int32_t layer, int32_t expert);
int32_t mlxs_ring_done(const int32_t *words, int k);

/* ------------------------------------------------------------------ inside the engine */
#pragma GCC visibility push(hidden) /* not exported: the API above is all there is */
int64_t mlxs_now_ns(void);
/* pread all of [off, off + n) into buf: 0, the errno of a persistent failure, or -1 for the
 * end of the file. */
int mlxs_read_full(int fd, char *buf, int64_t n, int64_t off);
/* ST_OK, or ST_CHECKSUM where record ``expert`` of layer L (at rec) fails its checksum;
 * checked once per record where the layer keeps ``checked``. */
int mlxs_check_record(Engine *e, Layer *L, int expert, const char *rec);
/* Write a message into the caller's ``err`` (an empty one: no failure); returns -1. */
__attribute__((format(printf, 3, 4))) int mlxs_say(char *err, int err_len, const char *fmt, ...);
/* A started read still on the workers: wait for it and hold its outcome for mlxs_finish
 * (under call_lock). */
void mlxs_join_started(Engine *e);
/* Run the wave's jobs on every worker and the calling thread; wait for all of them. */
void mlxs_run_wave(Engine *e);
/* Hand the wave's jobs to the workers only (mlxs_join waits for them). */
void mlxs_wake(Engine *e);
void mlxs_join(Engine *e);
/* Cut nr records into pieces (whole pages, so O_DIRECT reads work too) for every thread. */
void mlxs_plan_wave(Engine *e, int layer, int nr, const int32_t *experts, const int32_t *slots);
/* The worker threads' loop (started by mlxs_new with a malloc'd WorkerArg). */
typedef struct {
  Engine *e;
  int w;
} WorkerArg;
void *mlxs_worker_main(void *arg);
#pragma GCC visibility pop

#endif
