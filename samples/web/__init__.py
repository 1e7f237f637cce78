"""An HTTP service placing orders through a unit of work (FastAPI)."""
