-- Every statement pgqueue runs. Each block starts with "-- name: <name>" and a
-- one-line description; parameters are psycopg's %(name)s placeholders.
-- Every write after a claim checks id, fence and status = 'running': zero rows
-- changed means "you no longer own this job".

-- name: check
-- Fails with "relation does not exist" unless the schema is installed; reads no rows.
SELECT 1 FROM jobs LIMIT 0;

-- name: check_claim
-- Fails with "relation does not exist" unless the tables every claim reads are there
-- (a database of an older pgqueue lacks pgqueue_paused until `pgqueue init`).
SELECT 1 FROM pgqueue_paused, pgqueue_limits LIMIT 0;

-- name: pause
-- Pause queue %(queue)s: from their next claim on, no worker claims from it (jobs already
-- running go on; enqueues go on). Returns a row if it was not paused already.
INSERT INTO pgqueue_paused (queue) VALUES (%(queue)s)
ON CONFLICT (queue) DO NOTHING
RETURNING queue;

-- name: resume
-- Resume queue %(queue)s, and wake the idle workers listening for it (a hint, as for an
-- enqueue). Returns a row if it was paused.
WITH resumed AS (
  DELETE FROM pgqueue_paused WHERE queue = %(queue)s RETURNING queue
)
SELECT queue, pg_notify('pgqueue', queue) FROM resumed;

-- name: paused
-- The paused queues, oldest pause first, with when each was paused.
SELECT queue, paused_at FROM pgqueue_paused ORDER BY paused_at, queue;

-- name: enqueue
-- Add one job, runnable at %(run_at)s or %(delay)s seconds from now, in group %(group_key)s
-- (NULL: none); NOTIFY fires at commit.
-- With a %(key)s that a ready or running job of the queue holds, add nothing and return
-- that job's id (added = false). The unique index decides, so racing enqueues cannot both
-- add; a row that the index saw but this statement's snapshot cannot (committed by a
-- racing enqueue a moment ago) returns no row at all: the caller asks again.
WITH added AS (
  INSERT INTO jobs (queue, payload, run_at, max_attempts, priority, key, group_key)
  VALUES (%(queue)s, %(payload)s,
          coalesce(%(run_at)s, now() + make_interval(secs => %(delay)s)), %(max_attempts)s,
          %(priority)s, %(key)s, %(group_key)s)
  ON CONFLICT (queue, key) WHERE key IS NOT NULL AND status IN ('ready', 'running')
  DO NOTHING
  RETURNING id
)
SELECT id, true AS added FROM added
UNION ALL
SELECT id, false FROM jobs
WHERE %(key)s::text IS NOT NULL AND NOT EXISTS (SELECT FROM added)
  AND queue = %(queue)s AND key = %(key)s AND status IN ('ready', 'running');

-- name: enqueue_many
-- Add many jobs in one statement (one notification per queue, not per job).
INSERT INTO jobs (queue, payload, run_at, max_attempts, priority, group_key)
SELECT %(queue)s, p, coalesce(%(run_at)s, now() + make_interval(secs => %(delay)s)),
       %(max_attempts)s, %(priority)s, %(group_key)s
FROM unnest(%(payloads)b::jsonb[]) WITH ORDINALITY AS t(p, n)
ORDER BY n
RETURNING id;

-- name: enqueue_reserve
-- Reserve %(n)s job ids and compute their run_at, before enqueue_copy writes the jobs.
-- jobs_id_seq is the sequence of the bigserial jobs.id (a literal name is resolved once,
-- pg_get_serial_sequence would be looked up again for every id: 7x slower).
SELECT array_agg(nextval('jobs_id_seq')),
       coalesce(%(run_at)s, now() + make_interval(secs => %(delay)s))
FROM generate_series(1, %(n)s);

-- name: enqueue_copy
-- Write many jobs, with their reserved ids, in one binary COPY (faster than INSERT for
-- large batches). One statement: all rows or none, and one notification per queue.
COPY jobs (id, queue, payload, run_at, max_attempts, priority, group_key) FROM STDIN (FORMAT binary);

-- name: enqueue_keyed
-- Add many jobs with keys, under ids reserved by enqueue_reserve: the first of a key wins,
-- inside the batch too. Returns the ids added (key NULL), then the live jobs of the queue
-- that already held one of the keys (id, key).
WITH added AS (
  INSERT INTO jobs (id, queue, payload, run_at, max_attempts, priority, key, group_key)
  SELECT i, %(queue)s, p, %(run_at)s, %(max_attempts)s, %(priority)s, k, %(group_key)s
  FROM unnest(%(ids)s::bigint[], %(payloads)b::jsonb[], %(keys)s::text[])
       WITH ORDINALITY AS t(i, p, k, n)
  ORDER BY n
  ON CONFLICT (queue, key) WHERE key IS NOT NULL AND status IN ('ready', 'running')
  DO NOTHING
  RETURNING id
)
SELECT id, NULL::text FROM added
UNION ALL
SELECT id, key FROM jobs
WHERE queue = %(queue)s AND key = ANY(%(keys)s::text[]) AND status IN ('ready', 'running');

