/* mlx_streaming's native I/O engine: serves MoE layer calls without the GIL.
 *
 * A request names one layer and the routed expert ids of one call. The engine finds the
 * misses in the layer's slot table, takes slots for them (free ones, then the victims the
 * Python policy queued, then the least recently used), reads the records with pread on
 * its worker threads (large records cut into pieces, several threads each), copies each
 * piece to its slot with the copy function given (cudaMemcpyAsync; memcpy without one),
 * checks each record's checksum, and only then marks the experts resident. It answers
 * with the slot of every row.
 *
 * Requests arrive two ways: a mailbox in page-locked host memory that a GPU kernel
 * writes and then waits on (the engine's own thread polls it), or a direct call
 * (mlxs_load) from the host path. Each served request is logged (experts used, experts
 * placed, victims) for the Python side, which keeps the policy and the statistics.
 * Tables are shared numpy arrays; the engine never blocks on Python.
 *
 * Mailbox layout (int32 words): [0] request seq, [1] layer, [2] rows, [3] answer seq,
 * [4] status of the answer, [5] set by a GPU that timed out, [6] the layer answered;
 * ids from word 16, slots from word 16 + max_rows.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MB_REQ 0
#define MB_LAYER 1
#define MB_ROWS 2
#define MB_ANS 3
#define MB_STATUS 4
#define MB_GPU_ERROR 5
#define MB_ECHO 6
#define MB_IDS 16
#define MAX_PARTS 32
#define MAX_THREADS 64
#define N_COUNTERS 8

enum { C_CALLS, C_HITS, C_MISSES, C_EVICTIONS, C_BYTES, C_RECORDS, C_BUSY_NS, C_READ_NS };
enum { ST_OK = 0, ST_READ = 1, ST_CHECKSUM = 2, ST_FULL = 3, ST_ARGS = 4, ST_COPY = 5 };

typedef int (*copy_fn_t)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*sync_fn_t)(void *stream);
typedef uint64_t (*hash_fn_t)(const void *data, size_t n);

typedef struct {
  int fd, num_experts, capacity, n_parts;
  int64_t stride, record_bytes;
  int32_t *slot_of, *expert_in, *lut_host, *victims, *n_victims;
  uint8_t *pinned;
  int64_t *last_use, *counters;
  void *lut_dev;
  const uint64_t *checksums;
  int64_t part_off[MAX_PARTS], part_bytes[MAX_PARTS], part_row[MAX_PARTS];
  char *part_dst[MAX_PARTS];
  int32_t *stamp;  /* call id that last protected each expert */
  int32_t call_id, victim_pos, victim_gen;
  int64_t tick;
} Layer;

typedef struct {  /* one piece of one record */
  int layer, expert, slot, rec;
  int64_t start, end;
} Job;

typedef struct Engine {
  int n_layers, n_threads, max_rows, wave;
  Layer *layers;
  volatile int32_t *mb;
  copy_fn_t copy;
  sync_fn_t sync;
  hash_fn_t hash;
  void *streams[MAX_THREADS];
  char *staging;  /* wave records of max_stride bytes, page-locked when copying to a GPU */
  int64_t max_stride, piece_bytes, spin_ns;
  /* work of the current wave */
  Job *jobs;
  int n_jobs, job_cap;
  volatile int next_job, jobs_done, pieces_left[256], rec_status[256];
  int rec_layer[256], rec_expert[256], rec_slot[256];
  int64_t read_ns;
  pthread_mutex_t work_lock;  /* one batch of loads at a time */
  pthread_mutex_t m;
  pthread_cond_t cv, done_cv;
  int64_t generation;
  volatile int stop, started;
  pthread_t loop, workers[MAX_THREADS];
  /* log ring for the Python side */
  int32_t *log;
  int64_t log_cap;
  volatile int64_t *log_head, *log_tail, *log_dropped;
  char err[512];
  volatile int errcode;
  volatile int stage;  /* where the engine is: 0 idle, 1 tables, 2 reads and copies, 3 lut copy */
  int32_t *answer_host;  /* page-locked: slots, status, echo, seq, copied to answer_dev */
  void *answer_dev;      /* device memory the waiting kernel polls (NULL: answer in the box) */
  volatile int64_t served;
  volatile int64_t slowest_ns;  /* the longest call served, and the stage it ended in */
  volatile int slowest_stage, stage_at;
  int64_t stage_t0;
} Engine;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void set_error(Engine *e, int code, const char *msg) {
  pthread_mutex_lock(&e->m);
  if (!e->errcode) {
    snprintf(e->err, sizeof e->err, "%s", msg);
    e->errcode = code;
  }
  pthread_mutex_unlock(&e->m);
}

