/* The eviction ranking's arithmetic (scored.py, class Scored) on arrays that Python owns:
   one call per lookup, one per choice of victims. The scores are the numpy reference's to
   the bit: the same operations in the same order, in the same precisions, transcendental
   functions read from tables that Python filled, terms of weight 0 left out, and no fused
   multiply-adds (setup.py builds with -ffp-contract=off). */
#include <stdint.h>
#include <string.h>

#include "policy.h"

static int64_t clamp(int64_t v, int64_t hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

/* Is every expert id in idx[0..n) in [0, E)? */
static int valid(const mlxs_scored *p, const int64_t *idx, int n) {
  if (n < 0 || n > p->experts) return 0;
  for (int i = 0; i < n; i++)
    if (idx[i] < 0 || idx[i] >= p->experts) return 0;
  return 1;
}

int mlxs_scored_access(mlxs_scored *p, const int64_t *idx, int n) {
  if (!valid(p, idx, n)) return -1;
  const int64_t E = p->experts, H = p->history, t = *p->t;
  for (int64_t i = 0; i < *p->nprev; i++) { /* transitions: prev -> idx */
    const int64_t a = p->prev[i];
    for (int j = 0; j < n; j++) p->trans[a * E + idx[j]] += 1.0f;
    p->row[a] += 1.0f;
  }
  memcpy(p->prev, idx, sizeof(int64_t) * (size_t)n);
  *p->nprev = n;
  double *cur = p->cum + (t % H) * E; /* running counts up to this lookup */
  if (t)
    memcpy(cur, p->cum + ((t - 1) % H) * E, sizeof(double) * (size_t)E);
  else
    memset(cur, 0, sizeof(double) * (size_t)E);
  for (int j = 0; j < n; j++) {
    const int64_t e = idx[j];
    cur[e] += 1.0;
    p->aged[e] = p->aged[e] * p->age_pow[clamp(t - p->aged_at[e], p->nage - 1)] + 1.0;
    p->aged_at[e] = t;
    p->last[e] = t;
  }
  *p->t = t + 1;
  return 0;
}

/* The score of expert e (Scored.scores, one element), given the transition rows of
   the call being served. */
static double score(const mlxs_scored *p, int64_t e, const int64_t *cur, int ncur) {
  const int64_t E = p->experts, H = p->history, t = *p->t, last = t - 1;
  const int64_t rec = p->last[e] >= 0 ? clamp(t - p->last[e], p->nrec - 1) : p->nrec - 1;
  const double *w = p->weights;
  double s = 0.0;
  if (w[0] != 0.0) s = s + w[0] * p->log1p_rec[rec];
  const double now = last >= 0 ? p->cum[(last % H) * E + e] : 0.0;
  for (int i = 0; i < p->nwin; i++) {
    const int64_t span = p->windows[i];
    const double win = last >= span ? now - p->cum[((last - span) % H) * E + e] : now;
    if (w[1 + i] != 0.0) s = s + w[1 + i] * win;
  }
  if (w[1 + p->nwin] != 0.0) {
    float tr = 0.0f;
    for (int i = 0; i < ncur; i++) {
      const float r = p->row[cur[i]];
      tr = tr + p->trans[cur[i] * E + e] / (r > 1.0f ? r : 1.0f);
    }
    s = s + w[1 + p->nwin] * (double)tr;
  }
  if (w[2 + p->nwin] != 0.0) {
    const double aged = p->aged[e] * p->age_pow[clamp(last - p->aged_at[e], p->nage - 1)];
    s = s + w[2 + p->nwin] * aged;
  }
  return s;
}

/* Does candidate a go before b: lower score, then older, then lower id? */
static int before(double sa, int64_t la, int64_t a, double sb, int64_t lb, int64_t b) {
  if (sa != sb) return sa < sb;
  if (la != lb) return la < lb;
  return a < b;
}

int mlxs_scored_victims(mlxs_scored *p, int n, const int64_t *protect, int nprotect, int64_t *out) {
  if (n < 0 || !valid(p, protect, nprotect)) return -1;
  const int64_t *cur = nprotect ? protect : p->prev;
  const int ncur = nprotect ? nprotect : (int)*p->nprev;
  if (!valid(p, cur, ncur)) return -1;
  const int64_t E = p->experts;
  uint8_t *ok = p->mark;
  for (int64_t e = 0; e < E; e++) ok[e] = p->resident[e] != 0 && p->pinned[e] == 0;
  for (int i = 0; i < nprotect; i++) ok[protect[i]] = 0;
  int64_t cands = 0;
  for (int64_t e = 0; e < E; e++) cands += ok[e];
  int found = 0;
  if (cands <= n) { /* every candidate, in id order */
    for (int64_t e = 0; e < E; e++)
      if (ok[e]) out[found++] = e;
    return found;
  }
  double *s = p->scores;
  for (int64_t e = 0; e < E; e++)
    if (ok[e]) s[e] = score(p, e, cur, ncur);
  for (; found < n; found++) { /* n smallest, best first (n is a call's misses) */
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++)
      if (ok[e] && (best < 0 || before(s[e], p->last[e], e, s[best], p->last[best], best)))
        best = e;
    ok[best] = 0;
    out[found] = best;
  }
  return found;
}
