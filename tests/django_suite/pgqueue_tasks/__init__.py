"""Django's ``tests/tasks`` suite pointed at ``pgqueue.contrib.django.TaskBackend``: copied
into the unpacked sdist's ``tests/`` and run as ``runtests.py pgqueue_tasks``."""