-- name: key_holders
-- The live jobs of %(queue)s that hold one of %(keys)s (a second look, with a new snapshot).
SELECT id, key FROM jobs
WHERE queue = %(queue)s AND key = ANY(%(keys)s::text[]) AND status IN ('ready', 'running');

-- name: claim
-- Take up to %(limit)s ready jobs, highest priority first, then oldest, then first in;
-- SKIP LOCKED lets competing workers pass each other. Returned in that order. For a queue
-- without a per-group limit: one of pgqueue_limits (a primary-key lookup) claims nothing
-- here and answers with one row of NULLs, so the caller sends claim_limited instead. Its
-- guess of which statement a queue needs is only a guess: either statement refuses the
-- queue it does not fit, so a wrong guess costs one round trip and never breaks a limit.
-- A paused queue (a row in pgqueue_paused: Queue.pause, `pgqueue pause`) claims nothing,
-- on every worker and host, from the next claim on: the database decides, in this
-- statement, never a check in a client (a primary-key lookup, once a claim).
WITH limited AS (
  SELECT EXISTS (SELECT FROM pgqueue_limits WHERE queue = %(queue)s) AS yes
),
paused AS (
  SELECT EXISTS (SELECT FROM pgqueue_paused WHERE queue = %(queue)s) AS yes
),
claimed AS (
  UPDATE jobs
  SET status      = 'running',
      attempts    = attempts + 1,
      fence       = fence + 1,
      lease_until = now() + make_interval(secs => %(lease)s),
      started_at  = now(),
      slot        = NULL
  WHERE id IN (
    SELECT id FROM jobs
    WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
      AND NOT (SELECT yes FROM limited) AND NOT (SELECT yes FROM paused)
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
  )
  RETURNING id, queue, payload, fence, attempts, max_attempts, lease_until, priority, run_at
)
(SELECT id, queue, payload, fence, attempts, max_attempts, lease_until,
        extract(epoch FROM now() - run_at)::float8 AS waited
 FROM claimed
 ORDER BY priority DESC, run_at, id)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM limited WHERE yes;

