/* mlx_streaming's native record reader: expert records into pool slots, without the GIL.
 *
 * One call, mlxs_read, reads records ``experts[i]`` of one layer's file into slots
 * ``slots[i]`` that the caller (the store, whose policy chose them) reserved. Records are
 * cut into pieces read with pread on worker threads (the calling thread works too) into
 * a staging area. Each piece is copied into its slot's part rows with the copy function
 * given (cudaMemcpyAsync on a per-thread stream; memcpy without one), or, with
 * copy_whole, each record once all its pieces have landed and its checksum passed (one
 * copy per part). A record's checksum is checked once all its pieces have landed. Every input is
 * checked: a bad layer, expert, slot or size is refused with a status, never followed.
 *
 * Built by pip install as a plain shared library and driven through ctypes (io/native.py).
 */
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
 * wall time in mlxs_read; pread, copy-call and sync ns split the threads' time */
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

typedef struct Engine {
  int n_layers, n_threads, wave;
  int copy_whole; /* copy each record once all its pieces landed (else piece by piece) */
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
  pthread_mutex_t call_lock; /* one mlxs_read at a time */
  pthread_mutex_t m;
  pthread_cond_t cv, done_cv;
  int64_t generation;
  int stop, n_started;
  pthread_t workers[MAX_THREADS];
  char err[512];
} Engine;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* pread all of [off, off + n): retried on EINTR, EAGAIN and short reads; returns 0, or
 * the errno of a persistent failure (-1 for the end of the file). */
static int read_full(int fd, char *buf, int64_t n, int64_t off) {
  int again = 0;
  while (n > 0) {
    ssize_t k = pread(fd, buf, (size_t)n, (off_t)off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno == EAGAIN && ++again < EAGAIN_TRIES) {
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (k < 0) return errno ? errno : EIO;
    if (k == 0) return -1;
    buf += k;
    off += k;
    n -= k;
  }
  return 0;
}

/* Copy bytes [lo, hi) of a staged record to its slot's part rows; 0 or ST_COPY. */
static int copy_range(Engine *e, int w, const Layer *L, int slot, const char *rec, int64_t lo,
                      int64_t hi) {
  int rc = ST_OK;
  for (int p = 0; p < L->n_parts; p++) { /* the range's bytes that belong to part p */
    int64_t a = lo > L->part_off[p] ? lo : L->part_off[p];
    int64_t pe = L->part_off[p] + L->part_bytes[p];
    int64_t b = hi < pe ? hi : pe;
    if (a >= b) continue;
    char *dst = L->part_dst[p] + (int64_t)slot * L->part_row[p] + (a - L->part_off[p]);
    if (!e->copy) {
      memcpy(dst, rec + a, (size_t)(b - a));
      continue;
    }
    int64_t t0 = now_ns();
    if (e->copy(dst, rec + a, (size_t)(b - a), 1, e->streams[w])) rc = ST_COPY;
    __atomic_fetch_add(&e->copy_ns, now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&e->copies, 1, __ATOMIC_RELAXED);
  }
  return rc;
}

static void run_job(Engine *e, int w, const Job *j) {
  Layer *L = &e->layers[j->layer];
  char *rec = e->staging + (int64_t)j->rec * e->max_stride;
  int64_t t0 = now_ns();
  int rc = read_full(L->fd, rec + j->start, j->end - j->start,
                     (int64_t)j->expert * L->stride + j->start);
  __atomic_fetch_add(&e->pread_ns, now_ns() - t0, __ATOMIC_RELAXED);
  if (rc) {
    __atomic_store_n(&e->rec_status[j->rec], rc < 0 ? ST_SHORT : ST_READ, __ATOMIC_RELAXED);
    __atomic_store_n(&e->rec_errno[j->rec], rc, __ATOMIC_RELAXED);
  } else if (!e->copy_whole && copy_range(e, w, L, j->slot, rec, j->start, j->end)) {
    __atomic_store_n(&e->rec_status[j->rec], ST_COPY, __ATOMIC_RELAXED);
  }
  __atomic_fetch_add(&e->read_ns, now_ns() - t0, __ATOMIC_RELAXED);
  if (__atomic_sub_fetch(&e->pieces_left[j->rec], 1, __ATOMIC_ACQ_REL) != 0 ||
      __atomic_load_n(&e->rec_status[j->rec], __ATOMIC_ACQUIRE) != ST_OK)
    return; /* the record's last piece checks and (copy_whole) copies it */
  if (L->checksums && !(L->checked && __atomic_load_n(&L->checked[j->expert], __ATOMIC_RELAXED))) {
    if (e->hash(rec, (size_t)L->record_bytes) != L->checksums[j->expert]) {
      __atomic_store_n(&e->rec_status[j->rec], ST_CHECKSUM, __ATOMIC_RELAXED);
      return; /* a corrupt record is never copied whole */
    }
    if (L->checked) __atomic_store_n(&L->checked[j->expert], 1, __ATOMIC_RELAXED);
  }
  if (e->copy_whole && copy_range(e, w, L, j->slot, rec, 0, L->record_bytes))
    __atomic_store_n(&e->rec_status[j->rec], ST_COPY, __ATOMIC_RELAXED);
}

/* Take pieces until none is left; then wait for this thread's copies. */
static void work(Engine *e, int w) {
  int did = 0;
  for (;;) {
    int i = __atomic_fetch_add(&e->next_job, 1, __ATOMIC_ACQ_REL);
    if (i >= e->n_jobs) break;
    run_job(e, w, &e->jobs[i]);
    did = 1;
  }
  if (!did || !e->copy) return;
  int64_t t0 = now_ns();
  int bad = e->sync(e->streams[w]);
  __atomic_fetch_add(&e->sync_ns, now_ns() - t0, __ATOMIC_RELAXED);
  if (bad) /* a failed copy fails every record */
    for (int r = 0; r < e->wave; r++)
      __atomic_store_n(&e->rec_status[r], ST_COPY, __ATOMIC_RELAXED);
}

typedef struct {
  Engine *e;
  int w;
} WorkerArg;

static void *worker_main(void *arg) {
  Engine *e = ((WorkerArg *)arg)->e;
  int w = ((WorkerArg *)arg)->w;
  free(arg);
  int64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&e->m);
    while (e->generation == seen && !e->stop) pthread_cond_wait(&e->cv, &e->m);
    if (e->stop) {
      pthread_mutex_unlock(&e->m);
      return NULL;
    }
    seen = e->generation;
    pthread_mutex_unlock(&e->m);
    work(e, w);
    pthread_mutex_lock(&e->m);
    e->workers_done++;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->m);
  }
}

