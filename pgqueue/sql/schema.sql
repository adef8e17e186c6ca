-- pgqueue schema: the seed's jobs table, its partial indexes, an archive for pruned jobs,
-- the per-group limits of queues, a trigger that sends one wake-up hint per queue per
-- statement, the two small tables of periodic jobs, and the durable steps of jobs.
--
-- install() never runs this file whole. It reads the catalog first (`installed`,
-- `installed_indexes`) and runs only the blocks for what is missing: on a new database
-- every CREATE below in one transaction (the indexes without CONCURRENTLY: the table is
-- new and empty); on a table of an earlier pgqueue the ALTERs, each index built
-- CONCURRENTLY and the status check validated in a statement of its own, so claims,
-- heartbeats and completions go on meanwhile. On a current table it changes nothing and
-- takes no lock on jobs.

-- name: jobs_table
-- The table. Columns after last_error came after the first release: an older table gets
-- them from add_columns, in the same order, so both kinds of table look alike.
CREATE TABLE IF NOT EXISTS jobs (
  id           bigserial   PRIMARY KEY,
  queue        text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       text        NOT NULL DEFAULT 'ready', -- ready running done dead cancelled
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 5,
  lease_until  timestamptz,
  fence        bigint      NOT NULL DEFAULT 0,
  last_error   text,
  priority     int         NOT NULL DEFAULT 0, -- higher first
  key          text,                           -- unique while ready/running
  started_at   timestamptz,                    -- the latest attempt began
  finished_at  timestamptz,                    -- done, dead or cancelled
  group_key    text,                           -- limited together (pgqueue_limits)
  slot         int,                            -- its group's slot, while running under a limit
  result       jsonb,                          -- the handler's return value (done; NULL: None)
  traceback    text,                           -- the last failed attempt's, bounded
  CONSTRAINT jobs_status_check CHECK (status IN ('ready', 'running', 'done', 'dead', 'cancelled'))
);

-- name: add_columns
-- Upgrade: the columns a first-release table lacks. A constant default makes this a
-- catalog change (no rewrite), but it still needs a moment of ACCESS EXCLUSIVE lock.
ALTER TABLE jobs
  ADD COLUMN IF NOT EXISTS priority    int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS key         text,
  ADD COLUMN IF NOT EXISTS started_at  timestamptz,
  ADD COLUMN IF NOT EXISTS finished_at timestamptz,
  ADD COLUMN IF NOT EXISTS group_key   text,
  ADD COLUMN IF NOT EXISTS slot        int,
  ADD COLUMN IF NOT EXISTS result      jsonb,
  ADD COLUMN IF NOT EXISTS traceback   text;

-- name: add_status_check
-- Upgrade: the statuses a job can have, checked from now on; old rows are checked by
-- validate_status_check, which does not stop writes (a first-release table had no check).
ALTER TABLE jobs ADD CONSTRAINT jobs_status_check
  CHECK (status IN ('ready', 'running', 'done', 'dead', 'cancelled')) NOT VALID;

-- name: validate_status_check
-- Upgrade: read every row once under a SHARE UPDATE EXCLUSIVE lock (writes go on).
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_status_check;

-- name: jobs_ready_idx
-- Ready jobs, in the claim's order (priority, then oldest, then first in), so the claim
-- reads the first rows of this index instead of sorting every ready job. It stays small
-- however many done jobs the table holds. (A first-release table has it on (queue,
-- run_at): install() sets that one aside, builds this one, then drops the old.)
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ready_idx ON jobs (queue, priority DESC, run_at, id)
  WHERE status = 'ready';

-- name: jobs_lease_idx
-- Running jobs, for the reaper's lease check.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_lease_idx ON jobs (lease_until)
  WHERE status = 'running';

-- name: jobs_dead_idx
-- Dead jobs, which need a person: counted and listed by stats without reading done rows.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_dead_idx ON jobs (queue, finished_at)
  WHERE status = 'dead';

-- name: jobs_key_idx
-- A job's key is taken while the job is ready or running: the database enforces it, so
-- concurrent enqueues cannot both add one. Also small: only live jobs with a key.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_key_idx ON jobs (queue, key)
  WHERE key IS NOT NULL AND status IN ('ready', 'running');

