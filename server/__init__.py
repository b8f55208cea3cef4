"""The HTTP service (FastAPI + uvicorn) around model.runner. Built by the Serving issue."""
