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
 * This file is the reading API (mlxs_start, mlxs_finish, mlxs_staged); an
 * engine's set-up and teardown (mlxs_new, mlxs_layer, mlxs_free) are in engine_setup.c, the threads
 * that read and copy in engine_io.c, the shared definitions in engine.h. Built by pip install as a
 * plain shared library and driven through ctypes (io/native.py).
 */
#include "engine.h"
#include <stdarg.h>

int mlxs_say(char *err, int err_len, const char *fmt, ...) {
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
  char code[32] = "";
  if (st == ST_COPY) snprintf(code, sizeof code, " (CUDA error %d)", errnum);
  mlxs_say(err, err_len, "%s%s%s%s: expert %d of layer position %d", what,
           st == ST_READ ? ": " : "", st == ST_READ ? strerror(errnum) : "", code, expert, layer);
}

static int check_read(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots,
                      char *err, int err_len) {
  if (layer < 0 || layer >= e->n_layers || !e->layers[layer].ready || n < 0 || n > 1 << 20 ||
      (n && (!experts || !slots))) {
    mlxs_say(err, err_len, "bad request: layer position %d, %d records", layer, n);
    return ST_ARGS;
  }
  Layer *L = &e->layers[layer];
  for (int i = 0; i < n; i++) {
    if (experts[i] < 0 || experts[i] >= L->num_experts || slots[i] < 0 || slots[i] >= L->capacity) {
      mlxs_say(err, err_len,
               "bad request: expert %d (of %d) into slot %d (of %d) in layer position %d",
               experts[i], L->num_experts, slots[i], L->capacity, layer);
      return ST_ARGS;
    }
    for (int j = 0; j < i; j++)
      if (slots[j] == slots[i]) {
        mlxs_say(err, err_len, "bad request: slot %d named twice", slots[i]);
        return ST_ARGS;
      }
  }
  return ST_OK;
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

void mlxs_join_started(Engine *e) {
  if (e->pending != 1) return;
  mlxs_join(e);
  hold(e);
}

/* Start reading at most one wave of records on the workers and return at once; the caller
 * computes meanwhile and takes the outcome with mlxs_finish (which must come before the
 * next mlxs_start). With ``now`` (a caller that would wait at once), or without workers, the
 * wave is read before returning, on this thread too (alone for a single piece, as waking the
 * workers costs more). Returns ST_OK or ST_ARGS (``err`` says why). */
int mlxs_start(Engine *e, int layer, int n, const int32_t *experts, const int32_t *slots, int now,
               char *err, int err_len) {
  mlxs_say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return ST_ARGS;
  pthread_mutex_lock(&e->call_lock);
  mlxs_join_started(e);
  int st = check_read(e, layer, n, experts, slots, err, err_len);
  if (st == ST_OK && (e->pending || n > e->wave)) {
    mlxs_say(err, err_len, "%s",
             e->pending ? "the read started before is not finished"
                        : "a started read takes at most one wave");
    st = ST_ARGS;
  }
  if (st == ST_OK) {
    e->held_n = n, e->held_layer = layer, e->held_t0 = mlxs_now_ns();
    for (int i = 0; i < n; i++) e->held_experts[i] = experts[i];
    mlxs_plan_wave(e, layer, n, experts, slots);
    pthread_mutex_lock(&e->m); /* before pending: staged() never sees the last wave's count */
    e->workers_done = 0;
    pthread_mutex_unlock(&e->m);
    __atomic_store_n(&e->pending, 1, __ATOMIC_RELEASE);
    if (e->n_started && e->n_jobs && !now)
      mlxs_wake(e);
    else {
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
  mlxs_say(err, err_len, "%s", e ? "" : "no engine");
  if (!e) return ST_ARGS;
  pthread_mutex_lock(&e->call_lock);
  mlxs_join_started(e);
  int first = ST_OK;
  if (e->pending != 2 || !status) {
    mlxs_say(err, err_len, "no started read to finish");
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

/* 1 when nothing of a started read is left to read or copy: none on the workers. */
int mlxs_staged(Engine *e) {
  if (!e) return 1;
  pthread_mutex_lock(&e->m);
  int staged =
      __atomic_load_n(&e->pending, __ATOMIC_ACQUIRE) != 1 || e->workers_done >= e->n_started;
  pthread_mutex_unlock(&e->m);
  return staged;
}
