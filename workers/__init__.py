"""The distributed factory: a Celery app on Redis whose tasks run the same pipeline steps as `qf run`."""
