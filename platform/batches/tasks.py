from celery import shared_task

from batches import selectors, services
from batches.runner import batch_run


@shared_task(name="batches.run_batch")
def run_batch(batch_id: str) -> str:
    """Run a batch to its end; queued when it is created, and by the sweep."""
    return batch_run(batch_id=batch_id)


@shared_task(name="batches.sweep_batches")
def sweep_batches() -> list[str]:
    """Queue a runner for every batch not yet ended that no runner holds and none waits to
    (``selectors.batches_unattended``): a batch whose task was lost, one whose worker died (its
    lease ran out), one past its window (its runner expires it)."""
    batch_ids = selectors.batches_unattended()
    for batch_id in batch_ids:
        services.batch_queue_run(batch_id=batch_id, queue=run_batch.delay)
    return batch_ids


@shared_task(name="batches.purge_orphaned_files")
def purge_orphaned_files() -> int:
    """Daily: remove stored bytes no file row names (``services.files_orphaned_purge``)."""
    return services.files_orphaned_purge()
