/* The native record reader's request ring: a poster (a kernel on the device, or any thread)
 * asks for records through entries in memory both sides address, and the engine's ring
 * threads read each record whole into its entry's staging record and answer through the
 * entry's done word. Nothing on this side calls CUDA, so no CUDA call can hold an answer
 * back behind the device's work (benchmarks/probes/mapped_mailbox.py: a round trip 2.5 us).
 *
 * An entry is RING_WORDS int32 words (a cache line of its own). To ask, the poster writes
 * the layer position and the expert, then, with release order, a new sequence number into
 * R_SEQ; the engine reads the record into staging record k (``stride`` bytes at
 * staging + k * stride, laid out as in the file), checks it, writes R_STATUS (ST_OK,
 * ST_READ, ST_SHORT, ST_CHECKSUM, ST_ARGS) and R_ERRNO, then, with release order, the
 * same number into R_DONE. The poster waits for R_DONE to equal its number before using
 * the staging record or asking on that entry again (one asked again before its answer
 * is answered after the first, with the number last seen).
 *
 * One poller thread watches the entries (spinning for SPIN_NS after a request, then
 * polling every POLL_NS, then every IDLE_POLL_NS once idle for IDLE_NS) and hands each
 * request to the ``readers`` threads in ``pieces`` reads of whole pages (a lone record is
 * read by several threads at once); the reader of its last piece checks it and answers.
 * The layers must be registered before the ring starts (mlxs_layer refuses while it
 * runs); mlxs_ring_stop (and mlxs_free) joins them. */
#include "engine.h"

#define MAX_RING 64
#define MAX_RING_READERS 16
#define QUEUE (MAX_RING * MAX_RING_READERS) /* pieces handed on: at most readers a record */
#define SPIN_NS 2000000LL
#define POLL_NS 20000LL
#define IDLE_POLL_NS 500000LL
#define IDLE_NS 1000000000LL

/* counters: requests answered, bytes read, failed, read ns (summed over readers), answer
 * ns (seen to answered, summed), the longest answer ns, busy ns (wall time with a reader
 * reading), reads (the pieces read) */
enum {
  RC_REQUESTS,
  RC_BYTES,
  RC_FAILED,
  RC_READ_NS,
  RC_ANSWER_NS,
  RC_MAX_NS,
  RC_BUSY_NS,
  RC_READS,
  N_RING_COUNTERS
};

typedef struct {
  int k;
  int32_t seq, layer, expert;
  int64_t seen_ns, lo, hi; /* the piece: bytes [lo, hi) of the record */
} Request;

typedef struct Ring {
  Engine *e;
  int32_t *words;
  int n, n_readers, n_started, poller_started, pieces;
  char *staging;
  int64_t stride;
  int32_t taken[MAX_RING];            /* the poller's: the last number handed on per entry */
  int busy[MAX_RING];                 /* a reader has entry k */
  int left[MAX_RING];                 /* entry k's pieces not yet read (under m) */
  int st[MAX_RING], errnum[MAX_RING]; /* its first failure (under m) */
  Request queue[QUEUE];
  int head, count, stop; /* stop: the readers leave once the queue is empty */
  int stop_poll;         /* the poller takes a last look, then leaves */
  int reading;           /* readers reading now; busy_t0: the wall time counted to (under m) */
  int64_t busy_t0;
  pthread_mutex_t m;
  pthread_cond_t cv;
  pthread_t poller, readers[MAX_RING_READERS];
  int64_t counters[N_RING_COUNTERS];
} Ring;

static int32_t *word(Ring *r, int k, int w) { return &r->words[(size_t)k * RING_WORDS + w]; }

static void answer(Ring *r, const Request *q, int st, int errnum) {
  __atomic_store_n(word(r, q->k, R_STATUS), st, __ATOMIC_RELAXED);
  __atomic_store_n(word(r, q->k, R_ERRNO), errnum, __ATOMIC_RELAXED);
  __atomic_store_n(word(r, q->k, R_DONE), q->seq, __ATOMIC_RELEASE);
}

/* The request's layer, or NULL where it names no record the staging holds. */
static Layer *asked_layer(const Ring *r, int32_t layer, int32_t expert) {
  Engine *e = r->e;
  Layer *L = layer >= 0 && layer < e->n_layers ? &e->layers[layer] : NULL;
  return L && L->ready && expert >= 0 && expert < L->num_experts && L->stride <= r->stride ? L
                                                                                           : NULL;
}