/* ------------------------------------------------------------------ worker threads */

static int read_full(int fd, char *buf, int64_t n, int64_t off) {
  while (n > 0) {
    ssize_t k = pread(fd, buf, (size_t)n, off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    buf += k;
    off += k;
    n -= k;
  }
  return 0;
}

static void run_job(Engine *e, int w, Job *j) {
  Layer *L = &e->layers[j->layer];
  char *rec = e->staging + (int64_t)j->rec * e->max_stride;
  int64_t t0 = now_ns();
  if (read_full(L->fd, rec + j->start, j->end - j->start,
                (int64_t)j->expert * L->stride + j->start)) {
    e->rec_status[j->rec] = ST_READ;
  } else {
    for (int p = 0; p < L->n_parts; p++) {  /* the piece's bytes that belong to part p */
      int64_t lo = j->start > L->part_off[p] ? j->start : L->part_off[p];
      int64_t pe = L->part_off[p] + L->part_bytes[p];
      int64_t hi = j->end < pe ? j->end : pe;
      if (lo >= hi) continue;
      char *dst = L->part_dst[p] + (int64_t)j->slot * L->part_row[p] + (lo - L->part_off[p]);
      if (e->copy) {
        if (e->copy(dst, rec + lo, (size_t)(hi - lo), 1, e->streams[w])) e->rec_status[j->rec] = ST_COPY;
      } else {
        memcpy(dst, rec + lo, (size_t)(hi - lo));
      }
    }
  }
  __atomic_fetch_add(&e->read_ns, now_ns() - t0, __ATOMIC_RELAXED);
  if (__atomic_sub_fetch(&e->pieces_left[j->rec], 1, __ATOMIC_ACQ_REL) == 0 &&
      e->rec_status[j->rec] == ST_OK && L->checksums &&
      e->hash(rec, (size_t)L->record_bytes) != L->checksums[j->expert])
    e->rec_status[j->rec] = ST_CHECKSUM;
}

static void work(Engine *e, int w) {
  int did = 0;
  for (;;) {
    int i = __atomic_fetch_add(&e->next_job, 1, __ATOMIC_ACQ_REL);
    if (i >= e->n_jobs) break;
    run_job(e, w, &e->jobs[i]);
    did = 1;
  }
  if (did && e->copy && e->sync && e->sync(e->streams[w])) set_error(e, ST_COPY, "copy to the device failed");
}

static void *worker_main(void *arg) {
  Engine *e = ((void **)arg)[0];
  int w = (int)(intptr_t)((void **)arg)[1];
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
    e->jobs_done++;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->m);
  }
}

/* Run the wave's jobs on every worker and the calling thread; wait for all. */
static void run_wave(Engine *e) {
  e->next_job = 0;
  pthread_mutex_lock(&e->m);
  e->jobs_done = 0;
  e->generation++;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
  work(e, e->n_threads);  /* the caller works too, on its own stream */
  pthread_mutex_lock(&e->m);
  while (e->jobs_done < e->n_threads) pthread_cond_wait(&e->done_cv, &e->m);
  pthread_mutex_unlock(&e->m);
}

/* ------------------------------------------------------------------ slot tables */

static int take_slot(Layer *L, const char **why) {
  for (int s = 0; s < L->capacity; s++)
    if (L->expert_in[s] < 0) return s;
  /* the policy's victims, in its order (entries may be stale: checked here) */
  int gen = L->n_victims[1];
  if (gen != L->victim_gen) {
    L->victim_gen = gen;
    L->victim_pos = 0;
  }
  int nv = L->n_victims[0];
  while (L->victim_pos < nv) {
    int v = L->victims[L->victim_pos++];
    if (v >= 0 && v < L->num_experts && L->slot_of[v] >= 0 && !L->pinned[v] &&
        L->stamp[v] != L->call_id)
      return L->slot_of[v];
  }
  /* least recently used, outside the call and the pins */
  int best = -1;
  int64_t when = INT64_MAX;
  for (int s = 0; s < L->capacity; s++) {
    int v = L->expert_in[s];
    if (v < 0 || L->pinned[v] || L->stamp[v] == L->call_id) continue;
    if (L->last_use[v] < when) {
      when = L->last_use[v];
      best = s;
    }
  }
  if (best < 0) *why = "no slot left: every slot holds a pinned expert or one this call needs";
  return best;
}