/* Run the wave's jobs on every worker and the calling thread; wait for all of them. */
static void run_wave(Engine *e) {
  __atomic_store_n(&e->next_job, 0, __ATOMIC_RELEASE);
  pthread_mutex_lock(&e->m);
  e->workers_done = 0;
  e->generation++;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
  work(e, e->n_started);
  pthread_mutex_lock(&e->m);
  while (e->workers_done < e->n_started) pthread_cond_wait(&e->done_cv, &e->m);
  pthread_mutex_unlock(&e->m);
}

/* Cut nr records into pieces (whole pages, so O_DIRECT reads work too) for every thread. */
static void plan_wave(Engine *e, int layer, int nr, const int32_t *experts, const int32_t *slots) {
  Layer *L = &e->layers[layer];
  int64_t per = (L->stride * nr + e->n_started) / (e->n_started + 1);
  if (per > e->piece_bytes) per = e->piece_bytes;
  if (per < L->stride / MAX_PIECES + 1) per = L->stride / MAX_PIECES + 1;
  if (per < 65536) per = 65536;
  per = (per + 4095) / 4096 * 4096;
  e->n_jobs = 0;
  for (int r = 0; r < nr; r++) {
    int pieces = 0;
    for (int64_t a = 0; a < L->stride; a += per) {
      Job *j = &e->jobs[e->n_jobs++];
      j->layer = layer;
      j->expert = experts[r];
      j->slot = slots[r];
      j->rec = r;
      j->start = a;
      j->end = a + per < L->stride ? a + per : L->stride;
      pieces++;
    }
    e->pieces_left[r] = pieces;
    e->rec_status[r] = ST_OK;
    e->rec_errno[r] = 0;
  }
}

