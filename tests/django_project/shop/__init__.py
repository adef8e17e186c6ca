"""The test project's app: a model to write from tasks, and the tasks."""