static void log_call(Engine *e, int layer, int n_used, const int32_t *used, int n_placed,
                     const int32_t *placed_e, const int32_t *placed_s, const int32_t *victim,
                     int64_t nbytes) {
  if (!e->log) return;
  int64_t need = 5 + n_used + 3 * (int64_t)n_placed;
  int64_t head = *e->log_head, tail = __atomic_load_n(e->log_tail, __ATOMIC_ACQUIRE);
  if (head - tail + need > e->log_cap) {
    __atomic_fetch_add(e->log_dropped, 1, __ATOMIC_RELEASE);
    return;
  }
#define PUT(v) e->log[(head++) % e->log_cap] = (int32_t)(v)
  PUT(layer);
  PUT(n_used);
  PUT(n_placed);
  PUT(nbytes & 0x7fffffff);
  PUT(nbytes >> 31);
  for (int i = 0; i < n_used; i++) PUT(used[i]);
  for (int i = 0; i < n_placed; i++) {
    PUT(placed_e[i]);
    PUT(placed_s[i]);
    PUT(victim[i]);
  }
#undef PUT
  __atomic_store_n(e->log_head, head, __ATOMIC_RELEASE);
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Read records ``experts[i]`` of ``layer`` into ``slots[i]`` (reserved by the caller), a
 * wave at a time; ``status[i]`` says how each went. Returns the first failure or ST_OK. */
static int load_records(Engine *e, int layer, int n, const int32_t *experts,
                        const int32_t *slots, int32_t *status) {
  Layer *L = &e->layers[layer];
  int first = ST_OK;
  for (int w0 = 0; w0 < n; w0 += e->wave) {
    int nr = n - w0 < e->wave ? n - w0 : e->wave;
    /* cut records into pieces so that every worker has work, 32 pieces at most each */
    int64_t per = (L->stride * nr + e->n_threads) / (e->n_threads + 1);
    if (per > e->piece_bytes) per = e->piece_bytes;
    if (per < L->stride / 32) per = L->stride / 32;
    if (per < 65536) per = 65536;
    per = (per + 4095) / 4096 * 4096;
    e->n_jobs = 0;
    for (int r = 0; r < nr; r++) {
      int pieces = 0;
      for (int64_t a = 0; a < L->stride; a += per) {  /* whole pages: O_DIRECT reads too */
        Job *j = &e->jobs[e->n_jobs++];
        j->layer = layer;
        j->expert = experts[w0 + r];
        j->slot = slots[w0 + r];
        j->rec = r;
        j->start = a;
        j->end = a + per < L->stride ? a + per : L->stride;
        pieces++;
      }
      e->pieces_left[r] = pieces;
      e->rec_status[r] = ST_OK;
    }
    run_wave(e);
    for (int r = 0; r < nr; r++) {
      status[w0 + r] = e->rec_status[r];
      if (e->rec_status[r] == ST_OK) continue;
      char msg[320];
      snprintf(msg, sizeof msg, "%s: expert %d of MoE layer position %d",
               e->rec_status[r] == ST_CHECKSUM
                   ? "checksum mismatch (the expert file is corrupt; split the model again)"
               : e->rec_status[r] == ST_COPY ? "copy to the device failed"
                                             : "read failed (the expert file is truncated or unreadable)",
               experts[w0 + r], layer);
      set_error(e, e->rec_status[r], msg);
      if (first == ST_OK) first = e->rec_status[r];
    }
  }
  return first;
}

/* Serve one call: make ids[0..n) resident, write their slots. Returns a status. */
static int serve(Engine *e, int layer, int n, const int32_t *ids, int32_t *slots_out) {
  int64_t t0 = now_ns();
  if (layer < 0 || layer >= e->n_layers || n < 0 || n > e->max_rows) return ST_ARGS;
  Layer *L = &e->layers[layer];
  int32_t used[n > 0 ? n : 1];
  int n_used = 0;
  for (int i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= L->num_experts) return ST_ARGS;
    used[n_used++] = ids[i];
  }
  qsort(used, (size_t)n_used, sizeof(int32_t), cmp_int);
  int m = 0;
  for (int i = 0; i < n_used; i++)
    if (i == 0 || used[i] != used[m - 1]) used[m++] = used[i];
  n_used = m;
  L->call_id++;
  e->stage = 1;
  e->stage_t0 = t0;
  for (int i = 0; i < n_used; i++) L->stamp[used[i]] = L->call_id;
  int32_t miss_e[n_used ? n_used : 1], miss_s[n_used ? n_used : 1], victim[n_used ? n_used : 1];
  int n_miss = 0, status = ST_OK;
  for (int i = 0; i < n_used; i++) {
    int x = used[i];
    if (L->slot_of[x] >= 0) continue;
    const char *why = NULL;
    int s = take_slot(L, &why);
    if (s < 0) {
      set_error(e, ST_FULL, why);
      status = ST_FULL;
      break;
    }
    int v = L->expert_in[s];
    if (v >= 0) L->slot_of[v] = -1;  /* evicted now; its slot is rewritten below */
    L->expert_in[s] = x;
    miss_e[n_miss] = x;
    miss_s[n_miss] = s;
    victim[n_miss++] = v;
  }
  /* read the misses into their slots */
  int32_t rstat[n_miss ? n_miss : 1];
  e->stage = 2;
  if (status == ST_OK) status = load_records(e, layer, n_miss, miss_e, miss_s, rstat);
  int64_t nbytes = 0;
  for (int i = 0; i < n_miss && status != ST_FULL; i++) {
    if (rstat[i] != ST_OK) {
      L->expert_in[miss_s[i]] = -1;  /* never resident with bad or partial data */
      continue;
    }
    L->slot_of[miss_e[i]] = miss_s[i];
    if (L->lut_host) L->lut_host[miss_e[i]] = miss_s[i];
    nbytes += L->record_bytes;
  }
  if (status != ST_OK)  /* slots taken for misses not read yet are freed */
    for (int i = 0; i < n_miss; i++)
      if (L->slot_of[miss_e[i]] < 0 && L->expert_in[miss_s[i]] == miss_e[i]) L->expert_in[miss_s[i]] = -1;
  e->stage = 3;
  if (n_miss && L->lut_host && L->lut_dev && e->copy) {
    if (e->copy(L->lut_dev, L->lut_host, (size_t)L->num_experts * 4, 1, e->streams[e->n_threads]) ||
        e->sync(e->streams[e->n_threads]))
      status = ST_COPY;
  }
  L->tick++;
  for (int i = 0; i < n_used; i++) L->last_use[used[i]] = L->tick;
  if (slots_out)
    for (int i = 0; i < n; i++) slots_out[i] = L->slot_of[ids[i]] >= 0 ? L->slot_of[ids[i]] : 0;
  int n_evict = 0;
  for (int i = 0; i < n_miss; i++) {
    n_evict += victim[i] >= 0;
    if (L->slot_of[miss_e[i]] != miss_s[i]) miss_e[i] = -1;  /* logged as not placed */
  }
  L->counters[C_CALLS] += 1;
  L->counters[C_HITS] += n_used - n_miss;
  L->counters[C_MISSES] += n_miss;
  L->counters[C_EVICTIONS] += n_evict;
  L->counters[C_BYTES] += nbytes;
  L->counters[C_RECORDS] += nbytes / (L->record_bytes ? L->record_bytes : 1);
  L->counters[C_READ_NS] += e->read_ns;
  e->read_ns = 0;
  L->counters[C_BUSY_NS] += now_ns() - t0;
  log_call(e, layer, n_used, used, n_miss, miss_e, miss_s, victim, nbytes);
  int64_t took = now_ns() - t0;
  if (took > e->slowest_ns) {
    e->slowest_ns = took;
    e->slowest_stage = n_miss ? 2 : 1;
  }
  e->stage = 0;
  e->served++;
  return status;
}