-- name: claim_limited
-- The claim for a queue with a per-group limit (pgqueue_limits): at most per_group jobs
-- of one group_key run at a time; jobs without a group are not limited. The same order as
-- claim, among the jobs the limit allows. A queue without a limit (any more) claims
-- nothing here and answers with one row of NULLs: the caller sends claim instead.
--
-- The database enforces the limit, never a count in a client: each job claimed under a
-- limit takes a slot from 1 to per_group, and jobs_slot_idx (a partial unique index over
-- running jobs) refuses a second running job in a slot. Why that holds whatever the number
-- of workers, hosts or PgBouncer's pooling:
-- - A count read by a claim is of its own snapshot (pgqueuer #761: each claim counted in
--   its own snapshot, SKIP LOCKED slid past the rows the other held, and a limit of 1 ran
--   two). Here the count only chooses which slots to try; the unique index checks a slot
--   against every running row, committed after our snapshot or not. Two claims that saw
--   the same free slot cannot both commit it: the second fails whole (unique_violation on
--   jobs_slot_idx, nothing written) and its caller claims again, with a new snapshot.
-- - A claim gives out slots of a group only under pg_try_advisory_xact_lock on (queue,
--   group), so two claims never write slots of one group at the same moment: the index
--   never makes a claim wait for another's commit, two claims cannot deadlock over two
--   groups, and a claim that cannot get a group's lock passes over its jobs to another
--   group's, as SKIP LOCKED passes rows. The lock is this statement's transaction's,
--   released at its commit, on whatever server connection PgBouncer lent it. Safety does
--   not rest on the lock (a hash collision only makes two groups take turns): the index
--   decides.
-- - Groups whose slots are all taken are passed over in the scan (full_groups), so a busy
--   group never holds up the next runnable job of another (no head-of-line blocking).
-- - A job leaves its slot by leaving 'running' (complete, fail, release, reap, cancel):
--   no other statement needs to know about slots. Jobs running when a limit is set (or
--   claimed by the claim statement as it is set) hold no slot and are not counted.
WITH claim_limit AS (  -- none while the queue is paused: nothing is claimed (see claim)
  SELECT per_group FROM pgqueue_limits
  WHERE queue = %(queue)s AND NOT EXISTS (SELECT FROM pgqueue_paused WHERE queue = %(queue)s)
),
full_groups AS (
  SELECT group_key FROM jobs
  WHERE queue = %(queue)s AND status = 'running' AND slot IS NOT NULL
  GROUP BY group_key
  HAVING count(*) >= (SELECT per_group FROM claim_limit)
),
candidates AS (
  SELECT id, group_key, priority, run_at FROM jobs
  WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
    AND EXISTS (SELECT FROM claim_limit)
    AND (group_key IS NULL
         OR (group_key NOT IN (SELECT group_key FROM full_groups)
             AND pg_try_advisory_xact_lock(hashtext('pgqueue.slots:' || queue),
                                           hashtext(group_key))))
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
),
grouped AS (  -- the candidates with a group, numbered in claim order within their group
  SELECT id, group_key,
         row_number() OVER (PARTITION BY group_key ORDER BY priority DESC, run_at, id) AS nth
  FROM candidates
  WHERE group_key IS NOT NULL
),
groups AS (  -- each of their groups: how many want a slot, how many slots are held
  SELECT w.group_key, w.wanted,
         (SELECT count(*) FROM jobs AS h
          WHERE h.queue = %(queue)s AND h.group_key = w.group_key AND h.status = 'running'
            AND h.slot IS NOT NULL) AS held
  FROM (SELECT group_key, count(*) AS wanted FROM grouped GROUP BY group_key) AS w
),
free_slots AS (  -- each group's lowest free slots, numbered; room: how many it may take
  SELECT g.group_key, s.slot, l.per_group - g.held AS room,
         row_number() OVER (PARTITION BY g.group_key ORDER BY s.slot) AS nth
  FROM groups AS g
  CROSS JOIN claim_limit AS l
  CROSS JOIN LATERAL generate_series(1, least(l.per_group, g.held + g.wanted)) AS s(slot)
  WHERE NOT EXISTS (SELECT FROM jobs AS h
                    WHERE h.queue = %(queue)s AND h.group_key = g.group_key
                      AND h.slot = s.slot AND h.status = 'running')
),
slotted AS (
  SELECT w.id, f.slot
  FROM grouped AS w
  JOIN free_slots AS f ON f.group_key = w.group_key AND f.nth = w.nth AND w.nth <= f.room
),
claimed AS (
  UPDATE jobs
  SET status      = 'running',
      attempts    = attempts + 1,
      fence       = fence + 1,
      lease_until = now() + make_interval(secs => %(lease)s),
      started_at  = now(),
      slot        = slotted.slot
  FROM candidates LEFT JOIN slotted ON slotted.id = candidates.id
  WHERE jobs.id = candidates.id
    AND (candidates.group_key IS NULL OR slotted.slot IS NOT NULL)
  RETURNING jobs.id, jobs.queue, jobs.payload, jobs.fence, jobs.attempts, jobs.max_attempts,
            jobs.lease_until, jobs.priority, jobs.run_at
)
(SELECT id, queue, payload, fence, attempts, max_attempts, lease_until,
        extract(epoch FROM now() - run_at)::float8 AS waited
 FROM claimed
 ORDER BY priority DESC, run_at, id)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE NOT EXISTS (SELECT FROM claim_limit);

-- name: heartbeat
-- Extend one lease and return the new lease_until; no row means the job was taken over.
UPDATE jobs
SET lease_until = now() + make_interval(secs => %(lease)s)
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
RETURNING lease_until;

-- name: heartbeat_many
-- Extend many leases in one statement, with their new lease_until; the (id, fence) pairs
-- not returned were lost. A held row that another session has locked (a psql session's
-- FOR UPDATE, a handler's job.transaction() at its commit) is skipped, not waited for,
-- and returned with a NULL lease_until: still held, not renewed this time. So one locked
-- row never holds up the heartbeats of every other job.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(fences)s::bigint[]) AS held(id, fence)
), free AS (
    SELECT jobs.id
    FROM jobs JOIN held ON jobs.id = held.id AND jobs.fence = held.fence
    WHERE jobs.status = 'running'
    FOR NO KEY UPDATE OF jobs SKIP LOCKED
), renewed AS (
    UPDATE jobs
    SET lease_until = now() + make_interval(secs => %(lease)s)
    FROM free
    WHERE jobs.id = free.id
    RETURNING jobs.id, jobs.fence, jobs.lease_until
)
SELECT id, fence, lease_until FROM renewed
UNION ALL
SELECT jobs.id, jobs.fence, NULL
FROM jobs JOIN held ON jobs.id = held.id AND jobs.fence = held.fence
WHERE jobs.status = 'running' AND jobs.id NOT IN (SELECT id FROM free);

-- name: complete
-- Mark one job done, only if the caller still holds its fence. Every statement that ends a
-- job (done, dead, cancelled) sends its id on pgqueue_done at commit when a Queue.result
-- waits for it (a row in pgqueue_waiters), and only then: a notifying commit takes a lock
-- that every other notifying commit of the server waits for (four sessions completing one
-- job a statement did 1.4x more when only waited-for jobs notified: data/bench_done_notify.csv).
UPDATE jobs
SET status = 'done', lease_until = NULL, finished_at = now()
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
RETURNING CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', id::text) END;

-- name: complete_result
-- complete, storing the handler's return value (JSON text made by the worker) with the job.
UPDATE jobs
SET status = 'done', lease_until = NULL, finished_at = now(), result = %(result)s::jsonb
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
RETURNING CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', id::text) END;

