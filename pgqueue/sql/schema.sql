-- pgqueue schema: the seed's jobs table, its two partial indexes, an archive for
-- pruned jobs, and a trigger that sends one wake-up hint per queue per statement.
-- Every statement is idempotent, so install() can run any number of times.

CREATE TABLE IF NOT EXISTS jobs (
  id           bigserial   PRIMARY KEY,
  queue        text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       text        NOT NULL DEFAULT 'ready', -- ready | running | done | dead
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 5,
  lease_until  timestamptz,
  fence        bigint      NOT NULL DEFAULT 0,
  last_error   text
);

-- Ready jobs, for claiming; stays small however many done jobs the table holds.
CREATE INDEX IF NOT EXISTS jobs_ready_idx ON jobs (queue, run_at) WHERE status = 'ready';
-- Running jobs, for the reaper's lease check.
CREATE INDEX IF NOT EXISTS jobs_lease_idx ON jobs (lease_until) WHERE status = 'running';

-- Where prune(archive=True) moves done jobs.
CREATE TABLE IF NOT EXISTS jobs_archive (LIKE jobs);

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
