"""A small Django project on PostgreSQL, for tests/test_django.py."""