-- name: complete_many
-- Mark many jobs done in one fenced statement; returns the (id, fence) pairs that took effect.
UPDATE jobs
SET status = 'done', lease_until = NULL, finished_at = now()
FROM unnest(%(ids)s::bigint[], %(fences)s::bigint[]) AS held(id, fence)
WHERE jobs.id = held.id AND jobs.fence = held.fence AND jobs.status = 'running'
RETURNING jobs.id, jobs.fence,
          CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', jobs.id::text) END;

-- name: complete_many_results
-- complete_many with each job's return value (NULL: none) beside its id and fence: a
-- stale holder's result is refused with its completion, never written over the new one's.
UPDATE jobs
SET status = 'done', lease_until = NULL, finished_at = now(), result = held.result::jsonb
FROM unnest(%(ids)s::bigint[], %(fences)s::bigint[], %(results)s::text[])
  AS held(id, fence, result)
WHERE jobs.id = held.id AND jobs.fence = held.fence AND jobs.status = 'running'
RETURNING jobs.id, jobs.fence,
          CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', jobs.id::text) END;

-- name: fail
-- Record an error (one line) and its traceback (%(traceback)s: where it was raised, bounded;
-- NULL for a failure that raised nothing, a timeout say); retry after %(delay)s seconds if given, else %(backoff)s * 2^attempts
-- (at most a day: a larger delay would overflow the interval type), or go dead at
-- max_attempts or when %(give_up)s. The fence rises too, so nothing more from this attempt
-- is accepted: not a late write of a handler that timed out, not a second fail.
UPDATE jobs
SET status      = CASE WHEN %(give_up)s OR attempts >= max_attempts THEN 'dead' ELSE 'ready' END,
    run_at      = now() + make_interval(secs => coalesce(%(delay)s::float8,
                    least(%(backoff)s * power(2, least(attempts, 60)), 86400))),
    lease_until = NULL,
    fence       = fence + 1,
    last_error  = %(error)s,
    traceback   = %(traceback)s,
    finished_at = CASE WHEN %(give_up)s OR attempts >= max_attempts THEN now() END
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
RETURNING status, extract(epoch FROM run_at - now())::float8 AS retry_in,
          CASE WHEN status = 'dead' AND EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', id::text) END;

-- name: release
-- Hand a claimed but unstarted job back (graceful stop): the attempt is given back, the
-- fence is not (it only ever rises), so afterwards fence > attempts.
UPDATE jobs
SET status      = 'ready',
    run_at      = now(),
    lease_until = NULL,
    attempts    = attempts - 1
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running';

-- name: reap
-- Return jobs whose lease ran out; jobs that used every attempt go dead. last_error says
-- why: a job that crashes its worker every time goes dead with this note, not a blank.
-- SKIP LOCKED: a row another session has locked is left for the next round, never waited
-- for (a reaper stuck behind one lock would hold up whatever shares its connection).
UPDATE jobs
SET status      = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END,
    run_at      = now(),
    lease_until = NULL,
    finished_at = CASE WHEN attempts >= max_attempts THEN now() END,
    traceback   = NULL,  -- no exception: the worker stopped
    last_error  = 'lease ran out on attempt ' || attempts || ' of ' || max_attempts
                  || ': its worker stopped heartbeating (crashed, hung or cut off)'
WHERE id IN (
    SELECT id FROM jobs
    WHERE status = 'running' AND lease_until < now()
    FOR NO KEY UPDATE SKIP LOCKED
)
AND status = 'running' AND lease_until < now()
RETURNING id, queue, status, fence,
          CASE WHEN status = 'dead' AND EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = jobs.id)
               THEN pg_notify('pgqueue_done', id::text) END;

-- name: holds
-- Whether job %(job)s is still held with fence %(fence)s: running, that fence, and a lease
-- that has not run out by the server's clock at this statement. Job.fenced_write puts it in
-- the write's own statement, so a holder that was reaped, timed out, failed or cancelled is
-- refused at once, even where no newer holder has written yet (as of that statement: in a
-- longer transaction, hold_for_commit is what holds the claim to the commit).
SELECT 1 FROM jobs
WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'
  AND lease_until > statement_timestamp()

-- name: hold_for_commit_wait
-- How long hold_for_commit may wait for the job row (%(ms)s milliseconds, as text), for the
-- rest of this transaction only: a row locked by another session fails the check, never
-- hangs the handler.
SELECT set_config('lock_timeout', %(ms)s, true)

