"""Tests that start real server processes (gunicorn) against a real PostgreSQL."""