/* ------------------------------------------------------------------ the mailbox loop */

static void *loop_main(void *arg) {
  Engine *e = arg;
  int32_t last = __atomic_load_n(&e->mb[MB_ANS], __ATOMIC_ACQUIRE);
  int64_t idle_since = now_ns();
  while (!e->stop) {
    int32_t seq = __atomic_load_n(&e->mb[MB_REQ], __ATOMIC_ACQUIRE);
    if (seq == last) {
      if (now_ns() - idle_since < e->spin_ns) {
        CPU_RELAX();
      } else {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
      }
      continue;
    }
    int layer = e->mb[MB_LAYER], n = e->mb[MB_ROWS];
    int32_t *box = (int32_t *)e->mb;
    pthread_mutex_lock(&e->work_lock);
    if (e->answer_dev) {
      /* answer into device memory with the copy engine: a kernel polling device memory
       * sees it, where its reads of host memory may be served stale. The seq word goes
       * last, in its own copy, so the slots are there when it is. */
      int32_t *a = e->answer_host;
      int status = serve(e, layer, n, box + MB_IDS, a);
      a[e->max_rows] = status;
      a[e->max_rows + 1] = layer;
      a[e->max_rows + 2] = seq;
      void *s = e->streams[e->n_threads];
      char *dev = (char *)e->answer_dev;
      if (e->copy(dev, a, (size_t)(e->max_rows + 2) * 4, 1, s) || e->sync(s) ||
          e->copy(dev + (size_t)(e->max_rows + 2) * 4, a + e->max_rows + 2, 4, 1, s) || e->sync(s))
        set_error(e, ST_COPY, "copy of an answer to the device failed");
      e->mb[MB_STATUS] = status;
    } else {
      int status = serve(e, layer, n, box + MB_IDS, box + MB_IDS + e->max_rows);
      e->mb[MB_STATUS] = status;
      e->mb[MB_ECHO] = layer;  /* the GPU checks it answered its own layer */
    }
    pthread_mutex_unlock(&e->work_lock);
    __atomic_store_n(&e->mb[MB_ANS], seq, __ATOMIC_RELEASE);
    last = seq;
    idle_since = now_ns();
  }
  return NULL;
}