-- name: jobs_slot_idx
-- At most per_group running jobs per group of a limited queue: a claim gives each job it
-- takes under a limit a slot from 1 to per_group, and two running jobs of one group can
-- never hold the same slot. The database decides, so the limit holds across any number
-- of workers and hosts (see the claim in queries.sql). A job leaves its slot by leaving
-- 'running', however that happens. Only jobs claimed under a limit are in it: claims and
-- heartbeats of every other job never touch it.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_slot_idx ON jobs (queue, group_key, slot)
  WHERE status = 'running' AND slot IS NOT NULL;

-- name: set_index_aside
-- Upgrade: an index of an older definition keeps serving claims under another name
-- while its successor is built.
ALTER INDEX {index} RENAME TO {aside};

-- name: drop_index
-- Upgrade: an index set aside, or left INVALID by an interrupted build (rebuilt next).
DROP INDEX CONCURRENTLY IF EXISTS {index};

-- name: archive_table
-- Where prune(archive=True) moves done jobs: the same columns in the same order.
CREATE TABLE IF NOT EXISTS jobs_archive (LIKE jobs);

-- name: archive_columns
-- Upgrade: an archive made by the first release gets the columns jobs got.
ALTER TABLE jobs_archive
  ADD COLUMN IF NOT EXISTS priority    int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS key         text,
  ADD COLUMN IF NOT EXISTS started_at  timestamptz,
  ADD COLUMN IF NOT EXISTS finished_at timestamptz,
  ADD COLUMN IF NOT EXISTS group_key   text,
  ADD COLUMN IF NOT EXISTS slot        int,
  ADD COLUMN IF NOT EXISTS result      jsonb,
  ADD COLUMN IF NOT EXISTS traceback   text;

-- name: limits_table
-- How many jobs of one group of a queue may run at once (Queue.limit, `pgqueue limit`);
-- every worker reads it in its claim, so they all obey the same one. A queue not in it has
-- no limit.
CREATE TABLE IF NOT EXISTS pgqueue_limits (
  queue     text PRIMARY KEY,
  per_group int  NOT NULL CHECK (per_group >= 1)
);

-- name: paused_table
-- The paused queues (Queue.pause, `pgqueue pause`): the claim statements read it, so every
-- worker on every host stops claiming from a queue listed here, with no restart. A new
-- table: adding it locks nothing in use.
CREATE TABLE IF NOT EXISTS pgqueue_paused (
  queue     text        PRIMARY KEY,
  paused_at timestamptz NOT NULL DEFAULT now()
);

-- name: schedules_table
-- Periodic jobs (pgqueue/periodic.py): one row per schedule, with the newest slot handled
-- (a job made, or skipped as missed) and the next one, as of the last tick. Every worker
-- ticks it; none leads. A new table: adding it takes no lock on jobs.
CREATE TABLE IF NOT EXISTS pgqueue_schedules (
  name       text        PRIMARY KEY,
  spec       text        NOT NULL,  -- 'cron */5 * * * *' or 'every 30s', as last ticked
  queue      text        NOT NULL,
  last_slot  timestamptz NOT NULL,
  next_slot  timestamptz,
  updated_at timestamptz NOT NULL DEFAULT now()
);

-- name: slots_table
-- One row per slot a job was made for, naming the job: its primary key lets exactly one job
-- exist per slot, however many workers tick and whatever a stale one believes. The tick
-- deletes a schedule's rows a day older than its last slot.
CREATE TABLE IF NOT EXISTS pgqueue_slots (
  schedule text        NOT NULL,
  slot     timestamptz NOT NULL,
  job_id   bigint      NOT NULL,
  PRIMARY KEY (schedule, slot)
);

-- name: steps_table
-- Durable steps (Job.step): the JSON output of each step a job has done, written under the
-- claim by step_put (queries.sql), read back by the job's later attempts instead of running
-- the step again. Removed with its job by prune. No foreign key to jobs: it would make
-- `TRUNCATE jobs` fail and give prune a trigger per row deleted; prune deletes the steps
-- of the jobs it removes in the same statement. A new table: adding it locks nothing in use.
CREATE TABLE IF NOT EXISTS pgqueue_steps (
  job_id     bigint      NOT NULL,
  name       text        NOT NULL,
  output     jsonb       NOT NULL,
  fence      bigint      NOT NULL,  -- the claim that wrote it
  written_at timestamptz NOT NULL,
  PRIMARY KEY (job_id, name)
);

-- name: steps_archive_table
-- Where prune(archive=True) moves the steps of the jobs it moves to jobs_archive.
CREATE TABLE IF NOT EXISTS pgqueue_steps_archive (LIKE pgqueue_steps);

