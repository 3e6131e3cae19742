/* The native record reader's set-up and teardown: an engine with its worker threads (all
 * started, or none), each layer's file and layout checked and registered, and the engine
 * freed once its last started read has landed (engine.h; the reading API is in engine.c). */
#include "engine.h"

static int check_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                     const char *staging, int copy, int sync, int streams, char *err, int err_len) {
  if (n_layers < 1) return mlxs_say(err, err_len, "%d layers: at least 1", n_layers);
  if (n_threads < 0 || n_threads >= MAX_THREADS)
    return mlxs_say(err, err_len, "%d reader threads: 0 to %d", n_threads, MAX_THREADS - 1);
  if (wave < 1 || wave > MAX_WAVE)
    return mlxs_say(err, err_len, "a wave of %d records: 1 to %d", wave, MAX_WAVE);
  if (max_stride < 1 || max_stride > MAX_BYTES / wave)
    return mlxs_say(err, err_len, "a stride of %lld bytes: 1 to %lld for a wave of %d",
                    (long long)max_stride, (long long)(MAX_BYTES / wave), wave);
  if (piece_bytes < 4096 || piece_bytes > MAX_BYTES)
    return mlxs_say(err, err_len, "pieces of %lld bytes: 4096 to %lld", (long long)piece_bytes,
                    (long long)MAX_BYTES);
  if (!staging) return mlxs_say(err, err_len, "no staging area");
  if (copy && (!sync || !streams))
    return mlxs_say(err, err_len, "a copy function needs a sync function and a stream per thread");
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
      return mlxs_say(err, err_len,
                      "could not start %d reader threads: thread %d failed in %s (%s); ask for "
                      "fewer threads or raise the process's thread or memory limits",
                      n, w + 1, what, strerror(rc));
    e->n_started++;
  }
  return 0;
}

int mlxs_abi(void) { return MLXS_ABI; }

/* A new engine, or NULL with ``err`` saying why (all its threads started, or none). */
Engine *mlxs_new(int n_layers, int n_threads, int wave, int64_t max_stride, int64_t piece_bytes,
                 char *staging, void *copy, void *sync, void **streams, void *hash, char *err,
                 int err_len) {
  mlxs_say(err, err_len, "%s", "");
  if (check_new(n_layers, n_threads, wave, max_stride, piece_bytes, staging, !!copy, !!sync,
                !!streams, err, err_len))
    return NULL;
  Engine *e = calloc(1, sizeof(Engine));
  if (e) e->layers = calloc((size_t)n_layers, sizeof(Layer));
  if (!e || !e->layers) {
    free(e);
    mlxs_say(err, err_len, "out of memory for an engine of %d layers", n_layers);
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
  if (pos < 0 || pos >= e->n_layers || n_parts < 1 || n_parts > MAX_PARTS || stride < 1 ||
      stride > e->max_stride || record_bytes < 1 || record_bytes > stride || num_experts < 1 ||
      num_experts > MAX_BYTES / stride || capacity < 1 || !part_off || !part_bytes || !part_dst ||
      !part_row)
    return mlxs_say(err, err_len, "bad layout for layer position %d", pos);
  if (checksums && !e->hash)
    return mlxs_say(err, err_len, "checksums given without a hash function");
  for (int p = 0; p < n_parts; p++)
    if (part_off[p] < 0 || part_bytes[p] < 0 || part_off[p] > record_bytes ||
        part_bytes[p] > record_bytes - part_off[p] || part_row[p] < part_bytes[p] ||
        part_row[p] > MAX_BYTES / capacity || !part_dst[p])
      return mlxs_say(err, err_len, "part %d of layer position %d lies outside its record", p, pos);
  struct stat sb; /* reads cover whole strides, the last record's too */
  int64_t need = num_experts * stride;
  if (fstat(fd, &sb)) return mlxs_say(err, err_len, "layer position %d: %s", pos, strerror(errno));
  if (sb.st_size < need)
    return mlxs_say(err, err_len,
                    "the file of layer position %d holds %lld bytes; its %d records of stride %lld "
                    "need %lld: split the model again",
                    pos, (long long)sb.st_size, num_experts, (long long)stride, (long long)need);
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

/* Register layer position ``pos`` (see add_layer); returns 0, or -1 with ``err`` saying why. */
int mlxs_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes, int num_experts,
               int capacity, int n_parts, const int64_t *part_off, const int64_t *part_bytes,
               char **part_dst, const int64_t *part_row, const uint64_t *checksums,
               uint8_t *checked, char *err, int err_len) {
  mlxs_say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return -1;
  pthread_mutex_lock(&e->call_lock);
  mlxs_join_started(e); /* a started read may be reading the layer */
  int rc = e->ring ? mlxs_say(err, err_len,
                              "layer position %d: the request ring is running; "
                              "register every layer before starting it",
                              pos)
                   : add_layer(e, pos, fd, stride, record_bytes, num_experts, capacity, n_parts,
                               part_off, part_bytes, part_dst, part_row, checksums, checked, err,
                               err_len);
  pthread_mutex_unlock(&e->call_lock);
  return rc;
}

/* Stop the request ring, finish a started read, stop the threads and free the engine. */
void mlxs_free(Engine *e) {
  if (!e) return;
  mlxs_ring_stop(e);
  pthread_mutex_lock(&e->call_lock);
  mlxs_join_started(e); /* the workers finish what was started before they stop */
  pthread_mutex_unlock(&e->call_lock);
  destroy(e);
}

/* The worker threads running (the caller's thread works too). */
int mlxs_threads(const Engine *e) { return e ? e->n_started : 0; }