-- name: hold_for_commit
-- The last statement of a job.transaction() before COMMIT: is job %(job)s still held with
-- fence %(fence)s (running, that fence, a lease the server's clock has not passed), and
-- hold the row so that it stays so until the commit. FOR SHARE, not the weaker FOR KEY
-- SHARE: fail, reap and heartbeat are UPDATEs of non-key columns (FOR NO KEY UPDATE),
-- which FOR KEY SHARE lets through, so a job could be failed or reaped between this check
-- and the commit; FOR SHARE makes them, and cancel, wait for the commit (a heartbeat too,
-- for the one round trip to COMMIT). clock_timestamp(), not now(): now() is when the
-- transaction began, and a lease that ran out since then would still pass; after a wait
-- for the lock, the row is checked again as it is then.
SELECT 1 FROM jobs
WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'
  AND lease_until > clock_timestamp()
FOR SHARE

-- name: retry_dead
-- Give the dead jobs of a queue %(extra)s more attempts (attempts and fence keep counting).
-- A dead job whose key is taken stays dead: by a ready or running job of the queue, or by
-- a newer dead job of that key retried now. One row per dead job: its id, and for one left
-- dead its key and the job that holds it. The unique index still decides: a key taken by
-- an enqueue this statement's snapshot cannot see fails it whole (the caller runs it again).
WITH dead AS (
  SELECT d.id, d.key, coalesce(
           (SELECT live.id FROM jobs AS live
            WHERE live.queue = d.queue AND live.key = d.key
              AND live.status IN ('ready', 'running')),
           nullif(max(d.id) OVER (PARTITION BY d.key), d.id)) AS held_by
  FROM jobs AS d
  WHERE d.queue = %(queue)s AND d.status = 'dead'
),
retried AS (
  UPDATE jobs
  SET status       = 'ready',
      run_at       = now(),
      max_attempts = jobs.attempts + %(extra)s,
      last_error   = NULL,
      finished_at  = NULL
  FROM dead
  WHERE jobs.id = dead.id AND jobs.status = 'dead'
    AND (dead.key IS NULL OR dead.held_by IS NULL)
  RETURNING jobs.id
)
SELECT id, NULL::text AS key, NULL::bigint AS held_by FROM retried
UNION ALL
SELECT id, key, held_by FROM dead WHERE key IS NOT NULL AND held_by IS NOT NULL;

-- name: retry_dead_ids
-- Like retry_dead, for the dead jobs among %(ids)s: of any queue when %(queue)s is NULL,
-- else only that queue's.
WITH dead AS (
  SELECT d.id, d.key, coalesce(
           (SELECT live.id FROM jobs AS live
            WHERE live.queue = d.queue AND live.key = d.key
              AND live.status IN ('ready', 'running')),
           nullif(max(d.id) OVER (PARTITION BY d.queue, d.key), d.id)) AS held_by
  FROM jobs AS d
  WHERE d.id = ANY(%(ids)s::bigint[]) AND d.status = 'dead'
    AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
),
retried AS (
  UPDATE jobs
  SET status       = 'ready',
      run_at       = now(),
      max_attempts = jobs.attempts + %(extra)s,
      last_error   = NULL,
      finished_at  = NULL
  FROM dead
  WHERE jobs.id = dead.id AND jobs.status = 'dead'
    AND (dead.key IS NULL OR dead.held_by IS NULL)
  RETURNING jobs.id
)
SELECT id, NULL::text AS key, NULL::bigint AS held_by FROM retried
UNION ALL
SELECT id, key, held_by FROM dead WHERE key IS NOT NULL AND held_by IS NOT NULL;

-- name: cancel
-- Cancel a ready or running job. Its fence rises, so a running job's holder is refused
-- from now on (heartbeat, complete, fail, fenced writes) and learns it through job.lost:
-- the fence does the cancelling. Returns the status it had.
UPDATE jobs AS j
SET status = 'cancelled', fence = j.fence + 1, lease_until = NULL, finished_at = now()
FROM (SELECT id, status FROM jobs WHERE id = %(id)s FOR UPDATE) AS before
WHERE j.id = before.id AND before.status IN ('ready', 'running')
RETURNING before.status,
          CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = j.id)
               THEN pg_notify('pgqueue_done', j.id::text) END;

-- name: cancel_many
-- cancel for many ids in one statement: each ready or running job among %(ids)s is
-- cancelled and its fence rises, so a running job's holder is refused from then on; a
-- waiting Queue.result hears of it. Rows are locked in id order (two bulk cancels cannot
-- deadlock). Returns the ids cancelled.
UPDATE jobs AS j
SET status = 'cancelled', fence = j.fence + 1, lease_until = NULL, finished_at = now()
FROM (SELECT id, status FROM jobs WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE)
  AS before
WHERE j.id = before.id AND before.status IN ('ready', 'running')
RETURNING j.id,
          CASE WHEN EXISTS (SELECT FROM pgqueue_waiters w WHERE w.job_id = j.id)
               THEN pg_notify('pgqueue_done', j.id::text) END;

-- name: get
-- One job as it is now, by id (for inspection, and to learn how a write whose reply was
-- lost ended).
SELECT id, queue, status, payload, priority, key, attempts, max_attempts, fence, run_at,
       lease_until, started_at, finished_at, last_error, group_key, result, traceback
FROM jobs
WHERE id = %(id)s;

