"""OpenAI-compatible HTTP server over the Medusa engine, with continuous batching and dynamic speculation."""
