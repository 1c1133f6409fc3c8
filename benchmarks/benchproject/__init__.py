"""A small Django project for the HTTP benchmark (benchmarks/http.py): nothing else."""
