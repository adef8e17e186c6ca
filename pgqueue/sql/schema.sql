-- pgqueue schema: the seed's jobs table, its two partial indexes, an archive for
-- pruned jobs, and a trigger that sends one wake-up hint per queue per statement.
-- Every statement is idempotent, so install() can run any number of times.

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
  last_error   text
);

-- Columns added after the first release: ADD COLUMN IF NOT EXISTS upgrades a table made
-- by an older pgqueue in place (`pgqueue init` again). jobs_archive gets the same columns
-- in the same order below, so pruning can move whole rows.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS priority    int NOT NULL DEFAULT 0; -- higher first
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS key         text;        -- unique while ready/running
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS started_at  timestamptz; -- the latest attempt began
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS finished_at timestamptz; -- done, dead or cancelled

-- The statuses a job can have, enforced (a table of the first release had no check).
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_constraint
                 WHERE conrelid = 'jobs'::regclass AND conname = 'jobs_status_check') THEN
    ALTER TABLE jobs ADD CONSTRAINT jobs_status_check
      CHECK (status IN ('ready', 'running', 'done', 'dead', 'cancelled'));
  END IF;
END $$;

-- Ready jobs, in the claim's order (priority, then oldest, then first in), so the claim
-- reads the first rows of this index instead of sorting every ready job. It stays small
-- however many done jobs the table holds. A table made by an older pgqueue has this index
-- without priority and id: rebuild it once.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_indexes
             WHERE schemaname = current_schema() AND indexname = 'jobs_ready_idx'
               AND indexdef NOT LIKE '%(queue, priority DESC, run_at, id)%') THEN
    DROP INDEX jobs_ready_idx;
  END IF;
END $$;
CREATE INDEX IF NOT EXISTS jobs_ready_idx ON jobs (queue, priority DESC, run_at, id)
  WHERE status = 'ready';
-- Running jobs, for the reaper's lease check.
CREATE INDEX IF NOT EXISTS jobs_lease_idx ON jobs (lease_until) WHERE status = 'running';
-- Dead jobs, which need a person: counted and listed by stats without reading done rows.
CREATE INDEX IF NOT EXISTS jobs_dead_idx ON jobs (queue, finished_at) WHERE status = 'dead';
-- A job's key is taken while the job is ready or running: the database enforces it, so
-- concurrent enqueues cannot both add one. Also small: only live jobs with a key.
CREATE UNIQUE INDEX IF NOT EXISTS jobs_key_idx ON jobs (queue, key)
  WHERE key IS NOT NULL AND status IN ('ready', 'running');

-- Where prune(archive=True) moves done jobs.
CREATE TABLE IF NOT EXISTS jobs_archive (LIKE jobs);
ALTER TABLE jobs_archive ADD COLUMN IF NOT EXISTS priority    int NOT NULL DEFAULT 0;
ALTER TABLE jobs_archive ADD COLUMN IF NOT EXISTS key         text;
ALTER TABLE jobs_archive ADD COLUMN IF NOT EXISTS started_at  timestamptz;
ALTER TABLE jobs_archive ADD COLUMN IF NOT EXISTS finished_at timestamptz;

-- LISTEN/NOTIFY is only a hint: workers poll anyway. Postgres folds identical
-- notifications within one transaction, so a bulk enqueue sends one per queue.
CREATE OR REPLACE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('pgqueue', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
  RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER jobs_notify_insert
  AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify();