/* ------------------------------------------------------------------ the API */

Engine *mlxs_new(int n_layers, int n_threads, int max_rows, int wave, int64_t max_stride,
                 int64_t piece_bytes, char *staging, void *copy, void *sync, void **streams,
                 void *hash, int64_t spin_ns) {
  if (n_threads < 0 || n_threads >= MAX_THREADS || wave < 1 || wave > 256) return NULL;
  Engine *e = calloc(1, sizeof(Engine));
  if (!e) return NULL;
  e->n_layers = n_layers;
  e->n_threads = n_threads;
  e->max_rows = max_rows;
  e->wave = wave;
  e->max_stride = max_stride;
  e->piece_bytes = piece_bytes;
  e->staging = staging;
  e->copy = (copy_fn_t)copy;
  e->sync = (sync_fn_t)sync;
  e->hash = (hash_fn_t)hash;
  for (int i = 0; i <= n_threads && streams; i++) e->streams[i] = streams[i];
  e->spin_ns = spin_ns;
  e->layers = calloc((size_t)n_layers, sizeof(Layer));
  e->job_cap = wave * 34;
  e->jobs = calloc((size_t)e->job_cap, sizeof(Job));
  pthread_mutex_init(&e->m, NULL);
  pthread_mutex_init(&e->work_lock, NULL);
  pthread_cond_init(&e->cv, NULL);
  pthread_cond_init(&e->done_cv, NULL);
  if (!e->layers || !e->jobs) {
    free(e->layers);
    free(e->jobs);
    free(e);
    return NULL;
  }
  return e;
}