-- name: waiters_table
-- The jobs some Queue.result is waiting for, one row per waiting session: a job's end is
-- notified (pgqueue_done) only when it has a row here. Unlogged: a crash empties it, and
-- the waiters poll on. A row left by a waiter that died costs one extra notification when
-- its job ends. A new table: adding it locks nothing in use.
CREATE UNLOGGED TABLE IF NOT EXISTS pgqueue_waiters (
  job_id bigint      NOT NULL,
  pid    int         NOT NULL DEFAULT pg_backend_pid(),  -- the waiting session
  since  timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (job_id, pid)
);

-- name: notify_function
-- LISTEN/NOTIFY is only a hint: workers poll anyway. Postgres folds identical
-- notifications within one transaction, so a bulk enqueue sends one per queue.
CREATE OR REPLACE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('pgqueue', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
  RETURN NULL;
END $$;

-- name: notify_trigger
-- The wake-up hint, once per INSERT statement. install(notify=False) drops it (notify_off
-- in queries.sql), and its absence is the choice install() keeps from then on.
CREATE OR REPLACE TRIGGER jobs_notify_insert
  AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify();

-- name: installed
-- What is there, from the catalog alone: to_regclass takes no lock on jobs.
SELECT to_regclass('jobs') IS NOT NULL AS jobs,
       to_regclass('jobs_archive') IS NOT NULL AS archive,
       ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass('jobs') AND attnum > 0 AND NOT attisdropped)
         AS jobs_columns,
       ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass('jobs_archive') AND attnum > 0 AND NOT attisdropped)
         AS archive_columns,
       (SELECT convalidated FROM pg_constraint
        WHERE conrelid = to_regclass('jobs') AND conname = 'jobs_status_check')
         AS status_check_valid,
       to_regclass('pgqueue_limits') IS NOT NULL AS limits,
       to_regprocedure('jobs_notify()') IS NOT NULL AS notify_function,
       EXISTS (SELECT 1 FROM pg_trigger
               WHERE tgrelid = to_regclass('jobs') AND tgname = 'jobs_notify_insert')
         AS notify_trigger,
       to_regclass('pgqueue_schedules') IS NOT NULL AS schedules,
       to_regclass('pgqueue_slots') IS NOT NULL AS slots,
       to_regclass('pgqueue_steps') IS NOT NULL AS steps,
       to_regclass('pgqueue_steps_archive') IS NOT NULL AS steps_archive,
       to_regclass('pgqueue_waiters') IS NOT NULL AS waiters,
       to_regclass('pgqueue_paused') IS NOT NULL AS paused;

-- name: installed_indexes
-- The indexes on jobs: name, whether usable, definition, whether a build is running now.
SELECT c.relname::text, i.indisvalid, pg_get_indexdef(i.indexrelid),
       EXISTS (SELECT 1 FROM pg_stat_progress_create_index p
               WHERE p.index_relid = i.indexrelid) AS building
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass('jobs');

-- name: install_lock
-- One installer at a time in this transaction: CREATE ... IF NOT EXISTS races with itself.
SELECT pg_advisory_xact_lock(hashtext('pgqueue.install'));

-- name: install_lock_session
-- One installer at a time across the upgrade's statements, which cannot share a transaction.
SELECT pg_advisory_lock(hashtext('pgqueue.install'));

-- name: install_unlock_session
SELECT pg_advisory_unlock(hashtext('pgqueue.install'));

-- name: lock_timeout
-- How long a DDL statement may wait for a lock before install gives up (local: this
-- transaction only; otherwise the session, put back by the next call).
SELECT set_config('lock_timeout', %(timeout)s, %(local)s);

-- name: current_lock_timeout
SELECT current_setting('lock_timeout');

-- name: lock_holders
-- Who install waited for: the oldest open transaction here, one holding a lock on jobs
-- first (an index built CONCURRENTLY also waits for transactions that never read jobs).
SELECT a.pid, a.state, a.xact_start, left(a.query, 60)
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid() AND a.datname = current_database()
  AND a.xact_start IS NOT NULL
ORDER BY EXISTS (SELECT 1 FROM pg_locks l
                 WHERE l.pid = a.pid AND l.relation = to_regclass('jobs') AND l.granted) DESC,
         a.xact_start
LIMIT 1;
