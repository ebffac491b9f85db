"""The service's HTTP and websocket surface: the FastAPI app and its routes (REST `/v1/enhance`,
websocket `/v1/stream`, health, metrics, the demo page), the API-key check, and audio in and out of
requests."""
