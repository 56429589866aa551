/* msv_sleep: put tags to sleep, each by its action, in three steps. Everything is checked before a
 * byte moves; phase 1 copies out every OFFLOAD tag (device memory untouched until all copies
 * succeed, so a failure leaves every tag as it was); phase 2 drops the physical memory, keeping each
 * tag's virtual range so wake brings every address back unchanged. */
#include "allocator_internal.h"

/* The one place that knows which action codes exist and what each does to a tag in each state
 * (msv.h's MSV_ACTION_*, the proto's TagAction): a new action is a column here, then its copies
 * below. An awake tag goes to sleep as its action says; a sleeper only moves further down without
 * waking: from host memory to disk, or from either to DISCARD (level 1 to level 2). Every row lists all
 * MSV_ACTIONS entries (a missing one would read 0, MSV_TAG_AWAKE); tests/native/test_disk_tier.py holds
 * the whole table to memsvc/vocabulary.py's copy, entry by entry. */
#define R MSV_SLEEP_REFUSED
static const signed char SLEEP_RULE[MSV_TAG_STATES][MSV_ACTIONS] = {
    /*                     none  OFFLOAD            DISCARD            KEEP               OFFLOAD_DISK */
    [MSV_TAG_AWAKE] = {R, MSV_TAG_OFFLOADED, MSV_TAG_DISCARDED, MSV_TAG_AWAKE, MSV_TAG_ON_DISK},
    [MSV_TAG_OFFLOADED] = {R, R, MSV_TAG_DISCARDED, MSV_TAG_OFFLOADED, MSV_TAG_ON_DISK},
    [MSV_TAG_DISCARDED] = {R, R, R, MSV_TAG_DISCARDED, R},
    [MSV_TAG_ON_DISK] = {R, R, MSV_TAG_DISCARDED, MSV_TAG_ON_DISK, R},
};
#undef R

int msv_sleep_rule(int state, int action) {
  if (state < 0 || state >= MSV_TAG_STATES || action < 0 || action >= MSV_ACTIONS) return MSV_SLEEP_REFUSED;
  return SLEEP_RULE[state][action];
}