/* Read a piece of a request's record into its staging record; the reader of the last
 * piece checks the record, then frees the entry and answers under the ring's lock (so
 * that no look of the poller finds it answered but still being read). */
static void serve(Ring *r, const Request *q) {
  int st = ST_ARGS, errnum = 0;
  int64_t t0 = mlxs_now_ns();
  Layer *L = asked_layer(r, q->layer, q->expert);
  char *rec = r->staging + (int64_t)q->k * r->stride;
  if (L) {
    int rc =
        mlxs_read_full(L->fd, rec + q->lo, q->hi - q->lo, (int64_t)q->expert * L->stride + q->lo);
    st = rc ? (rc < 0 ? ST_SHORT : ST_READ) : ST_OK, errnum = rc > 0 ? rc : 0;
  }
  pthread_mutex_lock(&r->m);
  if (st != ST_OK && r->st[q->k] == ST_OK) r->st[q->k] = st, r->errnum[q->k] = errnum;
  int last = !--r->left[q->k];
  st = r->st[q->k], errnum = r->errnum[q->k];
  pthread_mutex_unlock(&r->m);
  if (last && st == ST_OK) st = mlxs_check_record(r->e, L, q->expert, rec);
  int64_t t1 = mlxs_now_ns();
  __atomic_fetch_add(&r->counters[RC_READ_NS], t1 - t0, __ATOMIC_RELAXED);
  __atomic_fetch_add(&r->counters[RC_READS], L != NULL, __ATOMIC_RELAXED); /* none: no record */
  if (last) { /* counted before the answer is seen */
    __atomic_fetch_add(&r->counters[RC_REQUESTS], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->counters[RC_BYTES], st == ST_OK ? L->record_bytes : 0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->counters[RC_FAILED], st != ST_OK, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->counters[RC_ANSWER_NS], t1 - q->seen_ns, __ATOMIC_RELAXED);
    int64_t most = __atomic_load_n(&r->counters[RC_MAX_NS], __ATOMIC_RELAXED);
    while (t1 - q->seen_ns > most &&
           !__atomic_compare_exchange_n(&r->counters[RC_MAX_NS], &most, t1 - q->seen_ns, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
  pthread_mutex_lock(&r->m); /* the wall time read, then the answer with the entry freed */
  int64_t now = mlxs_now_ns();
  __atomic_fetch_add(&r->counters[RC_BUSY_NS], now - r->busy_t0, __ATOMIC_RELAXED);
  r->busy_t0 = now, r->reading--;
  /* freed and answered in one hold of the lock: the poller sees the entry busy, or free
   * and answered, so a request posted again on the answer is handed on, even by its
   * last look before a stop */
  if (last) {
    r->busy[q->k] = 0;
    answer(r, q, st, errnum);
  }
  pthread_mutex_unlock(&r->m);
}

static void *reader_main(void *arg) {
  Ring *r = arg;
  pthread_mutex_lock(&r->m);
  for (;;) {
    while (!r->count && !r->stop) pthread_cond_wait(&r->cv, &r->m);
    if (!r->count) break; /* stopped, and every request handed on is answered */
    Request q = r->queue[r->head];
    r->head = (r->head + 1) % QUEUE, r->count--;
    if (!r->reading++) r->busy_t0 = mlxs_now_ns();
    pthread_mutex_unlock(&r->m);
    serve(r, &q);
    pthread_mutex_lock(&r->m);
  }
  pthread_mutex_unlock(&r->m);
  return NULL;
}

/* A piece's bytes: ``size`` in ``pieces`` reads of whole pages (the reads of the files
 * opened with O_DIRECT stay aligned: strides are whole pages). */
static int64_t piece_bytes(int64_t size, int pieces) {
  int64_t step = (size + pieces - 1) / pieces;
  return (step + 4095) / 4096 * 4096;
}

static void pause_ns(int64_t ns) {
  struct timespec ts = {0, (long)ns};
  nanosleep(&ts, NULL);
}

/* Hand on each entry's new request (one not handed on, whose entry no reader has); the
 * number handed on. */
static int take_requests(Ring *r) {
  int found = 0, fresh = 0;
  for (int k = 0; k < r->n && !fresh; k++) /* taken is the poller's own: no lock to look */
    fresh = __atomic_load_n(word(r, k, R_SEQ), __ATOMIC_RELAXED) != r->taken[k];
  if (!fresh) return 0;
  int64_t now = mlxs_now_ns();
  pthread_mutex_lock(&r->m);
  for (int k = 0; k < r->n; k++) {
    int32_t seq = __atomic_load_n(word(r, k, R_SEQ), __ATOMIC_ACQUIRE);
    if (seq == r->taken[k] || r->busy[k]) continue;
    Request q = {k,
                 seq,
                 __atomic_load_n(word(r, k, R_LAYER), __ATOMIC_RELAXED),
                 __atomic_load_n(word(r, k, R_EXPERT), __ATOMIC_RELAXED),
                 now,
                 0,
                 0};
    Layer *L = asked_layer(r, q.layer, q.expert);
    int64_t size = L ? L->stride : 0, step = piece_bytes(size, r->pieces);
    r->taken[k] = seq, r->busy[k] = 1, r->st[k] = ST_OK, r->errnum[k] = 0, r->left[k] = 0;
    do { /* a request naming no record is one empty piece, answered ST_ARGS */
      q.hi = q.lo + step < size ? q.lo + step : size;
      r->queue[(r->head + r->count++) % QUEUE] = q, r->left[k]++;
      q.lo = q.hi;
    } while (q.lo < size);
    found++;
  }
  if (found) pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->m);
  return found;
}

static void *poller_main(void *arg) {
  Ring *r = arg;
  int64_t last = mlxs_now_ns();
  while (!__atomic_load_n(&r->stop_poll, __ATOMIC_ACQUIRE)) {
    int64_t now = mlxs_now_ns();
    if (take_requests(r))
      last = now;
    else if (now - last >= IDLE_NS)
      pause_ns(IDLE_POLL_NS);
    else if (now - last >= SPIN_NS)
      pause_ns(POLL_NS);
  }
  take_requests(r); /* a last look: what was posted before the stop is answered too */
  return NULL;
}

/* The poller first (its last look hands on every request posted before the stop), then
 * the readers, once they have answered every request handed on. */
static void stop_ring(Ring *r) {
  __atomic_store_n(&r->stop_poll, 1, __ATOMIC_RELEASE);
  if (r->poller_started) pthread_join(r->poller, NULL);
  pthread_mutex_lock(&r->m);
  __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->m);
  for (int i = 0; i < r->n_started; i++) pthread_join(r->readers[i], NULL);
  pthread_mutex_destroy(&r->m);
  pthread_cond_destroy(&r->cv);
  free(r);
}

static int check_ring(const Engine *e, const int32_t *words, int n, const char *staging,
                      int64_t stride, int readers, int pieces, char *err, int err_len) {
  if (e->ring) return mlxs_say(err, err_len, "a request ring is running already");
  if (!words || !staging) return mlxs_say(err, err_len, "a request ring needs entries and staging");
  if (n < 1 || n > MAX_RING)
    return mlxs_say(err, err_len, "a ring of %d entries: 1 to %d", n, MAX_RING);
  if (readers < 1 || readers > MAX_RING_READERS)
    return mlxs_say(err, err_len, "%d ring readers: 1 to %d", readers, MAX_RING_READERS);
  if (pieces < 1 || pieces > readers)
    return mlxs_say(err, err_len, "%d pieces a record: 1 to the %d readers", pieces, readers);
  if (stride < 1 || stride > MAX_BYTES / n)
    return mlxs_say(err, err_len, "staging records of %lld bytes: 1 to %lld", (long long)stride,
                    (long long)(MAX_BYTES / n));
  for (int i = 0; i < e->n_layers; i++)
    if (!e->layers[i].ready || e->layers[i].stride > stride)
      return mlxs_say(err, err_len,
                      e->layers[i].ready ? "layer position %d's records do not fit the staging"
                                         : "layer position %d is not registered",
                      i);
  return 0;
}

/* Start answering requests in ``n`` entries at ``words`` (the caller's, as ``staging``:
 * both stay valid until mlxs_ring_stop) with ``readers`` threads, each record read in
 * ``pieces`` (1 to ``readers``): 0, or -1 with ``err`` saying why (nothing started).
 * Requests already posted are not answered. */
int mlxs_ring_start(Engine *e, int32_t *words, int n, char *staging, int64_t stride, int readers,
                    int pieces, char *err, int err_len) {
  mlxs_say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return -1;
  pthread_mutex_lock(&e->call_lock);
  int rc = check_ring(e, words, n, staging, stride, readers, pieces, err, err_len);
  Ring *r = rc ? NULL : calloc(1, sizeof(Ring));
  if (!rc && !r) rc = mlxs_say(err, err_len, "out of memory for a request ring");
  if (r) {
    *r = (Ring){.e = e,
                .words = words,
                .n = n,
                .n_readers = readers,
                .pieces = pieces,
                .staging = staging,
                .stride = stride};
    for (int k = 0; k < n; k++) r->taken[k] = __atomic_load_n(word(r, k, R_SEQ), __ATOMIC_ACQUIRE);
    pthread_mutex_init(&r->m, NULL);
    pthread_cond_init(&r->cv, NULL);
    int bad = 0;
    for (int i = 0; !bad && i < readers; i++)
      if (!(bad = pthread_create(&r->readers[i], NULL, reader_main, r))) r->n_started++;
    if (!bad && !(bad = pthread_create(&r->poller, NULL, poller_main, r))) r->poller_started = 1;
    if (bad) {
      rc = mlxs_say(err, err_len,
                    "could not start the request ring's threads: %s; ask for fewer "
                    "readers or raise the process's thread limit",
                    strerror(bad));
      stop_ring(r);
    } else
      e->ring = r;
  }
  pthread_mutex_unlock(&e->call_lock);
  return rc;
}

/* The ring's counters into ``out``, room for ``n``: 0, -1 with no ring running, or -2
 * where ``n`` is not N_RING_COUNTERS (a caller built against other sources). */
int mlxs_ring_counters(Engine *e, int64_t *out, int n) {
  if (n != N_RING_COUNTERS) return -2;
  if (!e || !out) return -1;
  pthread_mutex_lock(&e->call_lock);
  Ring *r = e->ring;
  for (int i = 0; r && i < N_RING_COUNTERS; i++)
    out[i] = __atomic_load_n(&r->counters[i], __ATOMIC_RELAXED);
  pthread_mutex_unlock(&e->call_lock);
  return r ? 0 : -1;
}

/* Stop the ring: every request posted before the stop is answered first (the poller's
 * last look hands on what it had not seen; an entry is free before its answer, so a
 * request posted on an answer is seen); one posted after, never (nor by a later ring: it
 * starts from the numbers it finds). */
void mlxs_ring_stop(Engine *e) {
  if (!e) return;
  pthread_mutex_lock(&e->call_lock);
  if (e->ring) stop_ring(e->ring);
  e->ring = NULL;
  pthread_mutex_unlock(&e->call_lock);
}

/* A host poster's side of an entry (io.ring's post and wait; a kernel does the same with
 * its own instructions): ask for ``expert`` of layer position ``layer`` through entry
 * ``k`` of ``words``, the number after the entry's last in R_SEQ with release order, so
 * that the request's words are seen first on any machine; the number. */
int32_t mlxs_ring_post(int32_t *words, int k, int32_t layer, int32_t expert) {
  int32_t *w = words + (size_t)k * RING_WORDS;
  int32_t seq = __atomic_load_n(&w[R_SEQ], __ATOMIC_RELAXED) % 2147483647 + 1;
  __atomic_store_n(&w[R_LAYER], layer, __ATOMIC_RELAXED);
  __atomic_store_n(&w[R_EXPERT], expert, __ATOMIC_RELAXED);
  __atomic_store_n(&w[R_SEQ], seq, __ATOMIC_RELEASE);
  return seq;
}

/* Entry ``k``'s R_DONE with acquire order: once it equals the poster's number, the
 * entry's status and staging record are the answer's. */
int32_t mlxs_ring_done(const int32_t *words, int k) {
  return __atomic_load_n(&words[(size_t)k * RING_WORDS + R_DONE], __ATOMIC_ACQUIRE);
}
