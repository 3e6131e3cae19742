/* The eviction ranking in native code (policy.c); driven through ctypes by scored.py's
   Scored, which owns every array named here. */
#ifndef MLXS_POLICY_H
#define MLXS_POLICY_H

#include <stdint.h>

typedef struct {
  int64_t experts;         /* E */
  int64_t history;         /* H: rows of cum (the longest window + 1) */
  int64_t nwin;            /* windows */
  int64_t nrec;            /* entries of log1p_rec */
  int64_t nage;            /* entries of age_pow */
  int64_t *t;              /* lookups so far (one value) */
  int64_t *last;           /* [E] lookup of each expert's last use, -1: never */
  uint8_t *resident;       /* [E] */
  uint8_t *pinned;         /* [E] never victims */
  float *trans;            /* [E * E] transition counts: e at t -> e' at t + 1 */
  float *row;              /* [E] their row sums */
  double *cum;             /* [H * E] running lookup counts, row t % H */
  double *aged;            /* [E] decayed counts as of aged_at */
  int64_t *aged_at;        /* [E] */
  int64_t *prev;           /* [E] the last lookup's experts */
  int64_t *nprev;          /* how many (one value) */
  const int64_t *windows;  /* [nwin] */
  const double *weights;   /* [nwin + 3]: recency, windows, transitions, aged */
  const double *log1p_rec; /* [nrec] log1p of each recency, the last for older */
  const double *age_pow;   /* [nage] AGE ** d, the last for larger d */
  double *scores;          /* [E] scratch */
  uint8_t *mark;           /* [E] scratch */
} mlxs_scored;

/* One lookup of distinct experts idx[0..n): the ranking's update. 0, or -1 for bad ids. */
int mlxs_scored_access(mlxs_scored *p, const int64_t *idx, int n);

/* Up to n resident, unpinned experts outside protect[0..nprotect) (the call's experts,
   sorted) to evict, best first, into out; the transition score follows protect, or the
   last lookup where it is empty. The count, or -1 for bad ids. */
int mlxs_scored_victims(mlxs_scored *p, int n, const int64_t *protect, int nprotect, int64_t *out);

#endif
