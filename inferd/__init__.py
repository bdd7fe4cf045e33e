"""inferd: the inference worker. It attaches to memd with shared.client.MemdClient,
maps the pool and runs the model over it; the worker itself is built by a later issue."""
