-- The statements of the web dashboard (pgqueue.contrib.dashboard) that the library has no
-- method for. Everything the library can do already (stats, get, steps, schedules,
-- limits, cancel one job, retry dead jobs) goes through pgqueue.AsyncQueue instead.
-- Each request runs its statements in one transaction with a statement timeout
-- (timeout, below). Parameters are psycopg's %(name)s placeholders; none of these is
-- prepared on the server (prepare=False): a generic plan could not drop the filters left
-- NULL nor use a partial index for a status given as a parameter.

-- name: timeout
-- Every transaction of the dashboard starts with this: a page can never hog the database
-- (pg-boss's dashboard does the same). Local: this transaction only, safe behind a pooler.
SELECT set_config('statement_timeout', %(ms)s, true);

-- name: snapshot
-- The reads of one look see the table at one moment (the first statement of its
-- transaction).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: listen_jobs
-- The live pages' hint that jobs were added (the insert trigger's notification).
LISTEN pgqueue;

-- name: listen_done
-- The hint that a job some Queue.result waits for ended.
LISTEN pgqueue_done;

-- name: clock
-- The database's clock (time comes from the database, never the browser's) and the newest
-- job id (two ends of the primary key: cheap).
SELECT now(), statement_timestamp(), coalesce((SELECT max(id) FROM jobs), 0);

-- name: added
-- Jobs added since the last look, by queue: the ids after %(after)s, a range of the primary
-- key as long as the jobs enqueued meanwhile (as pgqueue.monitor counts them). With the
-- ready, running and dead counts of two looks it gives the jobs finished in between.
SELECT queue, count(*) FROM jobs WHERE id > %(after)s GROUP BY queue;

-- name: running
-- The running jobs whose leases end first (jobs_lease_idx), at most %(limit)s: the lease
-- bars. Seconds of lease left by this statement's clock (negative: ran out, the reaper may
-- take the job back), seconds it has run, and how long it waited for its claim.
SELECT id, queue, fence, attempts, max_attempts, group_key, slot, key,
       extract(epoch FROM lease_until - statement_timestamp())::float8 AS left_s,
       extract(epoch FROM statement_timestamp() - started_at)::float8 AS running_s,
       extract(epoch FROM started_at - run_at)::float8 AS waited_s
FROM jobs
WHERE status = 'running'
ORDER BY lease_until, id
LIMIT %(limit)s;

-- name: expired
-- Running jobs whose lease ran out by this statement's clock, by queue (jobs_lease_idx):
-- a reaper (every worker runs one) should take them back soon.
SELECT queue, count(*) FROM jobs
WHERE status = 'running' AND lease_until < statement_timestamp()
GROUP BY queue;

-- name: slot_holders
-- The running jobs holding a seat of a per-group limit (jobs_slot_idx: only running jobs
-- claimed under a limit are in it), by queue, group and seat.
SELECT queue, group_key, slot, id, fence,
       extract(epoch FROM lease_until - statement_timestamp())::float8 AS left_s
FROM jobs
WHERE status = 'running' AND slot IS NOT NULL
ORDER BY queue, group_key, slot
LIMIT %(limit)s;

-- name: queue_exists
-- Whether any job has queue %(queue)s (asked only of a queue with no ready, running or
-- dead job: those are known from the partial indexes). It may read many rows of a large
-- table when there is none: the statement timeout bounds it.
SELECT EXISTS (SELECT FROM jobs WHERE queue = %(queue)s);

-- name: jobs
-- One page of the jobs list, newest first, after the cursor %(before)s (keyset: the
-- page's cost does not grow with how deep it is). Filters left NULL select everything:
-- queue, status, key, and %(text)s found (any case) in the payload (unless %(hide)s: then
-- only in the error) or in the last error. A page of a common status reads the primary key
-- backwards and stops at %(limit)s rows; a rare text or status reads further (the
-- statement timeout bounds it).
SELECT id, queue, status, priority, key, attempts, max_attempts, fence, run_at, started_at,
       finished_at, left(last_error, 300) AS last_error,
       CASE WHEN %(hide)s THEN NULL ELSE left(payload::text, 300) END AS payload
FROM jobs
WHERE id < %(before)s
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
  AND (%(text)s::text IS NULL
       OR (NOT %(hide)s AND strpos(lower(payload::text), lower(%(text)s::text)) > 0)
       OR strpos(lower(last_error), lower(%(text)s::text)) > 0)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: matching_ids
-- The next %(limit)s ids of the jobs a bulk action applies to: those matching the filter
-- (as in jobs) whose status is one of %(statuses)s, below %(before)s, newest first.
SELECT id
FROM jobs
WHERE id < %(before)s
  AND status = ANY(%(statuses)s::text[])
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
  AND (%(text)s::text IS NULL
       OR (NOT %(hide)s AND strpos(lower(payload::text), lower(%(text)s::text)) > 0)
       OR strpos(lower(last_error), lower(%(text)s::text)) > 0)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: delete_finished
-- Delete the finished jobs (done, dead or cancelled) among %(ids)s, with their durable
-- steps in the same statement (as prune does); ready and running jobs are left: cancel
-- them first. Returns the ids deleted.
WITH gone AS (
  DELETE FROM jobs
  WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('done', 'dead', 'cancelled')
  RETURNING id
),
steps_gone AS (
  DELETE FROM pgqueue_steps WHERE job_id IN (SELECT id FROM gone)
)
SELECT id FROM gone;

-- name: run_schedule
-- "Run now" for schedule %(name)s: one job for the slot of this second, by the periodic
-- jobs' own rule (periodic.py, schedule_tick): the slot takes its row in pgqueue_slots
-- first, whose primary key lets one job exist per slot, so a second click in the same
-- second (or a tick that made this very slot) adds nothing. The job copies the task, its
-- attempts and priority from the schedule's newest slot job still in the table (the
-- schedules table does not record the task), with "manual": true beside the usual keys.
-- Returns whether the schedule exists, whether a job to copy was found, the slot, and the
-- job made (NULL: the slot had one already; its job_id then).
WITH schedule AS (
  SELECT name, queue FROM pgqueue_schedules WHERE name = %(name)s
),
model AS (
  SELECT j.payload ->> 'task' AS task, j.max_attempts, j.priority
  FROM pgqueue_slots AS s JOIN jobs AS j ON j.id = s.job_id
  WHERE s.schedule = %(name)s AND j.payload ? 'task'
  ORDER BY s.slot DESC
  LIMIT 1
),
taken AS (
  INSERT INTO pgqueue_slots (schedule, slot, job_id)
  SELECT %(name)s, date_trunc('second', now()), nextval('jobs_id_seq')
  FROM schedule, model
  ON CONFLICT (schedule, slot) DO NOTHING
  RETURNING slot, job_id
),
made AS (
  INSERT INTO jobs (id, queue, payload, max_attempts, priority)
  SELECT taken.job_id, schedule.queue,
         jsonb_build_object('task', model.task, 'kwargs', '{}'::jsonb,
                            'schedule', %(name)s::text, 'slot', taken.slot, 'manual', true),
         model.max_attempts, model.priority
  FROM taken, schedule, model
  RETURNING id
)
SELECT EXISTS (SELECT FROM schedule), EXISTS (SELECT FROM model),
       date_trunc('second', now()), (SELECT id FROM made),
       (SELECT job_id FROM pgqueue_slots
        WHERE schedule = %(name)s AND slot = date_trunc('second', now()));