int msv_sleep(msv_allocator *a, const char **tags, const int *actions, size_t n) {
  int rc = begin_transition(a);
  if (rc) return rc;
  double t0 = now_s();
  int *idx = calloc(n ? n : 1, sizeof *idx);
  uint64_t **sums = calloc(n ? n : 1, sizeof *sums);
  if (!idx || !sums) {
    rc = msv_fail(MSV_E_OOM, "out of host memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    if ((rc = check_tag(tags[i]))) goto out;
    if (msv_sleep_rule(MSV_TAG_AWAKE, actions[i]) == MSV_SLEEP_REFUSED) {
      rc = msv_fail(MSV_E_INVALID, "tag '%s': unknown action %d", tags[i], actions[i]);
      goto out;
    }
    idx[i] = find_arena(a, tags[i]);
    if (idx[i] < 0) {
      rc = msv_fail(MSV_E_NOT_FOUND, "unknown tag '%s': nothing was ever allocated under it", tags[i]);
      goto out;
    }
    for (size_t j = 0; j < i; j++)
      if (idx[j] == idx[i]) {
        rc = msv_fail(MSV_E_INVALID, "tag '%s' named twice", tags[i]);
        goto out;
      }
    /* A sleeper may be demoted (the rule): an offloaded tag to disk (frees its host copy, keeps its
     * bytes), an offloaded or on-disk one to DISCARD (level 1 -> level 2: frees its copy). */
    if (msv_sleep_rule(a->arenas[idx[i]]->state, actions[i]) == MSV_SLEEP_REFUSED) {
      rc = msv_fail(MSV_E_STATE, "tag '%s' is already asleep", tags[i]);
      goto out;
    }
    if (actions[i] == MSV_ACTION_OFFLOAD_DISK && !a->cfg.offload_dir[0]) {
      rc = msv_fail(MSV_E_STATE, "tag '%s': this worker has no disk tier: start it with an offload directory", tags[i]);
      goto out;
    }
  }
  /* Phase 1: copy out everything to keep (device memory untouched until all copies succeed); a
   * demotion to disk writes its file, keeping the host copy until phase 2. */
  for (size_t i = 0; i < n && !rc; i++) {
    int to_host = actions[i] == MSV_ACTION_OFFLOAD, to_disk = actions[i] == MSV_ACTION_OFFLOAD_DISK;
    if (!to_host && !to_disk) continue;
    int awake = a->arenas[idx[i]]->state == MSV_TAG_AWAKE;
    /* With a disk tier every kept tag is summed, checksums on or off: a file is a copy nothing else
     * checks, and a host copy may be demoted to one later. */
    int sum = a->cfg.checksum || a->cfg.offload_dir[0];
    size_t ns = 0;
    if (awake && sum && (rc = checksum_arena(a, idx[i], &sums[i], &ns))) break;
    rc = to_host ? offload_arena(a, idx[i]) : disk_write(a, idx[i]);
  }
  /* No copy on the allocator's stream may still touch what phase 2 drops: the offloads above waited
   * for their own, but a block copy enqueued without waiting may be in flight (alone, for a sleep
   * that only discards). */
  if (!rc) rc = a->b->sync(a->b, 0);
  if (rc) {
    for (size_t i = 0; i < n; i++) {
      arena *ar = a->arenas[idx[i]];
      if (ar->state != MSV_TAG_AWAKE) disk_abandon(ar); /* a demotion: the host copy stays */
      else if (actions[i] == MSV_ACTION_OFFLOAD || actions[i] == MSV_ACTION_OFFLOAD_DISK) drop_backup(a, ar);
    }
    msv_hostpool_trim(&a->hp);
    goto out;
  }
  /* Phase 2: drop the physical memory (or, for a demotion, the host copy). */
  double unmap_seconds = 0;
  for (size_t i = 0; i < n; i++) {
    if (actions[i] == MSV_ACTION_KEEP) continue;
    arena *ar = a->arenas[idx[i]];
    if (ar->state == MSV_TAG_OFFLOADED && actions[i] == MSV_ACTION_OFFLOAD_DISK) {
      disk_commit(a, ar);
      ar->state = msv_sleep_rule(ar->state, actions[i]);
      continue;
    }
    if (ar->state != MSV_TAG_AWAKE) { /* a demotion to DISCARD */
      drop_backup(a, ar);
      ar->state = msv_sleep_rule(ar->state, actions[i]);
      ar->discarded = ar->allocated;
      continue;
    }
    double tu = now_s();
    int urc = unmap_all(a, ar);
    unmap_seconds += now_s() - tu;
    if (urc && !rc) rc = urc;
    /* Nothing dropped: the tag stays awake (its backup is released below). Anything dropped: it
     * is asleep, and wake maps back exactly the extents that are gone. */
    if (urc && mapped_bytes(ar) == ar->frontier) continue;
    int kept = actions[i] == MSV_ACTION_OFFLOAD || actions[i] == MSV_ACTION_OFFLOAD_DISK;
    ar->state = msv_sleep_rule(MSV_TAG_AWAKE, actions[i]);
    ar->discarded = actions[i] == MSV_ACTION_DISCARD ? ar->allocated : 0;
    if (actions[i] == MSV_ACTION_OFFLOAD_DISK) disk_commit(a, ar);
    if (kept) {
      a->ctr.bytes_offloaded += ar->offloaded;
      if (sums[i]) keep_sums(a, idx[i], sums[i]);
    }
  }
  for (size_t i = 0; i < n; i++) {
    arena *ar = a->arenas[idx[i]];
    int kept = actions[i] == MSV_ACTION_OFFLOAD || actions[i] == MSV_ACTION_OFFLOAD_DISK;
    if (kept && ar->state == MSV_TAG_AWAKE) drop_backup(a, ar);
  }
  msv_hostpool_trim_async(&a->hp);
  a->ctr.sleeps++;
  a->ctr.last_sleep_seconds = now_s() - t0;
  a->ctr.last_sleep_unmap_seconds = unmap_seconds;
out:
  if (sums)
    for (size_t i = 0; i < n; i++) free(sums[i]);
  free(sums), free(idx);
  end_transition(a);
  return rc;
}