int mlxs_layer(Engine *e, int pos, int fd, int64_t stride, int64_t record_bytes,
               int num_experts, int capacity, int32_t *slot_of, int32_t *expert_in,
               uint8_t *pinned, int64_t *last_use, int32_t *victims, int32_t *n_victims,
               int32_t *lut_host, void *lut_dev, int n_parts, const int64_t *part_off,
               const int64_t *part_bytes, char **part_dst, const int64_t *part_row,
               const uint64_t *checksums, int64_t *counters, int32_t *stamp) {
  if (pos < 0 || pos >= e->n_layers || n_parts > MAX_PARTS || stride > e->max_stride) return -1;
  Layer *L = &e->layers[pos];
  L->fd = fd;
  L->stride = stride;
  L->record_bytes = record_bytes;
  L->num_experts = num_experts;
  L->capacity = capacity;
  L->slot_of = slot_of;
  L->expert_in = expert_in;
  L->pinned = pinned;
  L->last_use = last_use;
  L->victims = victims;
  L->n_victims = n_victims;
  L->lut_host = lut_host;
  L->lut_dev = lut_dev;
  L->n_parts = n_parts;
  for (int p = 0; p < n_parts; p++) {
    L->part_off[p] = part_off[p];
    L->part_bytes[p] = part_bytes[p];
    L->part_dst[p] = part_dst[p];
    L->part_row[p] = part_row[p];
  }
  L->checksums = checksums;
  L->counters = counters;
  L->stamp = stamp;
  L->victim_gen = -1;
  return 0;
}

void mlxs_log(Engine *e, int32_t *ring, int64_t cap, int64_t *head, int64_t *tail,
              int64_t *dropped) {
  e->log = ring;
  e->log_cap = cap;
  e->log_head = head;
  e->log_tail = tail;
  e->log_dropped = dropped;
}

int mlxs_start(Engine *e, int32_t *mailbox, int32_t *answer_host, void *answer_dev) {
  if (e->started) return 0;
  e->mb = mailbox;
  e->answer_host = answer_host;
  e->answer_dev = answer_dev;
  for (int w = 0; w < e->n_threads; w++) {
    void **arg = malloc(2 * sizeof(void *));
    arg[0] = e;
    arg[1] = (void *)(intptr_t)w;
    if (pthread_create(&e->workers[w], NULL, worker_main, arg)) return -1;
  }
  if (mailbox && pthread_create(&e->loop, NULL, loop_main, e)) return -1;
  e->started = mailbox ? 2 : 1;
  return 0;
}

/* The host path's reads: records ``experts`` into the ``slots`` the caller reserved (its
 * tables are left alone). Called through ctypes, which releases the GIL around it. */
int mlxs_read(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots,
              int32_t *status) {
  if (layer < 0 || layer >= e->n_layers || n < 0) return ST_ARGS;
  pthread_mutex_lock(&e->work_lock);
  int64_t t0 = now_ns();
  int st = load_records(e, layer, n, experts, slots, status);
  Layer *L = &e->layers[layer];
  L->counters[C_READ_NS] += e->read_ns;
  e->read_ns = 0;
  L->counters[C_BUSY_NS] += now_ns() - t0;
  pthread_mutex_unlock(&e->work_lock);
  return st;
}

/* One call of the mailbox protocol served directly (tests, and hosts without a GPU). */
int mlxs_serve(Engine *e, int layer, int n, const int32_t *ids, int32_t *slots_out) {
  pthread_mutex_lock(&e->work_lock);
  int st = serve(e, layer, n, ids, slots_out);
  pthread_mutex_unlock(&e->work_lock);
  return st;
}

void mlxs_stop(Engine *e) {
  if (!e || !e->started) return;
  pthread_mutex_lock(&e->m);
  e->stop = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
  if (e->started == 2) pthread_join(e->loop, NULL);
  for (int w = 0; w < e->n_threads; w++) pthread_join(e->workers[w], NULL);
  e->started = 0;
}

void mlxs_free(Engine *e) {
  if (!e) return;
  mlxs_stop(e);
  free(e->jobs);
  free(e->layers);
  free(e);
}

const char *mlxs_error(Engine *e) { return e->errcode ? e->err : ""; }

/* Where the engine is (see Engine.stage) and how many calls it served. */
int mlxs_stage(Engine *e) { return e->stage; }
int64_t mlxs_served(Engine *e) { return e->served; }
int64_t mlxs_slowest_ns(Engine *e) { return e->slowest_ns; }

/* Wait (without the GIL) until *addr differs from old, or timeout_us passes. */
int mlxs_wait_change(volatile int64_t *addr, int64_t old, int64_t timeout_us) {
  int64_t end = now_ns() + timeout_us * 1000;
  int spins = 0;
  while (__atomic_load_n(addr, __ATOMIC_ACQUIRE) == old) {
    if (now_ns() > end) return 0;
    if (++spins < 2000) {
      CPU_RELAX();
    } else {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, NULL);
    }
  }
  return 1;
}
