/* mlx_streaming's native record reader: expert records into pool slots, without the GIL.
 *
 * One way to read: mlxs_start begins reading at most one wave of records ``experts[i]`` of
 * one layer's file into slots ``slots[i]`` that the caller (the store, whose policy chose
 * them) reserved, and returns; mlxs_finish waits for them and says how each went. Records are
 * cut into pieces read with pread on worker threads (the calling thread works too) into
 * a staging area, each piece is copied into its slot's part rows with the copy function given
 * (cudaMemcpyAsync on a per-thread stream; memcpy without one) as it lands, and each record's
 * checksum is checked once all its pieces have landed. Every input is checked: a bad layer,
 * expert, slot or size is refused with a status, never followed.
 *
 * Every call that can fail writes why into the caller's ``err`` (``err_len`` bytes, under
 * the engine's lock: no message outlives its call or is shared between callers).
 *
 * This file is the API; the threads that read and copy are in engine_io.c, the shared
 * definitions in engine.h. Built by pip install as a plain shared library and driven
 * through ctypes (io/native.py).
 */
#include "engine.h"
#include <stdarg.h>

/* Write a message into the caller's ``err`` (an empty one: no failure); returns -1. */
__attribute__((format(printf, 3, 4))) static int say(char *err, int err_len, const char *fmt, ...) {
  if (!err || err_len < 1) return -1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, (size_t)err_len, fmt, ap);
  va_end(ap);
  return -1;
}

static void describe(char *err, int err_len, int st, int errnum, int expert, int layer) {
  const char *what = st == ST_CHECKSUM ? "checksum mismatch (the expert file is corrupt)"
                     : st == ST_COPY   ? "copy to the device failed"
                     : st == ST_SHORT
                         ? "the file ends inside the record (it shrank or is truncated)"
                         : "read failed";
  say(err, err_len, "%s%s%s: expert %d of layer position %d", what, st == ST_READ ? ": " : "",
      st == ST_READ ? strerror(errnum) : "", expert, layer);
}

static int check_read(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots,
                      char *err, int err_len) {
  if (layer < 0 || layer >= e->n_layers || !e->layers[layer].ready || n < 0 || n > 1 << 20 ||
      (n && (!experts || !slots))) {
    say(err, err_len, "bad request: layer position %d, %d records", layer, n);
    return ST_ARGS;
  }
  Layer *L = &e->layers[layer];
  for (int i = 0; i < n; i++) {
    if (experts[i] < 0 || experts[i] >= L->num_experts || slots[i] < 0 || slots[i] >= L->capacity) {
      say(err, err_len, "bad request: expert %d (of %d) into slot %d (of %d) in layer position %d",
          experts[i], L->num_experts, slots[i], L->capacity, layer);
      return ST_ARGS;
    }
    for (int j = 0; j < i; j++)
      if (slots[j] == slots[i]) {
        say(err, err_len, "bad request: slot %d named twice", slots[i]);
        return ST_ARGS;
      }
  }
  return ST_OK;
}

/* ------------------------------------------------------------------ the API */

static int check_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                     const char *staging, int copy, int sync, int streams, char *err, int err_len) {
  if (n_layers < 1) return say(err, err_len, "%d layers: at least 1", n_layers);
  if (n_threads < 0 || n_threads >= MAX_THREADS)
    return say(err, err_len, "%d reader threads: 0 to %d", n_threads, MAX_THREADS - 1);
  if (wave < 1 || wave > MAX_WAVE)
    return say(err, err_len, "a wave of %d records: 1 to %d", wave, MAX_WAVE);
  if (max_stride < 1 || max_stride > MAX_BYTES / wave)
    return say(err, err_len, "a stride of %lld bytes: 1 to %lld for a wave of %d",
               (long long)max_stride, (long long)(MAX_BYTES / wave), wave);
  if (piece_bytes < 4096 || piece_bytes > MAX_BYTES)
    return say(err, err_len, "pieces of %lld bytes: 4096 to %lld", (long long)piece_bytes,
               (long long)MAX_BYTES);
  if (!staging) return say(err, err_len, "no staging area");
  if (copy && (!sync || !streams))
    return say(err, err_len, "a copy function needs a sync function and a stream per thread");
  return 0;
}

/* Stop and join the workers started, then free the engine. */
static void destroy(Engine *e) {
  pthread_mutex_lock(&e->m);
  e->stop = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
  for (int w = 0; w < e->n_started; w++) pthread_join(e->workers[w], NULL);
  pthread_mutex_destroy(&e->m);
  pthread_mutex_destroy(&e->call_lock);
  pthread_cond_destroy(&e->cv);
  pthread_cond_destroy(&e->done_cv);
  free(e->layers);
  free(e);
}