-- name: result
-- What Queue.result reads: a job's status, its stored result and its last error.
SELECT status, result, last_error FROM jobs WHERE id = %(id)s;

-- name: listen_done
-- Hear pgqueue_done: the id of each job as it ends (Queue.result waits on it).
LISTEN pgqueue_done;

-- name: unlisten_done
UNLISTEN pgqueue_done;

-- name: wait_for
-- Queue.result asks for job %(id)s's end to be notified (after its LISTEN, before it reads
-- the job): the statements that end a job notify only for jobs in this table.
INSERT INTO pgqueue_waiters (job_id) VALUES (%(id)s) ON CONFLICT DO NOTHING;

-- name: wait_done
-- Queue.result has its answer (or gave up): no more notifications for this session's wait.
DELETE FROM pgqueue_waiters WHERE job_id = %(id)s AND pid = pg_backend_pid();

-- name: stats
-- Live and dead jobs by queue, read through the partial indexes, so its cost does not grow
-- with the done jobs the table holds: how many are ready, running and dead, how long the
-- oldest runnable job has waited, and the latest error (of a job waiting to retry, or dead).
-- Each latest error is one row looked up per queue (the dead one through jobs_dead_idx,
-- newest first), not picked from an aggregate of every error text.
SELECT r.queue, 'ready' AS status, r.jobs, r.oldest_ready_seconds,
       (SELECT j.last_error FROM jobs AS j
        WHERE j.queue = r.queue AND j.status = 'ready' AND j.last_error IS NOT NULL
        ORDER BY j.started_at DESC NULLS LAST
        LIMIT 1) AS latest_error
FROM (SELECT queue, count(*) AS jobs,
             extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8
               AS oldest_ready_seconds
      FROM jobs WHERE status = 'ready' GROUP BY queue) AS r
UNION ALL
SELECT queue, 'running', count(*), NULL, NULL
FROM jobs WHERE status = 'running' GROUP BY queue
UNION ALL
SELECT d.queue, 'dead', d.jobs, NULL,
       coalesce((SELECT j.last_error FROM jobs AS j
                 WHERE j.queue = d.queue AND j.status = 'dead' AND j.finished_at IS NOT NULL
                 ORDER BY j.finished_at DESC
                 LIMIT 1),
                -- only dead jobs from before finished_at existed: any one of them
                (SELECT j.last_error FROM jobs AS j
                 WHERE j.queue = d.queue AND j.status = 'dead' AND j.finished_at IS NULL
                 LIMIT 1))
FROM (SELECT queue, count(*) AS jobs FROM jobs WHERE status = 'dead' GROUP BY queue) AS d
ORDER BY 1, 2;

-- name: stats_exact
-- Every job counted by queue and status: reads the whole table (use stats for monitoring).
SELECT queue, status, count(*) AS jobs,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'ready' AND run_at <= now()))::float8
         AS oldest_ready_seconds,
       (array_agg(last_error ORDER BY coalesce(finished_at, started_at) DESC NULLS LAST)
          FILTER (WHERE last_error IS NOT NULL AND status IN ('ready', 'dead')))[1] AS latest_error
FROM jobs
GROUP BY queue, status
ORDER BY queue, status;

-- name: stats_rows
-- The planner's estimate of the table's rows (from the last VACUUM or ANALYZE; -1 before
-- either): stats subtracts the live jobs to estimate the finished ones without counting.
-- Before either, a table of at most 8 MB (a fresh queue after a small run) has its finished
-- jobs counted instead: a scan that size takes milliseconds. A larger one is not read.
SELECT c.reltuples::float8,
       CASE WHEN c.reltuples < 0 AND pg_relation_size(c.oid) <= 8 * 1024 * 1024
            THEN (SELECT count(*) FROM jobs WHERE status IN ('done', 'cancelled'))
       END AS finished
FROM pg_class AS c WHERE c.oid = 'jobs'::regclass;

-- name: id_span
-- The smallest and largest job id (two ends of the primary key: cheap): where prune stops.
SELECT min(id), max(id) FROM jobs;

-- name: prune
-- Look at the next %(batch)s jobs after id %(after)s (up to id %(upto)s), in id order, and
-- delete those finished (done or cancelled) more than %(older_than)s seconds ago: one short
-- transaction per batch of jobs, so a run takes statements in proportion to the jobs the
-- table holds, never to the span of their ids. Returns the last id looked at (NULL: none
-- left) and how many were deleted. Rows finished before finished_at existed count from run_at.
-- The durable steps of the jobs deleted are deleted in the same statement.
WITH batch AS (
  SELECT max(id) AS last
  FROM (SELECT id FROM jobs
        WHERE id > %(after)s AND id <= %(upto)s
        ORDER BY id
        LIMIT %(batch)s) AS next_jobs
),
gone AS (
  DELETE FROM jobs
  WHERE id > %(after)s AND id <= (SELECT last FROM batch) AND status IN ('done', 'cancelled')
    AND coalesce(finished_at, run_at) < now() - make_interval(secs => %(older_than)s)
  RETURNING id
),
steps_gone AS (  -- a job's durable steps go with it
  DELETE FROM pgqueue_steps WHERE job_id IN (SELECT id FROM gone)
)
SELECT (SELECT last FROM batch), (SELECT count(*) FROM gone);