static void describe(Engine *e, int st, int err, int expert, int layer) {
  const char *what = st == ST_CHECKSUM ? "checksum mismatch (the expert file is corrupt)"
                     : st == ST_COPY   ? "copy to the device failed"
                     : st == ST_SHORT
                         ? "the file ends inside the record (it shrank or is truncated)"
                         : "read failed";
  snprintf(e->err, sizeof e->err, "%s%s%s: expert %d of layer position %d", what,
           st == ST_READ ? ": " : "", st == ST_READ ? strerror(err) : "", expert, layer);
}

static int check_read(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots) {
  if (layer < 0 || layer >= e->n_layers || !e->layers[layer].ready || n < 0 || n > 1 << 20 ||
      (n && (!experts || !slots))) {
    snprintf(e->err, sizeof e->err, "bad request: layer position %d, %d records", layer, n);
    return ST_ARGS;
  }
  Layer *L = &e->layers[layer];
  for (int i = 0; i < n; i++) {
    if (experts[i] < 0 || experts[i] >= L->num_experts || slots[i] < 0 || slots[i] >= L->capacity) {
      snprintf(e->err, sizeof e->err,
               "bad request: expert %d (of %d) into slot %d (of %d) in layer position %d",
               experts[i], L->num_experts, slots[i], L->capacity, layer);
      return ST_ARGS;
    }
    for (int j = 0; j < i; j++)
      if (slots[j] == slots[i]) {
        snprintf(e->err, sizeof e->err, "bad request: slot %d named twice", slots[i]);
        return ST_ARGS;
      }
  }
  return ST_OK;
}

/* ------------------------------------------------------------------ the API */

Engine *mlxs_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                 char *staging, void *copy, void *sync, void **streams, void *hash,
                 int copy_whole) {
  if (n_layers < 1 || n_threads < 0 || n_threads >= MAX_THREADS || wave < 1 || wave > MAX_WAVE ||
      max_stride < 1 || max_stride > MAX_BYTES / wave || piece_bytes < 4096 ||
      piece_bytes > MAX_BYTES || !staging || (copy && (!sync || !streams)))
    return NULL;
  Engine *e = calloc(1, sizeof(Engine));
  if (!e) return NULL;
  e->layers = calloc((size_t)n_layers, sizeof(Layer));
  if (!e->layers) {
    free(e);
    return NULL;
  }
  e->n_layers = n_layers;
  e->wave = wave;
  e->max_stride = max_stride;
  e->piece_bytes = piece_bytes;
  e->staging = staging;
  e->copy = (copy_fn_t)copy;
  e->sync = (sync_fn_t)sync;
  e->hash = (hash_fn_t)hash;
  e->copy_whole = copy_whole != 0;
  for (int i = 0; copy && i <= n_threads; i++) e->streams[i] = streams[i];
  pthread_mutex_init(&e->m, NULL);
  pthread_mutex_init(&e->call_lock, NULL);
  pthread_cond_init(&e->cv, NULL);
  pthread_cond_init(&e->done_cv, NULL);
  for (int w = 0; w < n_threads; w++) {
    WorkerArg *arg = malloc(sizeof *arg);
    if (!arg) break;
    arg->e = e;
    arg->w = w;
    if (pthread_create(&e->workers[w], NULL, worker_main, arg)) {
      free(arg);
      break;
    }
    e->n_started++;
  }
  return e;
}