/* Start all ``n`` workers or none that stay: 0, or -1 with ``err`` saying what failed (the
 * caller destroys the engine, joining those started). */
static int start_workers(Engine *e, int n, char *err, int err_len) {
  for (int w = 0; w < n; w++) {
    const char *what = "malloc";
    int rc = ENOMEM;
    WorkerArg *arg = malloc(sizeof *arg);
    if (arg) {
      *arg = (WorkerArg){e, w};
      what = "pthread_create";
      rc = pthread_create(&e->workers[w], NULL, mlxs_worker_main, arg);
      if (rc) free(arg);
    }
    if (rc)
      return say(err, err_len,
                 "could not start %d reader threads: thread %d failed in %s (%s); ask for "
                 "fewer threads or raise the process's thread or memory limits",
                 n, w + 1, what, strerror(rc));
    e->n_started++;
  }
  return 0;
}

/* A new engine, or NULL with ``err`` saying why (all its threads started, or none). */
Engine *mlxs_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                 char *staging, void *copy, void *sync, void **streams, void *hash, char *err,
                 int err_len) {
  say(err, err_len, "%s", "");
  if (check_new(n_layers, n_threads, wave, max_stride, piece_bytes, staging, !!copy, !!sync,
                !!streams, err, err_len))
    return NULL;
  Engine *e = calloc(1, sizeof(Engine));
  if (e) e->layers = calloc((size_t)n_layers, sizeof(Layer));
  if (!e || !e->layers) {
    free(e);
    say(err, err_len, "out of memory for an engine of %d layers", n_layers);
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
  for (int i = 0; copy && i <= n_threads; i++) e->streams[i] = streams[i];
  pthread_mutex_init(&e->m, NULL);
  pthread_mutex_init(&e->call_lock, NULL);
  pthread_cond_init(&e->cv, NULL);
  pthread_cond_init(&e->done_cv, NULL);
  if (start_workers(e, n_threads, err, err_len)) {
    destroy(e);
    return NULL;
  }
  return e;
}

/* Register layer position ``pos``: its file, record geometry and where each part lands. */
static int add_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes,
                     int num_experts, int capacity, int n_parts, const int64_t *part_off,
                     const int64_t *part_bytes, char **part_dst, const int64_t *part_row,
                     const uint64_t *checksums, uint8_t *checked, char *err, int err_len) {
  if (!e || pos < 0 || pos >= e->n_layers || n_parts < 1 || n_parts > MAX_PARTS || stride < 1 ||
      stride > e->max_stride || record_bytes < 1 || record_bytes > stride || num_experts < 1 ||
      num_experts > MAX_BYTES / stride || capacity < 1 || !part_off || !part_bytes || !part_dst ||
      !part_row) {
    return say(err, err_len, "bad layout for layer position %d", pos);
  }
  if (checksums && !e->hash) {
    return say(err, err_len, "checksums given without a hash function");
  }
  for (int p = 0; p < n_parts; p++)
    if (part_off[p] < 0 || part_bytes[p] < 0 || part_off[p] > record_bytes ||
        part_bytes[p] > record_bytes - part_off[p] || part_row[p] < part_bytes[p] ||
        part_row[p] > MAX_BYTES / capacity || !part_dst[p]) {
      return say(err, err_len, "part %d of layer position %d lies outside its record", p, pos);
    }
  struct stat sb; /* reads cover whole strides, the last record's too */
  int64_t need = num_experts * stride;
  if (fstat(fd, &sb)) {
    return say(err, err_len, "layer position %d: %s", pos, strerror(errno));
  }
  if (sb.st_size < need) {
    return say(err, err_len,
               "the file of layer position %d holds %lld bytes; its %d records of stride %lld "
               "need %lld: split the model again",
               pos, (long long)sb.st_size, num_experts, (long long)stride, (long long)need);
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

/* The work counted since the last take (read, pread, copy, sync ns, copies), reset. */
static void take_counts(Engine *e, int64_t ns[5]) {
  ns[0] = e->read_ns, ns[1] = e->pread_ns, ns[2] = e->copy_ns, ns[3] = e->sync_ns;
  ns[4] = e->copies;
  e->read_ns = e->pread_ns = e->copy_ns = e->sync_ns = e->copies = 0;
}

static void add_counts(int64_t *c, int n, int64_t bytes, int64_t busy, const int64_t ns[5]) {
  if (!c) return;
  c[C_CALLS] += 1;
  c[C_RECORDS] += n;
  c[C_BYTES] += bytes;
  c[C_BUSY_NS] += busy;
  c[C_READ_NS] += ns[0];
  c[C_PREAD_NS] += ns[1];
  c[C_COPY_NS] += ns[2];
  c[C_SYNC_NS] += ns[3];
  c[C_COPIES] += ns[4];
}

/* Hold the outcome of the wave just read for mlxs_finish. */
static void hold(Engine *e) {
  for (int r = 0; r < e->held_n; r++) {
    e->held_status[r] = e->rec_status[r];
    e->held_errno[r] = e->rec_errno[r];
  }
  take_counts(e, e->held_ns);
  __atomic_store_n(&e->pending, 2, __ATOMIC_RELEASE);
}

/* A started read still on the workers: wait for it and hold its outcome. */
static void settle(Engine *e) {
  if (e->pending != 1) return;
  mlxs_join(e);
  hold(e);
}

/* Register layer position ``pos`` (see add_layer); returns 0, or -1 with ``err`` saying why. */
int mlxs_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes, int num_experts,
               int capacity, int n_parts, const int64_t *part_off, const int64_t *part_bytes,
               char **part_dst, const int64_t *part_row, const uint64_t *checksums,
               uint8_t *checked, char *err, int err_len) {
  say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return -1;
  pthread_mutex_lock(&e->call_lock);
  settle(e); /* a started read may be reading the layer */
  int rc = add_layer(e, pos, fd, stride, record_bytes, num_experts, capacity, n_parts, part_off,
                     part_bytes, part_dst, part_row, checksums, checked, err, err_len);
  pthread_mutex_unlock(&e->call_lock);
  return rc;
}

/* Start reading at most one wave of records on the workers and return at once (with no
 * workers, read them now); the caller computes meanwhile and collects the outcome with
 * mlxs_finish (which must come before the next mlxs_start). Returns ST_OK or ST_ARGS
 * (``err`` says why). */
int mlxs_start(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots, char *err,
               int err_len) {
  say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return ST_ARGS;
  pthread_mutex_lock(&e->call_lock);
  settle(e);
  int st = check_read(e, layer, n, experts, slots, err, err_len);
  if (st == ST_OK && (e->pending || n > e->wave)) {
    say(err, err_len, "%s",
        e->pending ? "the read started before is not finished"
                   : "a started read takes at most one wave");
    st = ST_ARGS;
  }
  if (st == ST_OK) {
    e->held_n = n, e->held_layer = layer, e->held_t0 = mlxs_now_ns();
    for (int i = 0; i < n; i++) e->held_experts[i] = experts[i];
    mlxs_plan_wave(e, layer, n, experts, slots);
    __atomic_store_n(&e->pending, 1, __ATOMIC_RELEASE);
    if (e->n_started && e->n_jobs)
      mlxs_wake(e);
    else { /* no workers (or nothing to read): read it now */
      mlxs_run_wave(e);
      hold(e);
    }
  }
  pthread_mutex_unlock(&e->call_lock);
  return st;
}

/* Wait for the read mlxs_start began: ``status[i]`` says how record i went and
 * ``counters`` (N_COUNTERS) add up the work. Returns the first failure (``err``
 * describes it) or ST_OK. A record whose status is not ST_OK may have written part of its
 * slot: the caller must not use that slot. */
int mlxs_finish(Engine *e, int32_t *status, int64_t *counters, char *err, int err_len) {
  say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return ST_ARGS;
  pthread_mutex_lock(&e->call_lock);
  settle(e);
  int first = ST_OK;
  if (e->pending != 2 || !status) {
    say(err, err_len, "no started read to finish");
    first = ST_ARGS;
  }
  for (int r = 0; first != ST_ARGS && r < e->held_n; r++) {
    status[r] = e->held_status[r];
    if (e->held_status[r] != ST_OK && first == ST_OK) {
      first = e->held_status[r];
      describe(err, err_len, first, e->held_errno[r], e->held_experts[r], e->held_layer);
    }
  }
  if (first != ST_ARGS) {
    int64_t rb = e->layers[e->held_layer].record_bytes;
    add_counts(counters, e->held_n, first == ST_OK ? e->held_n * rb : 0, mlxs_now_ns() - e->held_t0,
               e->held_ns);
    __atomic_store_n(&e->pending, 0, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&e->call_lock);
  return first;
}

/* 1 when no started read is still on the workers. */
int mlxs_idle(Engine *e) {
  if (!e) return 1;
  pthread_mutex_lock(&e->m);
  int idle = __atomic_load_n(&e->pending, __ATOMIC_ACQUIRE) != 1 || e->workers_done >= e->n_started;
  pthread_mutex_unlock(&e->m);
  return idle;
}

void mlxs_free(Engine *e) {
  if (!e) return;
  pthread_mutex_lock(&e->call_lock);
  settle(e); /* the workers finish what was started before they stop */
  pthread_mutex_unlock(&e->call_lock);
  destroy(e);
}

int mlxs_threads(const Engine *e) { return e ? e->n_started : 0; }
