"""End-to-end training pipelines built on fastdata (run with ``python -m pipelines.<name>``)."""
