"""What both APIs use: request guards (host, content type, body timeout), auth, errors,
dependencies, and the steps that reach the engine (sampling, rendering, generation)."""
