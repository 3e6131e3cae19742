/* The poster's side of the request ring's entries (engine_ring.c answers them): what
 * io.ring's host poster calls, and what a kernel does with its own instructions. */
#include "engine.h"

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
