/* The native record reader's threads: each takes pieces of the wave's records, reads them
 * with pread into the staging area and copies them on to their slots (engine.h). */
#include "engine.h"

int64_t mlxs_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* pread all of [off, off + n): retried on EINTR, EAGAIN and short reads. */
int mlxs_read_full(int fd, char *buf, int64_t n, int64_t off) {
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

/* Copy bytes [lo, hi) of a staged record to its slot's part rows; 0 or the copy's error. */
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
    int64_t t0 = mlxs_now_ns();
    int bad = e->copy(dst, rec + a, (size_t)(b - a), 1, e->streams[w]);
    if (bad && !rc) rc = bad; /* the CUDA error code, kept for the message */
    __atomic_fetch_add(&e->copy_ns, mlxs_now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&e->copies, 1, __ATOMIC_RELAXED);
  }
  return rc;
}

static void fail(Engine *e, int rec, int st, int errnum) {
  __atomic_store_n(&e->rec_status[rec], st, __ATOMIC_RELAXED);
  __atomic_store_n(&e->rec_errno[rec], errnum, __ATOMIC_RELAXED);
}

/* pread a piece into the staging area. */
static void read_piece(Engine *e, const Job *j) {
  Layer *L = &e->layers[j->layer];
  char *rec = e->staging + (int64_t)j->rec * e->max_stride;
  int64_t t0 = mlxs_now_ns();
  int rc = mlxs_read_full(L->fd, rec + j->start, j->end - j->start,
                          (int64_t)j->expert * L->stride + j->start);
  int64_t dt = mlxs_now_ns() - t0;
  __atomic_fetch_add(&e->pread_ns, dt, __ATOMIC_RELAXED);
  __atomic_fetch_add(&e->read_ns, dt, __ATOMIC_RELAXED);
  if (rc) fail(e, j->rec, rc < 0 ? ST_SHORT : ST_READ, rc);
}

/* Copy a piece read into its slot; the record's last piece checks the record. */
static void land_piece(Engine *e, int w, const Job *j) {
  Layer *L = &e->layers[j->layer];
  char *rec = e->staging + (int64_t)j->rec * e->max_stride;
  if (__atomic_load_n(&e->rec_status[j->rec], __ATOMIC_ACQUIRE) == ST_OK) {
    int64_t t0 = mlxs_now_ns();
    int rc = copy_range(e, w, L, j->slot, rec, j->start, j->end);
    if (rc) fail(e, j->rec, ST_COPY, rc);
    __atomic_fetch_add(&e->read_ns, mlxs_now_ns() - t0, __ATOMIC_RELAXED);
  }
  if (__atomic_sub_fetch(&e->pieces_left[j->rec], 1, __ATOMIC_ACQ_REL) != 0 ||
      __atomic_load_n(&e->rec_status[j->rec], __ATOMIC_ACQUIRE) != ST_OK)
    return; /* the record's last piece checks it */
  if (mlxs_check_record(e, L, j->expert, rec) != ST_OK)
    __atomic_store_n(&e->rec_status[j->rec], ST_CHECKSUM, __ATOMIC_RELAXED);
}

int mlxs_check_record(Engine *e, Layer *L, int expert, const char *rec) {
  if (!L->checksums || (L->checked && __atomic_load_n(&L->checked[expert], __ATOMIC_RELAXED)))
    return ST_OK;
  if (e->hash(rec, (size_t)L->record_bytes) != L->checksums[expert]) return ST_CHECKSUM;
  if (L->checked) __atomic_store_n(&L->checked[expert], 1, __ATOMIC_RELAXED);
  return ST_OK;
}

/* Take pieces until none is left, each read then copied. Then wait for this thread's
 * copies. */
static void work(Engine *e, int w) {
  int n = 0;
  for (;;) {
    int i = __atomic_fetch_add(&e->next_job, 1, __ATOMIC_ACQ_REL);
    if (i >= e->n_jobs) break;
    read_piece(e, &e->jobs[i]);
    land_piece(e, w, &e->jobs[i]);
    n++;
  }
  if (!n || !e->copy) return;
  int64_t t0 = mlxs_now_ns();
  int bad = e->sync(e->streams[w]);
  __atomic_fetch_add(&e->sync_ns, mlxs_now_ns() - t0, __ATOMIC_RELAXED);
  if (bad) /* a failed copy fails every record */
    for (int r = 0; r < e->wave; r++) fail(e, r, ST_COPY, bad);
}

void *mlxs_worker_main(void *arg) {
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

void mlxs_wake(Engine *e) {
  __atomic_store_n(&e->next_job, 0, __ATOMIC_RELEASE);
  pthread_mutex_lock(&e->m);
  e->workers_done = 0;
  e->generation++;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->m);
}

void mlxs_join(Engine *e) {
  pthread_mutex_lock(&e->m);
  while (e->workers_done < e->n_started) pthread_cond_wait(&e->done_cv, &e->m);
  pthread_mutex_unlock(&e->m);
}

void mlxs_run_wave(Engine *e) {
  if (e->n_jobs <= 1 || !e->n_started) { /* one piece: waking the workers costs more */
    __atomic_store_n(&e->next_job, 0, __ATOMIC_RELEASE);
    work(e, e->n_started);
    return;
  }
  mlxs_wake(e);
  work(e, e->n_started);
  mlxs_join(e);
}

void mlxs_plan_wave(Engine *e, int layer, int nr, const int32_t *experts, const int32_t *slots) {
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
