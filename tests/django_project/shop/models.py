from __future__ import annotations

from django.db import models


class Mark(models.Model):
    """A row a task wrote: which task, on which attempt, in which process."""

    name = models.CharField(max_length=100)
    attempt = models.IntegerField(null=True)
    pid = models.IntegerField(null=True)
