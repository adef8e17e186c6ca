-- The statements of pgqueue.monitor. Each look runs them in one REPEATABLE READ READ ONLY
-- transaction, so they see the table at one moment, on the monitor's own connection.
-- Nothing here reads the done jobs: the counts go through the partial indexes, the new
-- jobs through a range of the primary key, the leases through jobs_lease_idx.
-- %(queues)s: only these queues (NULL: every queue).

-- name: monitor_clock
-- The database's clock (time comes from the database) and the newest job id.
SELECT now(), coalesce((SELECT max(id) FROM jobs), 0);

-- name: monitor_counts
-- Ready, running and dead jobs by queue (jobs_ready_idx, jobs_lease_idx, jobs_dead_idx),
-- and the jobs added since the last look: ids after %(after)s (NULL on the first look),
-- as many rows as were enqueued meanwhile. The monitor derives the jobs finished between
-- two looks from these: live and dead before, minus live and dead now, plus the added.
SELECT queue, 'ready' AS status, count(*) AS jobs FROM jobs
WHERE status = 'ready' AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
GROUP BY queue
UNION ALL
SELECT queue, 'running', count(*) FROM jobs
WHERE status = 'running' AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
GROUP BY queue
UNION ALL
SELECT queue, 'dead', count(*) FROM jobs
WHERE status = 'dead' AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
GROUP BY queue
UNION ALL
SELECT queue, 'added', count(*) FROM jobs
WHERE id > %(after)s AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
GROUP BY queue;

-- name: monitor_leases
-- The running jobs whose leases end first (at most %(limit)s): id, queue, fence, attempt,
-- seconds of lease left (negative: it ran out, the reaper may take the job back) and
-- seconds since the attempt began. By this statement's clock, not now(): the look's
-- transaction began earlier, and a heartbeat that committed since (this statement sees it)
-- set lease_until from a later now(), so now() would show more than a whole lease left.
SELECT id, queue, fence, attempts,
       extract(epoch FROM lease_until - statement_timestamp())::float8,
       extract(epoch FROM statement_timestamp() - started_at)::float8
FROM jobs
WHERE status = 'running' AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
ORDER BY lease_until, id
LIMIT %(limit)s;

-- name: monitor_side_tables
-- Whether the periodic jobs' and the per-group limits' tables exist (an installation from
-- before them has neither until `pgqueue init`): read once, from the catalog.
SELECT to_regclass('pgqueue_schedules') IS NOT NULL, to_regclass('pgqueue_limits') IS NOT NULL;

-- name: monitor_schedules
-- Each periodic schedule of the queues watched: its name, queue, last slot handled and
-- next slot, as the last tick left them (a few rows: one per schedule).
SELECT name, queue, last_slot, next_slot FROM pgqueue_schedules
WHERE %(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[])
ORDER BY name;

-- name: monitor_limits
-- Each limited queue watched, its limit per group, and its groups' running jobs holding a
-- slot (jobs_slot_idx: only running jobs claimed under a limit are in it), busiest first.
SELECT l.queue, l.per_group, j.group_key, count(j.id)
FROM pgqueue_limits l
LEFT JOIN jobs j ON j.queue = l.queue AND j.status = 'running' AND j.slot IS NOT NULL
WHERE %(queues)s::text[] IS NULL OR l.queue = ANY(%(queues)s::text[])
GROUP BY l.queue, l.per_group, j.group_key
ORDER BY l.queue, count(j.id) DESC, j.group_key;