-- name: prune_archive
-- Like prune, but move the jobs into jobs_archive (and their durable steps into
-- pgqueue_steps_archive), in one statement per batch.
WITH batch AS (
  SELECT max(id) AS last
  FROM (SELECT id FROM jobs
        WHERE id > %(after)s AND id <= %(upto)s
        ORDER BY id
        LIMIT %(batch)s) AS next_jobs
),
moved AS (
  DELETE FROM jobs
  WHERE id > %(after)s AND id <= (SELECT last FROM batch) AND status IN ('done', 'cancelled')
    AND coalesce(finished_at, run_at) < now() - make_interval(secs => %(older_than)s)
  RETURNING *
),
archived AS (
  INSERT INTO jobs_archive SELECT * FROM moved RETURNING 1
),
steps_moved AS (  -- a job's durable steps go with it, to pgqueue_steps_archive
  DELETE FROM pgqueue_steps WHERE job_id IN (SELECT id FROM moved)
  RETURNING job_id, name, output, fence, written_at
),
steps_archived AS (
  INSERT INTO pgqueue_steps_archive (job_id, name, output, fence, written_at)
  SELECT job_id, name, output, fence, written_at FROM steps_moved
)
SELECT (SELECT last FROM batch), (SELECT count(*) FROM archived);

-- name: set_limit
-- Let at most %(per_group)s jobs of one group of %(queue)s run at once, from the next claim
-- on (replacing any limit it had).
INSERT INTO pgqueue_limits (queue, per_group) VALUES (%(queue)s, %(per_group)s)
ON CONFLICT (queue) DO UPDATE SET per_group = excluded.per_group;

-- name: remove_limit
-- Lift the per-group limit of %(queue)s; returns the limit it had (no row: none).
DELETE FROM pgqueue_limits WHERE queue = %(queue)s RETURNING per_group;

-- name: limits
-- Every queue's per-group limit, with how many of its jobs run in slots now (under it).
SELECT l.queue, l.per_group,
       (SELECT count(*) FROM jobs
        WHERE jobs.queue = l.queue AND status = 'running' AND slot IS NOT NULL) AS running
FROM pgqueue_limits AS l
ORDER BY l.queue;

-- name: notify_off
-- Stop the wake-up hints: enqueues skip the NOTIFY (and its commit-time lock); workers poll.
DROP TRIGGER IF EXISTS jobs_notify_insert ON jobs;

-- name: schedule_clock
-- What a tick plans from (pgqueue/periodic.py): the server's clock and the last slot of each
-- schedule named (one without a row is not returned); one row even when none has a row.
SELECT clock.now, s.name, s.last_slot
FROM (SELECT now() AS now) AS clock
LEFT JOIN pgqueue_schedules AS s ON s.name = ANY(%(names)s::text[]);

-- name: schedule_add
-- A schedule seen for the first time starts at the newest of %(slots)s not after now(): no
-- job for that one, its first job is for the next slot. The first worker to add it wins.
INSERT INTO pgqueue_schedules (name, spec, queue, last_slot, next_slot)
SELECT %(name)s, %(spec)s, %(queue)s,
       max(c.slot) FILTER (WHERE c.slot <= now()), min(c.slot) FILTER (WHERE c.slot > now())
FROM unnest(%(slots)s::timestamptz[]) AS c(slot)
HAVING max(c.slot) FILTER (WHERE c.slot <= now()) IS NOT NULL
ON CONFLICT (name) DO NOTHING;

