"""pgqueue's integrations: each imports its framework only when it is used.

- ``pgqueue.contrib.django``: a ``django.tasks`` backend and its ``pgqueue_worker`` command.
- ``pgqueue.contrib.dashboard``: the web dashboard (Starlette), ``pgqueue dashboard``.
"""
