-- Counterfactuals: the mistakes the course makes on purpose, to show what goes wrong.
-- NEVER use these in real code. pgqueue.lab runs them; queries.sql has the right way.
-- Each block starts with "-- name: <name>" and a one-line description.

-- name: select_ready_unlocked
-- Step 1 of a claim WITHOUT any row lock: other workers can read the same ids meanwhile.
SELECT id FROM jobs
WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
ORDER BY run_at
LIMIT %(limit)s;

-- name: select_ready_wait
-- Step 1 of a claim with FOR UPDATE but no SKIP LOCKED: waits for rows others have locked.
SELECT id FROM jobs
WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
ORDER BY run_at
LIMIT %(limit)s
FOR UPDATE;

-- name: select_ready_skip
-- Step 1 of the same slow claim with SKIP LOCKED (the control): passes locked rows by.
SELECT id FROM jobs
WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
ORDER BY run_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: hold
-- Keep the claiming transaction open a while (slow client, network, work done inside it).
SELECT pg_sleep(%(seconds)s);

-- name: mark_running
-- Step 2: take the selected ids. No "status = 'ready'" re-check: the unlocked claim's flaw.
UPDATE jobs
SET status      = 'running',
    attempts    = attempts + 1,
    fence       = fence + 1,
    lease_until = now() + make_interval(secs => %(lease)s)
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id, queue, payload, fence, attempts, max_attempts, lease_until;

-- name: complete_ignoring_fence
-- Mark a job done by id alone: a stale holder's late complete is silently accepted.
UPDATE jobs
SET status = 'done', lease_until = NULL
WHERE id = %(id)s;

-- name: write_report_ignoring_fence
-- Write a report row whatever fence it carries: the last writer wins, even a late one.
INSERT INTO reports (id, body, fence)
VALUES (%(id)s, %(body)s, %(fence)s)
ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, fence = EXCLUDED.fence;
