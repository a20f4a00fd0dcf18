"""Tasks are thin: they take a job id, re-read the job from the catalog and run the steps not done yet.
`enqueue` is the one place that hands a job to the broker."""

from __future__ import annotations

from kombu.exceptions import OperationalError

from factory import settings
from factory.catalog import JobState, mask_url
from factory.errors import FactoryError, ServiceUnavailable
from factory.pipeline import Factory
from workers.app import app


@app.task(name="quantfactory.run_job", ignore_result=True)  # outcomes live in the catalog
def run_job(job_id: str) -> str:
    """Run (or continue) a job; its outcome lives in the catalog, the return value is only its final state."""
    factory = Factory(settings.load())
    try:
        return factory.execute(job_id).state
    except FactoryError:
        return factory.catalog.job(job_id).state


def enqueue(factory: Factory, job_id: str) -> None:
    """Queue `job_id` on the gpu queue; a broker that cannot be reached fails the job and raises (exit 5)."""
    factory.catalog.set_job_state(job_id, JobState.queued)
    try:
        run_job.apply_async(args=[job_id], queue="gpu", retry=False)
    except OperationalError:
        message = f"the broker at {mask_url(factory.settings.broker_url)} cannot be reached"
        factory.catalog.set_job_state(job_id, JobState.failed, message, ServiceUnavailable.exit_code)
        raise ServiceUnavailable(message) from None
