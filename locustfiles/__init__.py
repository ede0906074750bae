"""Load testing: Locust users and shapes (chat.py, load.py), and `make load`'s driver and
report (run.py). Nothing here imports Locust at package import: only the locustfiles do."""
