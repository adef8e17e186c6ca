from pgqueue import Queue


def test_claim_then_complete(queue: Queue) -> None:
    job_id = queue.enqueue({"n": 1}, queue="q")
    [job] = queue.claim("q", limit=5, lease=10)
    assert (job.id, job.fence, job.attempts) == (job_id, 1, 1)
    assert queue.complete(job)
    assert not queue.complete(job)
