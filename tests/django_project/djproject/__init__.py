"""A small Django project on PostgreSQL, for tests/integrations/test_django.py."""