/* Register layer position ``pos``; returns 0, or -1 with mlxs_error saying why. */
int mlxs_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes, int num_experts,
               int capacity, int n_parts, const int64_t *part_off, const int64_t *part_bytes,
               char **part_dst, const int64_t *part_row, const uint64_t *checksums,
               uint8_t *checked) {
  if (!e || pos < 0 || pos >= e->n_layers || n_parts < 1 || n_parts > MAX_PARTS || stride < 1 ||
      stride > e->max_stride || record_bytes < 1 || record_bytes > stride || num_experts < 1 ||
      capacity < 1 || !part_off || !part_bytes || !part_dst || !part_row) {
    if (e) snprintf(e->err, sizeof e->err, "bad layout for layer position %d", pos);
    return -1;
  }
  if (checksums && !e->hash) {
    snprintf(e->err, sizeof e->err, "checksums given without a hash function");
    return -1;
  }
  for (int p = 0; p < n_parts; p++)
    if (part_off[p] < 0 || part_bytes[p] < 0 || part_off[p] > record_bytes ||
        part_bytes[p] > record_bytes - part_off[p] || part_row[p] < part_bytes[p] ||
        part_row[p] > MAX_BYTES / capacity || !part_dst[p]) {
      snprintf(e->err, sizeof e->err, "part %d of layer position %d lies outside its record", p,
               pos);
      return -1;
    }
  struct stat sb;
  if (fstat(fd, &sb) || sb.st_size < record_bytes ||
      (int64_t)(num_experts - 1) > (sb.st_size - record_bytes) / stride) {
    snprintf(e->err, sizeof e->err, "the file of layer position %d holds fewer than %d records",
             pos, num_experts);
    return -1;
  }
  Layer *L = &e->layers[pos];
  L->fd = fd;
  L->stride = stride;
  L->record_bytes = record_bytes;
  L->num_experts = num_experts;
  L->capacity = capacity;
  L->n_parts = n_parts;
  for (int p = 0; p < n_parts; p++) {
    L->part_off[p] = part_off[p];
    L->part_bytes[p] = part_bytes[p];
    L->part_dst[p] = part_dst[p];
    L->part_row[p] = part_row[p];
  }
  L->checksums = checksums;
  L->checked = checked;
  L->ready = 1;
  return 0;
}

/* Read records ``experts`` of layer position ``layer`` into ``slots``; ``status[i]`` says
 * how each went and ``counters`` (N_COUNTERS) add up the work. Returns the first failure
 * (mlxs_error describes it) or ST_OK. A record whose status is not ST_OK may have written
 * part of its slot: the caller must not use that slot. */
int mlxs_read(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots,
              int32_t *status, int64_t *counters) {
  if (!e) return ST_ARGS;
  pthread_mutex_lock(&e->call_lock);
  int64_t t0 = now_ns();
  int first = check_read(e, layer, n, experts, slots);
  if (first == ST_OK && !status) first = ST_ARGS;
  for (int w0 = 0; first == ST_OK && w0 < n; w0 += e->wave) {
    int nr = n - w0 < e->wave ? n - w0 : e->wave;
    plan_wave(e, layer, nr, experts + w0, slots + w0);
    run_wave(e);
    for (int r = 0; r < nr; r++) {
      status[w0 + r] = e->rec_status[r];
      if (e->rec_status[r] != ST_OK && first == ST_OK) {
        first = e->rec_status[r];
        describe(e, first, e->rec_errno[r], experts[w0 + r], layer);
      }
    }
  }
  if (first == ST_OK) e->err[0] = 0;
  if (counters) {
    counters[C_CALLS] += 1;
    counters[C_RECORDS] += n;
    counters[C_BYTES] += first == ST_OK ? (int64_t)n * e->layers[layer].record_bytes : 0;
    counters[C_READ_NS] += e->read_ns;
    counters[C_BUSY_NS] += now_ns() - t0;
    counters[C_PREAD_NS] += e->pread_ns;
    counters[C_COPY_NS] += e->copy_ns;
    counters[C_SYNC_NS] += e->sync_ns;
    counters[C_COPIES] += e->copies;
  }
  e->read_ns = e->pread_ns = e->copy_ns = e->sync_ns = e->copies = 0;
  pthread_mutex_unlock(&e->call_lock);
  return first;
}

void mlxs_free(Engine *e) {
  if (!e) return;
  pthread_mutex_lock(&e->m);
  e->stop = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
  for (int w = 0; w < e->n_started; w++) pthread_join(e->workers[w], NULL);
  free(e->layers);
  free(e);
}

int mlxs_threads(const Engine *e) { return e ? e->n_started : 0; }

const char *mlxs_error(const Engine *e) { return e ? e->err : "no engine"; }
