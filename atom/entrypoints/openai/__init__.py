"""OpenAI-compatible HTTP server: ``build_app`` for embedding, ``serve``/``run_server`` for the CLI."""

from atom.entrypoints.openai.server import SERVER_KEY, build_app, run_server, serve, start_site

__all__ = ["build_app", "serve", "run_server", "start_site", "SERVER_KEY"]
