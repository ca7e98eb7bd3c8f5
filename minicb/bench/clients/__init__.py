"""Standard clients (lm-eval, guidellm) against python -m minicb serve: requirements, tasks, and
compare.py."""
