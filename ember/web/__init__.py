"""The HTTP layer: the service's API and the OpenAI-compatible inference endpoints."""
