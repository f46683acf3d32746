"""lapse serve: an OpenAI-compatible HTTP server over the generation engine."""