-- name: schedule_tick
-- Make the jobs of one schedule's due slots, deciding on the database's clock:
-- - due: the slots of %(slots)s after the schedule's last slot and not after now(), the last
--   slot read under the row's lock (SKIP LOCKED: a worker ticking this schedule right now
--   holds it, and this statement does nothing);
-- - a due slot older than %(grace)s seconds was missed; %(catch_up)s says which missed slots
--   still get a job: 'latest' the newest, 'all' the newest %(bound)s due ones, 'none' none;
-- - each chosen slot takes its row in pgqueue_slots first: the primary key (schedule, slot)
--   lets one job exist per slot, whatever a stale worker believes (ON CONFLICT DO NOTHING),
--   and the job is added under the id its slot row names, in this same statement;
-- - the last slot moves to the newest due one, and slot rows %(keep)s older are deleted.
-- Returns how many jobs it made.
WITH schedule AS (
  SELECT last_slot FROM pgqueue_schedules WHERE name = %(name)s FOR UPDATE SKIP LOCKED
), due AS (
  SELECT c.slot,
         c.slot >= now() - make_interval(secs => %(grace)s) AS on_time,
         row_number() OVER (ORDER BY c.slot DESC) AS newest
  FROM schedule, unnest(%(slots)s::timestamptz[]) AS c(slot)
  WHERE c.slot > schedule.last_slot AND c.slot <= now()
), chosen AS (
  SELECT slot FROM due
  WHERE on_time
     OR (%(catch_up)s::text = 'all' AND newest <= %(bound)s)
     OR (%(catch_up)s::text = 'latest' AND slot = (SELECT max(slot) FROM due WHERE NOT on_time))
), taken AS (
  INSERT INTO pgqueue_slots (schedule, slot, job_id)
  SELECT %(name)s, slot, nextval('jobs_id_seq')
  FROM (SELECT slot FROM chosen ORDER BY slot) AS oldest_first
  ON CONFLICT (schedule, slot) DO NOTHING
  RETURNING slot, job_id
), made AS (
  INSERT INTO jobs (id, queue, payload, max_attempts, priority)
  SELECT job_id, %(queue)s,
         jsonb_build_object('task', %(task)s::text, 'kwargs', '{}'::jsonb,
                            'schedule', %(name)s::text, 'slot', slot),
         %(max_attempts)s, %(priority)s
  FROM taken
  ORDER BY job_id
  RETURNING id
), moved AS (
  UPDATE pgqueue_schedules
  SET last_slot  = (SELECT max(slot) FROM due),
      next_slot  = coalesce((SELECT min(c.slot) FROM unnest(%(slots)s::timestamptz[]) AS c(slot)
                             WHERE c.slot > now()), next_slot),
      spec       = %(spec)s,
      queue      = %(queue)s,
      updated_at = now()
  WHERE name = %(name)s AND EXISTS (SELECT FROM due)
), forgotten AS (
  DELETE FROM pgqueue_slots
  WHERE schedule = %(name)s AND slot < (SELECT max(slot) FROM due) - %(keep)s::interval
)
SELECT count(*) FROM made;

-- name: schedules
-- Every schedule: what it runs, its last slot and its next, as of the last tick that moved
-- it (a next slot long past means no worker runs its queue).
SELECT name, spec, queue, last_slot, next_slot FROM pgqueue_schedules ORDER BY name;

-- name: step_get
-- The stored output of step %(name)s of job %(job)s (no row: not done yet). Any claim's:
-- a step stored by an earlier attempt is the answer, and is not run again.
SELECT output FROM pgqueue_steps WHERE job_id = %(job)s AND name = %(name)s;

-- name: step_put
-- Store the output of step %(name)s of job %(job)s, only while the caller holds the claim
-- with fence %(fence)s: the check and the write are this one statement. held takes the job
-- row FOR SHARE (running, this fence, a lease the server's clock has not passed), so a
-- takeover, cancel, reap or fail (each an UPDATE of the row) waits for this statement, or
-- for the commit of the transaction it is in, and cannot slip between check and write.
-- clock_timestamp(), not now(): inside a transaction now() is when it began, and a lease
-- that ran out since would still pass; after a wait for the lock the row is checked again
-- as it is then. A stale holder's attempt stores nothing (held is false). A step already
-- stored stays as it is (DO NOTHING: a step once stored is the answer): that can only be
-- this claim's own earlier write (two calls of one step, or a write whose reply was lost),
-- as an older claim's write commits before the claim that ends it. Returns whether the
-- claim held and whether this statement stored the output.
WITH held AS (
  SELECT id, fence FROM jobs
  WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'
    AND lease_until > clock_timestamp()
  FOR SHARE
), stored AS (
  INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at)
  SELECT id, %(name)s, %(output)s, fence, clock_timestamp() FROM held
  ON CONFLICT (job_id, name) DO NOTHING
  RETURNING 1
)
SELECT EXISTS (SELECT FROM held) AS held, EXISTS (SELECT FROM stored) AS stored;

-- name: step_put_held
-- step_put inside a job.transaction(): the same check and write, without the FOR SHARE.
-- That transaction's last statement (hold_for_commit) checks the claim again and holds the
-- row to COMMIT, so a step that commits was made under a claim that still held; a lock
-- taken here would last to that COMMIT and make every heartbeat of the job pass it by
-- (heartbeat_many skips locked rows), so a block longer than the lease lost its claim.
WITH held AS (
  SELECT id, fence FROM jobs
  WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'
    AND lease_until > clock_timestamp()
), stored AS (
  INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at)
  SELECT id, %(name)s, %(output)s, fence, clock_timestamp() FROM held
  ON CONFLICT (job_id, name) DO NOTHING
  RETURNING 1
)
SELECT EXISTS (SELECT FROM held) AS held, EXISTS (SELECT FROM stored) AS stored;

-- name: steps
-- The durable steps job %(job)s has stored, in the order they were written.
SELECT name, fence, written_at, output FROM pgqueue_steps
WHERE job_id = %(job)s
ORDER BY written_at, name;
